"""Runs of a split model write sharded checkpoints: each rank its own slices, the chief an index over them.

Pipeline stages and tensor parts write their parts; the index reads as a whole checkpoint (h5py by parameter
name, ``eval``, ``--resume`` on another layout), and pruning takes a checkpoint's parts with its index.
"""

import json
import os
import signal
import time

import h5py
import numpy as np
import pytest

from conftest import checkpoint_at, events, mpidist, rank_pids, start_mpidist, wait_for_step
from mpidist.store import checkpoint, parts_debris, sharded

TRAIN = [
    "train",
    "--data",
    "digits",
    "--model",
    "mlp:16,16",
    "--batch-size",
    "32",
    "--dtype",
    "float64",
    "--eval-every",
    "0",
    "--progress",
    "none",
    "--seed",
    "3",
    "--checkpoint-wait",
]
LAYOUTS = {
    "pipeline": (2, ["--strategy", "pipeline", "--stages", "2"]),
    "tensor": (2, ["--strategy", "allreduce", "--tensor", "2"]),
    "pipeline x data": (4, ["--strategy", "pipeline", "--stages", "2"]),
}


def train(tmp_path, name, ranks, layout, *more):
    directory = tmp_path / name
    done, _ = mpidist(
        ranks,
        *TRAIN,
        *layout,
        "--run-dir",
        str(directory / "run"),
        "--checkpoint-dir",
        str(directory / "ck"),
        *more,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return directory


def folders(directory):
    return sorted(path.name for path in directory.iterdir() if path.is_dir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training on one rank, 6 steps, its format-1 checkpoint: what every layout must end equal
    to."""
    directory = train(tmp_path_factory.mktemp("local"), "local", 1, ["--strategy", "local"], "--steps", "6")
    return checkpoint.load(checkpoint_at(directory / "ck", 6))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_split_model_writes_its_parts_and_an_index_equal_to_one_process(tmp_path, reference, layout):
    ranks, flags = LAYOUTS[layout]
    directory = train(tmp_path, "run", ranks, flags, "--steps", "6", "--checkpoint-every", "2", "--keep", "2")
    ck = directory / "ck"
    index = checkpoint_at(ck, 6)
    # ckpt 2 pruned with its parts: two indexes, two folders, each named by its index
    assert sorted(p.name for p in ck.glob("ckpt-*.h5")) == [checkpoint_at(ck, 4).name, index.name]
    assert len(folders(ck)) == 2 and all(
        name.startswith(("ckpt-00000004", "ckpt-00000006")) for name in folders(ck)
    )
    loaded = checkpoint.load(index)
    np.testing.assert_allclose(loaded.params, reference.params, rtol=1e-9, atol=1e-12)
    for name in reference.optimizer_state:
        np.testing.assert_allclose(
            loaded.optimizer_state[name], reference.optimizer_state[name], rtol=1e-9, atol=1e-12
        )
    assert (loaded.step, loaded.optimizer_steps) == (6, 6)
    with h5py.File(index, "r") as handle:
        assert handle.attrs["format"] == sharded.FORMAT
        parts = [handle[f"{sharded.PARAMETERS}/{name}"] for name in handle[sharded.PARAMETERS]]
        assert sum(part.size for part in parts) == reference.params.size
        first = parts[0]  # the first Dense's weights, (64, 16), in their own shape, by name: layer 1, after
        # the Flatten, as the role table numbers layers
        assert first.name.endswith("0001.Dense.W") and first.shape == (64, 16)
        np.testing.assert_allclose(first[...].reshape(-1), reference.params[: 64 * 16], rtol=1e-9, atol=1e-12)
        # two ranks write (the stages of the first replica, or the parts of the first tensor group)
        assert len(json.loads(handle.attrs[sharded.PARTS])) == 2


def test_a_sharded_checkpoint_resumes_on_another_layout_and_evaluates(tmp_path, reference):
    directory = train(tmp_path, "first", 2, LAYOUTS["pipeline"][1], "--steps", "3")
    index = checkpoint_at(directory / "ck", 3)
    resumed = train(tmp_path, "second", 2, LAYOUTS["tensor"][1], "--steps", "6", "--resume", str(index))
    ended = checkpoint.load(checkpoint_at(resumed / "ck", 6))
    np.testing.assert_allclose(ended.params, reference.params, rtol=1e-9, atol=1e-12)
    done, _ = mpidist(2, "eval", str(index), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "test" in done.stdout


def test_a_parts_folder_no_index_names_is_removed_at_the_next_start(tmp_path):
    directory = train(tmp_path, "run", 2, LAYOUTS["pipeline"][1], "--steps", "2")
    ck = directory / "ck"
    stray = ck / "ckpt-00000004-0123abcd.parts-00ff"  # as a write killed before its index leaves it
    stray.mkdir()
    (stray / sharded.part_name(0)).write_bytes(b"half a part")
    before = folders(ck)
    train(tmp_path, "run", 2, LAYOUTS["pipeline"][1], "--steps", "4", "--resume", "auto")
    assert stray.name in before and stray.name not in folders(ck)
    assert checkpoint.load(checkpoint_at(ck, 4)).step == 4
    assert events(directory / "run" / "metrics.jsonl", "checkpoint")


def test_checkpoints_written_behind_training_are_each_whole_when_logged_and_leave_no_stray_parts(tmp_path):
    # a checkpoint due every step, not waited for: each rank syncs its part in a thread, and the chief writes
    # the index at a later step boundary, once every rank said its part is on disk
    ck, metrics = tmp_path / "ck", tmp_path / "run" / "metrics.jsonl"
    flags = [arg for arg in TRAIN if arg != "--checkpoint-wait"]
    done, _ = mpidist(
        2,
        *flags,
        *LAYOUTS["pipeline"][1],
        "--run-dir",
        str(tmp_path / "run"),
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "1",
        "--keep",
        "3",
        "--steps",
        "60",
        timeout=120,
        env={"MPIDIST_TEST_DELAY": "*:0.03"},
    )
    assert done.returncode == 0, done.stderr
    logged = [event["step"] for event in events(metrics, "checkpoint")]
    # the writer rests between writes (a bounded share of the time): not every step, but during the run too
    assert len(logged) >= 3 and logged == sorted(set(logged)) and logged[-1] == 60, logged
    indexes = sorted(ck.glob("ckpt-*.h5"))
    assert [int(p.name[5:13]) for p in indexes] == logged[-3:]
    for index in indexes:
        with h5py.File(index, "r") as handle:
            assert sharded.verify(index, handle) is None
    assert folders(ck) == sorted(
        parts_debris.naming(ck).named
    )  # (the pruned checkpoints' parts went with them)
    assert not [p.name for p in ck.rglob(".*tmp-*")]


def test_keep_best_of_a_split_model_keeps_the_parts_its_index_names_and_no_others(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "run" / "metrics.jsonl"
    done, _ = mpidist(
        2,
        *TRAIN,
        *LAYOUTS["pipeline"][1],
        "--run-dir",
        str(tmp_path / "run"),
        "--checkpoint-dir",
        str(ck),
        "--epochs",
        "4",
        "--val-fraction",
        "0.2",
        "--eval-every",
        "1",
        "--keep-best",
        "val_loss",
        "--keep",
        "1",
        "--checkpoint-every",
        "5",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(events(metrics, "best")) >= 2  # (a best replaced: the parts only it named must go with it)
    best = ck / "best-run.h5" if (ck / "best-run.h5").exists() else next(ck.glob("best-*.h5"))
    with h5py.File(best, "r") as handle:
        assert sharded.verify(best, handle) is None
    assert len(list(ck.glob("*.h5"))) == 2 and folders(ck) == sorted(parts_debris.naming(ck).named)


def test_a_rank_killed_while_the_parts_are_written_ends_the_job_and_the_run_resumes_from_a_whole_checkpoint(
    tmp_path,
):
    # a checkpoint every step, each written by both stages: the kill lands in a write or between two, and
    # either way no index names a part that is not whole
    ck, metrics = tmp_path / "ck", tmp_path / "run" / "metrics.jsonl"
    flags = [
        *TRAIN,
        *LAYOUTS["pipeline"][1],
        "--run-dir",
        str(tmp_path / "run"),
        "--checkpoint-dir",
        str(ck),
        "--log-every",
        "1",
        "--checkpoint-every",
        "1",
    ]
    launcher = start_mpidist(2, *flags, "--epochs", "50", env={"MPIDIST_TEST_DELAY": "*:0.03"})
    wait_for_step(metrics, 5, launcher)
    os.kill(rank_pids(launcher)[1], signal.SIGKILL)
    killed = time.monotonic()
    launcher.communicate(timeout=30)
    assert time.monotonic() - killed < 10 and launcher.returncode != 0
    written = sorted(int(p.name[5:13]) for p in ck.glob("ckpt-*.h5"))
    assert written, "no checkpoint before the kill"
    done, _ = mpidist(2, *flags, "--steps", str(written[-1] + 2), "--resume", "auto", timeout=120)
    assert done.returncode == 0, done.stderr
    start = events(metrics, "start")[-1]
    assert start["resumed_from"] is not None and start["step"] in written
    named = parts_debris.naming(ck).named
    assert all(folder.name in named for folder in ck.iterdir() if folder.is_dir())  # (strays removed)


def test_under_a_memory_cap_a_split_model_trains_resumes_and_evaluates_where_the_whole_one_is_refused(
    tmp_path,
):
    # 19.1 M parameters with Adam: the whole model's training state is 365 MiB, a stage's or a part's about
    # half; every rank may map 420 MB of data (RLIMIT_DATA, inherited from mpiexec), of which ~130 MiB are in
    # use when the check runs (the interpreter and its libraries)
    from conftest import run_mpi

    capped = ("prlimit", "--data=420000000")
    flags = [
        "--data",
        "digits",
        "--model",
        "mlp:3072,3072,3072",
        "--batch-size",
        "32",
        "--eval-every",
        "0",
        "--progress",
        "none",
        "--metrics",
        "",
        "--run-dir",
        "",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    ]

    def run(ranks, *more):
        return run_mpi(ranks, ["-m", "mpidist", *more], timeout=120, prefix=capped)[0]

    whole = run(1, "train", *flags, "--strategy", "local", "--steps", "2")
    assert whole.returncode == 2 and not list(tmp_path.glob("ck/*.h5")), whole.stderr
    assert (
        "training 19,110,922 parameters with adam needs 364.5 MiB, more than this process's limit"
        in whole.stderr
    )
    assert "split, it fits: --strategy pipeline --stages 2 on 2 or more ranks" in whole.stderr
    done = run(2, "train", *flags, "--strategy", "pipeline", "--stages", "2", "--steps", "2")
    assert done.returncode == 0, done.stderr
    done = run(2, "train", *flags, "--tensor", "2", "--steps", "3", "--resume", "auto")
    assert done.returncode == 0, done.stderr
    done = run(2, "eval", checkpoint_at(tmp_path / "ck", 3), "--stages", "2", "--eval-samples", "64")
    assert done.returncode == 0 and "(step 3, model mlp:3072,3072,3072)" in done.stdout, done.stderr
