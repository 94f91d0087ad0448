"""Checkpoint files: atomic writes, everything in them checked when loaded, falling back past a corrupt
one."""

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpidist.runtime.errors import UsageError
from mpidist.store import checkpoint
from crafted import MARKER, external_storage


def write(directory, step):
    return checkpoint.save(
        directory,
        np.full(5, float(step)),
        {"m": np.zeros(5)},
        step,
        step,
        0,
        step,
        '{"seed": 1}',
        seed=11,
        workers=3,
        per_worker={"params": np.arange(10.0).reshape(2, 5), "m": np.ones((2, 5))},
    )


def test_a_checkpoint_round_trips_and_leaves_nothing_aside(tmp_path):
    path = write(tmp_path, 7)
    loaded = checkpoint.load(path)
    assert path.name == "ckpt-00000007.h5" and loaded.step == 7 and loaded.optimizer_steps == 7  # no lineage
    np.testing.assert_array_equal(loaded.params, np.full(5, 7.0))
    assert loaded.seed == 11 and loaded.config == {"seed": 1}  # the seed that drew the streams wins
    with h5py.File(path) as handle:
        order, rng = json.loads(handle.attrs["data_order"]), json.loads(handle.attrs["rng"])
    assert (order["seed"], order["epoch_step"], order["workers"], rng["step"]) == (11, 7, 3, 7)
    # a row per worker
    np.testing.assert_array_equal(loaded.per_worker["params"], np.arange(10.0).reshape(2, 5))
    assert sorted(loaded.per_worker) == ["m", "params"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000007.h5"]


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(tmp_path):
    write(tmp_path, 10)
    newest = write(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[:200])  # truncated by a failing disk
    loaded, skipped = checkpoint.newest_valid(tmp_path)
    assert loaded.step == 10
    assert [path.name for path, _ in skipped] == ["ckpt-00000020.h5"] and "not a readable" in skipped[0][1]
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        checkpoint.load(newest)


def test_an_empty_directory_has_nothing_to_resume(tmp_path):
    assert checkpoint.newest_valid(tmp_path / "missing") == (None, [])


def tampered(tmp_path, change):
    """A good checkpoint, then ``change(handle)`` applied to it in place."""
    path = write(tmp_path, 3)
    with h5py.File(path, "a") as handle:
        change(handle)
    return path


def replace(name, value):
    def change(handle):
        del handle[name]
        handle[name] = value

    return change


def named(shapes):
    """A ``parameters/`` group naming ``shapes`` (None: a group where an array would be)."""

    def change(handle):
        group = handle.create_group("parameters")
        for name, shape in shapes.items():
            if shape is None:
                group.create_group(name)
            else:
                group.create_dataset(name, shape=shape, dtype="f8")

    return change


def set_attr(name, value, group="/"):
    def change(handle):
        handle[group].attrs[name] = value

    return change


@pytest.mark.parametrize(
    "change,message",
    [
        (replace("params", np.full(5, np.nan)), "params holds NaN or Inf (5 of 5 values)"),
        (replace("params", np.ones((5, 2))), "params has shape (5, 2)"),
        (replace("params", np.arange(5)), "params is not an array of floats"),
        (replace("optimizer/m", np.zeros(3)), "optimizer/m has shape (3,)"),
        (replace("optimizer/m", np.array([np.inf] * 5)), "optimizer/m holds NaN or Inf"),
        (set_attr("step", -4), "attribute step is -4; it must be an integer from 0"),
        (set_attr("step", "ten"), "attribute step is 'ten'"),
        (set_attr("epoch", np.array([1, 2])), "attribute epoch is an array of shape (2,)"),
        (set_attr("steps", 2.5, group="optimizer"), "attribute optimizer/steps is 2.5"),
        (set_attr("config", "[1, 2]"), "attribute config is not a JSON object"),
        (set_attr("lineage", "../../x"), "attribute lineage is '../../x'"),
        (set_attr("rng", '{"seed": -1}'), "rng seed is -1"),
        (set_attr("format", "something else"), "not an mpidist checkpoint"),
        (replace("workers/params", np.zeros((2, 4))), "workers/params has shape (2, 4)"),
        (replace("workers/params", np.zeros(5)), "workers/params has shape (5,)"),
        (
            replace("workers/params", np.zeros((2, 5), dtype=np.float32)),
            "workers/params has shape (2, 5) and dtype float32",
        ),
        (replace("workers/m", np.zeros((3, 5))), "workers holds rows for different worker counts ([2, 3])"),
        (replace("workers/m", np.full((2, 5), np.nan)), "workers/m holds NaN or Inf (10 of 10 values)"),
        (
            lambda handle: handle.create_dataset("parameters", data=np.zeros(3)),
            "parameters is not a group of the model's parameters",
        ),
        (named({"0000.Dense.W": (2, 2)}), "parameters name 4 values in all, where params holds 5"),
        (
            named({"0000.Dense.W": (2, 2), "0000.Dense.b": None}),
            "parameters/0000.Dense.b is not a parameter's",
        ),
    ],
)
def test_everything_read_from_a_checkpoint_is_checked_before_use(tmp_path, change, message):
    path = tampered(tmp_path, change)
    with pytest.raises(UsageError) as caught:
        checkpoint.load(path)
    assert message in str(caught.value) and str(path) in str(caught.value)


def elsewhere(tmp_path):
    """A raw file and an HDF5 file (its ``secret``) of markers, beside the checkpoint."""
    np.full(64, MARKER).tofile(tmp_path / "values.bin")
    with h5py.File(tmp_path / "other.h5", "w") as handle:
        handle["secret"] = np.full((2, 5), MARKER)
        handle["flat"] = np.full(5, MARKER)
    return tmp_path / "values.bin", tmp_path / "other.h5"


def external_link(handle, raw, other):
    del handle["params"]
    handle["params"] = h5py.ExternalLink(str(other), "flat")


def soft_link_through_an_external_link(handle, raw, other):
    del handle["params"]
    handle["door"] = h5py.ExternalLink(str(other), "/")
    handle["params"] = h5py.SoftLink("/door/flat")


def link_nothing_reads(handle, raw, other):
    handle["notes"] = h5py.ExternalLink(str(other), "secret")


def virtual_dataset_nothing_reads(handle, raw, other):
    layout = h5py.VirtualLayout((5,), np.float64)
    layout[:] = h5py.VirtualSource(str(other), "flat", (5,))
    handle.create_virtual_dataset("notes", layout)


@pytest.mark.parametrize(
    "change, words",
    [
        (external_storage("params"), "'params' keeps its values in '"),
        (external_storage("optimizer/m"), "'optimizer/m' keeps its values in '"),
        (external_storage("workers/params"), "'workers/params' keeps its values in '"),
        (external_link, "'params' is an external link to '"),
        (soft_link_through_an_external_link, "'door' is an external link to '"),
        (link_nothing_reads, "'notes' is an external link to '"),
        (virtual_dataset_nothing_reads, "'notes' is a virtual dataset reading '"),
    ],
    ids=["params", "optimizer", "worker rows", "external link", "soft link", "unread link", "unread virtual"],
)
def test_an_item_that_reads_another_file_is_refused_before_anything_is_read(tmp_path, change, words):
    raw, other = elsewhere(tmp_path)
    path = tampered(tmp_path, lambda handle: change(handle, raw, other))
    for arrays in (True, False):
        with pytest.raises(UsageError) as refused:
            checkpoint.load(path, arrays=arrays)
        message = str(refused.value)
        assert message.startswith(f"{path}: ") and words in message, message
        assert message.endswith("refused, as it reads another file"), message


def test_attributes_are_refused_by_their_size_before_they_are_read(tmp_path):
    path = write(tmp_path, 3)
    dense = tmp_path / "dense.h5"  # (an attribute over 64 KiB needs HDF5's dense attribute storage)
    with h5py.File(path, "r") as source, h5py.File(dense, "w", libver="latest") as copy:
        for name in source:
            source.copy(source[name], copy, name)
        copy.attrs.update(source.attrs)
        # valid JSON, so that nothing after the read would refuse it
        copy.attrs["config"] = np.bytes_(b"{" + b" " * (2 << 20) + b"}")
    with pytest.raises(UsageError) as refused:
        checkpoint.load(dense)
    assert f"{dense}: attribute config holds 2.0 MiB (1 value(s) of 2,097,154 bytes), more than the " in str(
        refused.value
    )
    with h5py.File(dense, "a") as handle:
        handle.attrs["config"] = '{"seed": 1}'
        handle.attrs["lineage"] = np.array(["0123abcd"] * 3, dtype=h5py.string_dtype())
    with pytest.raises(UsageError, match="attribute lineage holds 3 value.s. of variable length"):
        checkpoint.load(dense, arrays=False)
    assert checkpoint.settings_of(dense) == {"seed": 1}
    with h5py.File(dense, "a") as handle:
        handle.attrs["config"] = np.bytes_(b"{" + b" " * (2 << 20) + b"}")
    assert checkpoint.settings_of(dense) is None  # (only looked at: passed over)


def test_a_checkpoint_larger_than_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from mpidist.runtime import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 50)
    monkeypatch.setattr(memory, "ranks_per_node", lambda: 1)
    # params and optimizer/m, and the two workers' rows of params and m: 6 x 5 float64
    with pytest.raises(UsageError, match="needs 240 B, more than this rank's share"):
        checkpoint.load(write(tmp_path, 3))


# -- what each worker holds of its own: a run stopped and resumed ends where an uninterrupted one does -------
PER_WORKER_RUNS = {
    # between averages local-sgd's workers hold their own parameters; their Adam moments always differ
    "local-sgd": ["--strategy", "local-sgd", "--sync-every", "4", "--optimizer", "adam", "--lr", "0.01"],
    # --compress keeps each worker's rounding error (its residual) for its next step
    "allreduce --compress": ["--strategy", "allreduce", "--compress", "bf16", "--exchange", "mpi"],
}


def _final_checkpoint(tmp_path, name, flags, stops):
    """The checkpoint of step 20 of a run on 2 ranks, stopped (and resumed with --resume auto) at
    ``stops``."""
    from conftest import checkpoint_at, mpidist

    directory = tmp_path / name
    for steps in [*stops, 20]:
        done, _ = mpidist(
            2,
            "train",
            *flags,
            "--steps",
            str(steps),
            "--checkpoint-dir",
            str(directory / "ck"),
            "--run-dir",
            str(directory / "run"),
            "--resume",
            "auto",
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    return checkpoint.load(checkpoint_at(directory / "ck", 20))


@pytest.mark.parametrize("strategy", PER_WORKER_RUNS)
def test_a_run_stopped_and_resumed_ends_bitwise_where_an_uninterrupted_one_does(tmp_path, strategy):
    flags = PER_WORKER_RUNS[strategy]
    whole = _final_checkpoint(tmp_path, "whole", flags, [])
    resumed = _final_checkpoint(tmp_path, "resumed", flags, [6])  # (6: between two averages of every 4)
    np.testing.assert_array_equal(resumed.params, whole.params)
    assert sorted(resumed.per_worker) == sorted(whole.per_worker) and len(whole.per_worker) >= 1
    for name, rows in whole.per_worker.items():
        assert rows.shape[0] == 2
        np.testing.assert_array_equal(resumed.per_worker[name], rows, err_msg=name)
    for name, array in whole.optimizer_state.items():
        np.testing.assert_array_equal(resumed.optimizer_state[name], array, err_msg=name)


def test_local_sgd_resumed_on_another_worker_count_starts_every_worker_from_the_mean(tmp_path):
    from conftest import checkpoint_at, mpidist

    flags = PER_WORKER_RUNS["local-sgd"]
    stopped = _final_checkpoint(tmp_path, "two", flags, [])
    assert not np.array_equal(*stopped.per_worker["m"])  # the workers' own moments, kept apart
    done, _ = mpidist(
        3,
        "train",
        *flags,
        "--steps",
        "21",
        "--checkpoint-dir",
        str(tmp_path / "two" / "ck"),
        "--run-dir",
        str(tmp_path / "two" / "run"),
        "--resume",
        "auto",
        "--sync-every",
        "1",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "at step 20" in done.stdout
    after = checkpoint.load(checkpoint_at(tmp_path / "two" / "ck", 21))
    rows = after.per_worker["params"]
    assert rows.shape[0] == 3 and (rows == rows[0]).all()  # (--sync-every 1: averaged at step 21)


def test_array_bytes_written_around_the_cache_fall_back_to_it_where_the_system_refuses(tmp_path, monkeypatch):
    """O_DIRECT opened but refused at the write (EINVAL): the bytes go through the page cache, the file is
    whole."""
    import errno
    import os

    from mpidist.store import bulk

    real = os.pwrite
    direct_fds = set()
    real_open = os.open

    def opening(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        return fd

    def refusing(fd, data, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "pwrite", refusing)
    params = bulk.aligned_empty((100_000,), np.float32)
    params[:] = np.arange(100_000, dtype=np.float32)
    path = checkpoint.save(tmp_path, params, {"m": params * 2}, 3, 5, 0, 5, "{}", 0, 1, "0123abcd")
    monkeypatch.undo()
    loaded = checkpoint.load(path)
    assert (loaded.params == params).all() and (loaded.optimizer_state["m"] == params * 2).all()
    assert direct_fds or not hasattr(os, "O_DIRECT")  # (the direct path was taken, then refused)


#: A checkpoint of format 1 (one file, the flat arrays whole), written by mpidist 0.2.0: ``python -m mpidist
#: --strategy local --model mlp:8 --steps 10`` (digits, float32, Adam).  Kept as it was written, so that every
#: later format (sharded checkpoints) still reads it.
FORMAT_1 = Path(__file__).parent / "checkpoints" / "format1-mlp8-digits.h5"


def test_a_kept_format_1_checkpoint_still_loads_resumes_and_evaluates(tmp_path):
    import mpidist
    from conftest import checkpoint_at, mpidist as run

    kept = FORMAT_1.read_bytes()
    saved = checkpoint.load(FORMAT_1)
    # mlp:8 on digits: Dense 64-8 and 8-10, 610 parameters; Adam's two moments; step 10 of epoch 0
    assert (saved.step, saved.epoch, saved.epoch_step, saved.params.size) == (10, 0, 10, 610)
    assert saved.params.dtype == np.float32 and sorted(saved.optimizer_state) == ["m", "v"]
    assert saved.optimizer_steps == 10 and saved.config["model"] == "mlp:8"
    figures = mpidist.evaluate(str(FORMAT_1))  # (in this process: one rank)
    done, _ = run(2, "eval", str(FORMAT_1), timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{100 * figures['test_accuracy']:.2f}%" in done.stdout and figures["step"] == 10, done.stdout
    done, _ = run(
        2,
        "train",
        "--resume",
        str(FORMAT_1),
        "--model",
        "mlp:8",
        "--steps",
        "14",
        "--strategy",
        "allreduce",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--run-dir",
        "",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"resumed from {FORMAT_1} at step 10" in done.stdout, done.stdout
    resumed = checkpoint.load(checkpoint_at(tmp_path / "ck", 14))
    # (4 steps trained)
    assert resumed.optimizer_steps == 14 and not np.allclose(resumed.params, saved.params)
    assert FORMAT_1.read_bytes() == kept  # (never written to, nor pruned)


def test_an_array_in_a_chunk_far_larger_than_it_is_refused_before_it_is_read(tmp_path):
    from test_bounded import one_compressed_chunk

    def huge_chunk(handle):  # 5 parameters in a chunk of 2^25, gzip'ed: 256 MiB decompressed to read any
        del handle["params"]
        one_compressed_chunk(handle, "params", (5,), np.float64, (1 << 25,), maxshape=(None,))

    path = tampered(tmp_path, huge_chunk)
    for arrays in (True, False):
        with pytest.raises(UsageError) as refused:
            checkpoint.load(path, arrays=arrays)
        assert str(refused.value) == (
            f"{path}: 'params' is stored in chunks of 256.0 MiB each (chunk shape (33554432,)), which a read "
            "decompresses whole, for values of 40 B: not read"
        )


def test_a_whole_checkpoint_names_each_parameter_as_the_role_table_numbers_layers(tmp_path):
    """Issue 63, item 4: whole checkpoints had a flat ``params`` alone; every checkpoint now names each
    parameter ``parameters/<layer number>.<Layer>.<name>``, a view of ``params`` in its own shape, as a split
    model's index does, and loads, resumes and evaluates as before."""
    import mpidist
    from mpidist import nn

    result = mpidist.train(
        "mlp", "digits", steps=3, checkpoint_dir=str(tmp_path), run_dir="", metrics="", progress="none"
    )
    (path,) = result.checkpoints
    model = nn.build_model("mlp", (8, 8), 10, np, np.float32, buffers=False)
    names = model.parameter_names()
    assert names == [
        "0001.Dense.W",
        "0001.Dense.b",
        "0003.Dense.W",
        "0003.Dense.b",
        "0005.Dense.W",
        "0005.Dense.b",
    ]
    with h5py.File(path) as handle:
        assert list(handle["parameters"]) == sorted(names)
        flat = handle["params"][...]
        for name, (_, _, offset, shape, _) in zip(names, model.entries):
            view = handle["parameters"][name]
            assert view.shape == shape and view.is_virtual
            np.testing.assert_array_equal(view[...].reshape(-1), flat[offset : offset + view.size])
    np.testing.assert_array_equal(checkpoint.load(path).params, result.params)
    assert mpidist.evaluate(path)["test_accuracy"] == result.figures["test_accuracy"]


def test_a_layer_inside_a_block_is_named_by_its_path_down_from_the_top_level_layer():
    from mpidist import nn

    model = nn.build_model("transformer:1,16,2", (12,), 5, np, np.float32, buffers=False)
    names = model.parameter_names()
    assert names[:3] == ["0000.TokenConv.W", "0000.TokenConv.b", "0001.PositionalEmbedding.table"]
    assert "0002.TransformerBlock.00.Residual.01.MultiHeadAttention.Wq" in names
    assert len(set(names)) == len(names) == len(model.entries)


def test_a_checkpoint_of_another_model_with_as_many_values_is_refused_naming_a_parameter(tmp_path):
    """mlp:15 and mlp:5,50 both hold 1,135 values: the count alone let one load as the other (found by a
    hostile sweep)."""
    path = tampered(tmp_path, named({"0001.Dense.W": (2, 2), "0001.Dense.b": (1,)}))
    saved = checkpoint.load(path, arrays=False)
    assert saved.named == (("0001.Dense.W", (2, 2)), ("0001.Dense.b", (1,)))
    checkpoint.refuse_another_model(saved, [("0001.Dense.b", (1,)), ("0001.Dense.W", (2, 2))], "it")
    with pytest.raises(
        UsageError, match=r"holds 0001.Dense.W of shape \(2, 2\), where mlp:x has .* \(4, 1\)"
    ):
        checkpoint.refuse_another_model(saved, [("0001.Dense.W", (4, 1)), ("0001.Dense.b", (1,))], "mlp:x")
    with pytest.raises(UsageError, match="holds 2 parameter arrays, where it has 3"):
        extra = [("0001.Dense.W", (2, 2)), ("0001.Dense.b", (1,)), ("0002.Dense.b", (0,))]
        checkpoint.refuse_another_model(saved, extra, "it")
    (tmp_path / "older").mkdir()
    older = checkpoint.load(write(tmp_path / "older", 4), arrays=False)  # (no parameters/ group: unchecked)
    assert older.named is None
    checkpoint.refuse_another_model(older, [("0000.Dense.W", (5,))], "it")


def test_resume_naming_a_directory_takes_its_newest_loadable_checkpoint(tmp_path):
    """As evaluate and predict read a directory (it said "no such checkpoint file" of one that held them)."""
    import io
    import types

    from mpi4py import MPI

    import mpidist
    from mpidist.loop.resuming import find_resume

    directory = tmp_path / "ck"
    mpidist.train(
        "mlp", "digits", comm=MPI.COMM_SELF, checkpoint_dir=str(directory), steps=6, checkpoint_every=3,
        progress="none", metrics="", run_dir="", stream=io.StringIO(),
    )  # fmt: skip
    newest = max(directory.glob("ckpt-*.h5"), key=lambda path: checkpoint.load(path, arrays=False).step)
    lineage = newest.stem.split("-")[-1]
    (directory / f"ckpt-00000099-{lineage}.h5").write_bytes(b"not a checkpoint")  # (newer, unreadable)
    found, skipped = find_resume(types.SimpleNamespace(resume=str(directory), checkpoint_dir=""))
    assert Path(found.path) == newest and found.step == 6 and len(skipped) == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="a directory that holds no checkpoint to resume from"):
        find_resume(types.SimpleNamespace(resume=str(tmp_path / "empty"), checkpoint_dir=""))


@pytest.mark.parametrize("name", ["run directory", "its checkpoints"])
def test_resume_naming_a_run_directory_or_its_checkpoints_continues_that_run(tmp_path, monkeypatch, name):
    """--resume DIR continues in the run directory it came from, as --resume FILE does (it began a new
    one)."""
    import io

    from mpi4py import MPI

    import mpidist

    monkeypatch.chdir(tmp_path)
    quiet = dict(comm=MPI.COMM_SELF, progress="none", stream=io.StringIO(), checkpoint_every=2)
    mpidist.train("mlp", "digits", steps=2, **quiet)
    (run,) = (tmp_path / "runs").iterdir()
    resume = run if name == "run directory" else run / "checkpoints"
    mpidist.train("mlp", "digits", steps=4, resume=str(resume), **quiet)
    assert list((tmp_path / "runs").iterdir()) == [run]
    steps = [checkpoint.load(path, arrays=False).step for path in (run / "checkpoints").glob("ckpt-*.h5")]
    assert max(steps) == 4


def test_a_checkpoint_directory_that_is_a_broken_link_is_named_so(tmp_path):
    from mpidist.store.checkpoint_save import prepare_directory

    (tmp_path / "ck").symlink_to(tmp_path / "gone")
    with pytest.raises(UsageError, match="ck: exists and is a symbolic link to nothing"):
        prepare_directory(str(tmp_path / "ck"))
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="file: exists and is not a directory"):
        prepare_directory(str(tmp_path / "file"))
