"""Property-based fuzzing of everything mpidist reads: dataset files, checkpoints, TOML configs, flags.

Each generated input must end with success or with one :class:`UsageError`
line (exit code 2) -- never another exception, a traceback, a hang, or a
change to the file read.  In-process tests run many examples through the
checks themselves (``MPIDIST_FUZZ_EXAMPLES``, default 60 each); end-to-end
tests run a few through ``mpiexec -n 2 python -m mpidist`` under a 10-second
limit (``MPIDIST_FUZZ_RUNS``, default 4 each), where exit 0 must come with
sane figures.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpidist import data
from mpidist.runtime.errors import UsageError
from mpidist.settings import models
from mpidist.settings.sources import add_flags, settings_from_args
from mpidist.store import checkpoint

from conftest import events, run_mpi

EXAMPLES = int(os.environ.get("MPIDIST_FUZZ_EXAMPLES", "60"))
RUNS = int(os.environ.get("MPIDIST_FUZZ_RUNS", "4"))
MANY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=RUNS, deadline=None, suppress_health_check=list(HealthCheck))

# -- what the generators draw from ---------------------------------------------------------------------------
weird_numbers = st.sampled_from(
    [0, 1, 2, 3, 10, -1, -(2**63), 2**62, 10**12, 10**7, 0.5, 2.0, math.nan, math.inf, -math.inf, 1e300, -0.0]
)
weird_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12
) | st.sampled_from(["\x1b[2J", "mpidist: done\r", "ten", "", "nan", "inf", "-1", "1e999", "0x10"])
attribute = weird_numbers | weird_text | st.sampled_from([True, np.array([1, 2]), np.array([]), b"\xff\xfe"])
dtypes = st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "S2", "float16"])
fill = st.sampled_from(["random", "zeros", "nan", "inf", "huge", "negative", "labels"])


def array(shape, dtype, how, rng):
    if dtype == "S2":
        return np.full(shape, b"ab")
    if how == "nan" and np.dtype(dtype).kind == "f":
        values = np.full(shape, np.nan)
    elif how == "inf" and np.dtype(dtype).kind == "f":
        values = np.full(shape, np.inf)
    elif how == "huge":
        values = np.full(shape, 1e300)
    elif how == "negative":
        values = -rng.random(shape) * 100
    elif how == "labels":
        values = rng.integers(0, 12, shape)
    elif how == "zeros":
        values = np.zeros(shape)
    else:
        values = rng.random(shape)
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype)


@st.composite
def dataset_files(draw):
    """A small dataset file, right or wrong in any of the ways a file can be."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    attrs = {"name": draw(attribute), "source": draw(attribute)}
    if draw(st.booleans()):
        attrs["num_classes"] = draw(attribute)
    else:
        attrs["num_classes"] = draw(st.sampled_from([0, 2, 3, 10]))
    width = draw(st.sampled_from([(4,), (0,), (2, 2), (), (3, 1, 2)]))
    splits = {}
    for split in ("train", "test"):
        rows = draw(st.sampled_from([0, 1, 3, 40, 130]))
        x = array((rows,) + width, draw(dtypes), draw(fill), rng)
        y_shape = draw(st.sampled_from([(rows,), (rows, 1), (rows, 2), (rows + 1,), ()]))
        y = array(
            y_shape,
            draw(dtypes),
            draw(st.sampled_from(["labels", "labels", "random", "nan", "negative"])),
            rng,
        )
        splits[split] = (x, y)
    damage = draw(
        st.sampled_from(["none", "none", "none", "missing", "group", "softloop", "external", "truncate"])
    )
    return attrs, splits, damage


def write_dataset_file(path, attrs, splits, damage):
    with h5py.File(path, "w") as handle:
        for key, value in attrs.items():
            handle.attrs[key] = value
        for split, (x, y) in splits.items():
            handle[f"{split}/x"], handle[f"{split}/y"] = x, y
        if damage == "missing":
            del handle["test/y"]
        elif damage == "group":
            del handle["train/x"]
            handle.create_group("train/x")
        elif damage == "softloop":
            del handle["train/x"], handle["train/y"]
            handle["train/x"], handle["train/y"] = h5py.SoftLink("/train/y"), h5py.SoftLink("/train/x")
        elif damage == "external":
            del handle["train/x"]
            handle["train/x"] = h5py.ExternalLink("/etc/hostname", "/x")
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:2000])
    return path


@st.composite
def checkpoint_files(draw):
    """Changes to a good checkpoint of the default model: ``[(kind, name, value)]``."""
    changes = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["attr", "attr", "params", "optimizer", "config", "drop"]))
        if kind == "attr":
            changes.append(
                (
                    kind,
                    draw(
                        st.sampled_from(["step", "epoch", "epoch_step", "format", "lineage", "rng", "parent"])
                    ),
                    draw(attribute),
                )
            )
        elif kind in ("params", "optimizer"):
            changes.append((kind, draw(st.sampled_from(["nan", "short", "2d", "int", "long", "text"])), None))
        elif kind == "config":
            changes.append(
                (
                    kind,
                    draw(
                        st.sampled_from(["lr", "model", "data", "epochs", "strategy", "dtype", "optimizer"])
                    ),
                    draw(attribute),
                )
            )
        else:
            changes.append((kind, draw(st.sampled_from(["params", "optimizer", "optimizer/m"])), None))
    return changes


def damaged(good, changes, path):
    path.write_bytes(good.read_bytes())
    with h5py.File(path, "a") as handle:
        for kind, name, value in changes:
            if kind == "attr":
                handle.attrs[name] = value
            elif kind in ("params", "optimizer"):
                key = "params" if kind == "params" else "optimizer/m"
                if key not in handle:
                    continue
                flat = handle[key][...]
                new = {
                    "nan": np.full(flat.shape, np.nan),
                    "short": flat[:7],
                    "2d": flat.reshape(1, -1),
                    "int": np.arange(flat.size),
                    "long": np.concatenate([flat, flat]),
                    "text": np.full(3, b"xy"),
                }[name]
                del handle[key]
                handle[key] = new
            elif kind == "config":
                config = json.loads(handle.attrs["config"]) if isinstance(handle.attrs["config"], str) else {}
                config[name] = (
                    value.tolist()
                    if isinstance(value, np.ndarray)
                    else value.decode("latin-1")
                    if isinstance(value, bytes)
                    else value
                )
                handle.attrs["config"] = json.dumps(config)
            elif name in handle:
                del handle[name]
    return path


tomls = st.dictionaries(
    st.sampled_from(
        [
            "lr",
            "epochs",
            "batch-size",
            "model",
            "strategy",
            "momentum",
            "seed",
            "stall-timeout",
            "checkpoint-seconds",
            "bucket-mb",
            "keep",
            "dtype",
            "steps",
            "ps",
            "unknown-key",
        ]
    ),
    st.sampled_from(
        [
            "1",
            "0",
            "-1",
            "nan",
            "inf",
            "-inf",
            "1e309",
            "3.5",
            '"ten"',
            "true",
            "[1, 2]",
            '"mlp"',
            '"allreduce"',
            "9223372036854775807",
            '"\\u001b[2J"',
        ]
    ),
    max_size=5,
)
flag_values = st.sampled_from(
    ["1", "0", "-1", "nan", "inf", "1e999", "3.5", "ten", "", "-0", "1e-320", "99999999999999999999"]
)
numeric_flags = st.sampled_from(
    [
        "--lr",
        "--epochs",
        "--batch-size",
        "--momentum",
        "--seed",
        "--stall-timeout",
        "--checkpoint-seconds",
        "--bucket-mb",
        "--keep",
        "--steps",
        "--log-every",
        "--nan-patience",
        "--eval-every",
        "--checkpoint-every",
    ]
)


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).is_file() else None


@contextlib.contextmanager
def left_unchanged(path):
    """Whatever the body does with the file at ``path``, its bytes are the same afterwards."""
    before = digest(path)
    yield
    assert digest(path) == before


def one_line(err):
    assert "\n" not in str(err) and str(err), repr(str(err))


# -- in-process: many examples through the checks -----------------------------------------------------------
@MANY
@given(dataset_files())
def test_any_dataset_file_is_read_or_refused_in_one_line(case):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_dataset_file(Path(tmp) / "d.h5", *case)
        with left_unchanged(path):
            try:
                info = data.inspect(path)
                model = models.resolve("mlp").build(info.sample_shape, info.outputs, np, "float32")
                for split in data.SPLITS:
                    shard = data.Shard(info, split, 0, 1, model.input_shape, model.dtype)
                    assert np.isfinite(shard.x).all() and len(shard) == info.sizes[split]
                assert info.num_classes == 0 or info.num_classes >= 2
            except UsageError as err:
                one_line(err)
                assert str(path) in str(err) or "d.h5" in str(err) or "parameters" in str(err), str(err)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("good")
    done, _ = run_mpi(
        1,
        [
            "-m",
            "mpidist",
            "--metrics",
            "",
            "--progress",
            "none",
            "--steps",
            "2",
            "--checkpoint-dir",
            str(directory),
        ],
    )
    assert done.returncode == 0, done.stderr
    return next(directory.glob("ckpt-*.h5"))


@MANY
@given(checkpoint_files())
def test_any_checkpoint_is_loaded_or_refused_in_one_line(good_checkpoint, changes):
    with tempfile.TemporaryDirectory() as tmp:
        path = damaged(good_checkpoint, changes, Path(tmp) / "ckpt-00000002.h5")
        with left_unchanged(path):
            try:
                loaded = checkpoint.load(path)
                assert loaded.params.ndim == 1 and np.isfinite(loaded.params).all() and loaded.step >= 0
                assert all(a.shape == loaded.params.shape for a in loaded.optimizer_state.values())
            except UsageError as err:
                one_line(err)
                assert str(path) in str(err)


def parse(argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser)
    return settings_from_args(parser.parse_args(argv))


@MANY
@given(tomls)
def test_any_toml_config_is_taken_or_refused_in_one_line(table):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text("".join(f"{key} = {value}\n" for key, value in table.items()))
        with left_unchanged(path):
            try:
                config = parse(["--config", str(path)])
                config.validate(2)
                assert all(
                    math.isfinite(getattr(config, f))
                    for f in ("lr", "momentum", "stall_timeout", "bucket_mb")
                )
            except UsageError as err:
                one_line(err)


@MANY
@given(st.lists(st.tuples(numeric_flags, flag_values), max_size=4))
def test_any_flag_values_are_taken_or_refused_in_one_line(pairs):
    argv = [item for pair in pairs for item in pair]
    try:
        config = parse(argv)
        config.validate(2)
        assert math.isfinite(config.lr) and config.lr > 0 and config.batch_size >= 1
    except argparse.ArgumentError:
        pass  # (the command line's argparse prints its usage and exits 2 for these)
    except UsageError as err:
        one_line(err)


# -- end to end: a few examples through real ranks ---------------------------------------------------------
def launch(tmp, *flags):
    """``mpiexec -n 2 python -m mpidist train --steps 3 FLAGS`` under the 10-second limit; (code, stdout,
    stderr)."""
    done, seconds = run_mpi(
        2,
        [
            "-m",
            "mpidist",
            "--progress",
            "none",
            "--metrics",
            str(Path(tmp) / "m.jsonl"),
            "--steps",
            "3",
            "--stall-timeout",
            "5",
            *flags,
        ],
        timeout=30,
    )
    assert seconds < 10, f"took {seconds:.1f} s"
    return done.returncode, done.stdout, done.stderr


def ended_cleanly(code, out, err, tmp):
    assert code in (0, 2), (code, out, err)
    assert "Traceback" not in err, err
    if code == 2:
        assert err.count("mpidist: error") == 1, err
    else:
        (done,) = events(Path(tmp) / "m.jsonl", "done")
        assert done["steps"] == 3 and math.isfinite(done["loss"]) and 0 <= done["test_accuracy"] <= 1


def refused_in_one_line(code, out, err):
    """Exit 0, or exit 2 with one error line (or argparse's usage): never a traceback."""
    assert code in (0, 2) and "Traceback" not in err, err
    if code == 2:
        assert err.count("mpidist: error") == 1 or "usage:" in err, err


@FEW
@given(dataset_files())
def test_any_dataset_file_ends_every_rank_cleanly(case):
    with tempfile.TemporaryDirectory() as tmp:
        path = write_dataset_file(Path(tmp) / "d.h5", *case)
        with left_unchanged(path):
            ended_cleanly(*launch(tmp, "--data", str(path), "--batch-size", "4"), tmp)


@FEW
@given(checkpoint_files())
def test_any_checkpoint_resumed_ends_every_rank_cleanly(good_checkpoint, changes):
    with tempfile.TemporaryDirectory() as tmp:
        path = damaged(good_checkpoint, changes, Path(tmp) / "ckpt-00000002.h5")
        with left_unchanged(path):
            code, out, err = launch(tmp, "--resume", str(path))
            assert code in (0, 2), err
            if code == 0:  # resumed at step 2 (or whatever valid step it holds): ran on to step 3 at most
                assert "Traceback" not in err
            else:
                ended_cleanly(code, out, err, tmp)


@FEW
@given(tomls)
def test_any_config_file_ends_every_rank_cleanly(table):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text("".join(f"{key} = {value}\n" for key, value in table.items() if key != "steps"))
        with left_unchanged(path):
            refused_in_one_line(*launch(tmp, "--config", str(path)))


@FEW
@given(st.lists(st.tuples(numeric_flags.filter(lambda f: f != "--steps"), flag_values), max_size=3))
def test_any_flag_values_end_every_rank_cleanly(pairs):
    with tempfile.TemporaryDirectory() as tmp:
        refused_in_one_line(*launch(tmp, *[item for pair in pairs for item in pair]))
