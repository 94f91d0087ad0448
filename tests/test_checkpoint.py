"""Checkpoint files: atomic writes, listing, pruning, and falling back past a corrupt one."""

import json

import h5py
import numpy as np
import pytest

from mpidist import checkpoint
from mpidist.errors import UsageError


def write(directory, step):
    return checkpoint.save(directory, np.full(5, float(step)), {"m": np.zeros(5)}, step, step, 0, step,
                           '{"seed": 1}', seed=11, workers=3)


def test_a_checkpoint_round_trips_and_leaves_nothing_aside(tmp_path):
    path = write(tmp_path, 7)
    loaded = checkpoint.load(path)
    assert path.name == "ckpt-00000007.h5" and loaded.step == 7 and loaded.optimizer_steps == 7
    np.testing.assert_array_equal(loaded.params, np.full(5, 7.0))
    assert loaded.seed == 11 and loaded.config == {"seed": 1}   # the seed that drew the streams wins
    with h5py.File(path) as handle:
        order, rng = json.loads(handle.attrs["data_order"]), json.loads(handle.attrs["rng"])
    assert (order["seed"], order["epoch_step"], order["workers"], rng["step"]) == (11, 7, 3, 7)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000007.h5"]


def test_newest_and_prune_keep_the_latest_by_step(tmp_path):
    for step in (5, 100, 20):
        write(tmp_path, step)
    (tmp_path / "notes.h5").write_text("not ours")                  # other files are left alone
    assert checkpoint.newest(tmp_path).name == "ckpt-00000100.h5"
    removed = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["ckpt-00000005.h5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000020.h5", "ckpt-00000100.h5", "notes.h5"]
    assert checkpoint.prune(tmp_path, keep=0) == []                  # 0 keeps everything


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_one_before(tmp_path):
    write(tmp_path, 10)
    newest = write(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[:200])                     # truncated by a failing disk
    loaded, skipped = checkpoint.newest_valid(tmp_path)
    assert loaded.step == 10
    assert [path.name for path, _ in skipped] == ["ckpt-00000020.h5"] and "not a readable" in skipped[0][1]
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        checkpoint.load(newest)


def test_an_empty_directory_has_nothing_to_resume(tmp_path):
    assert checkpoint.newest_valid(tmp_path / "missing") == (None, [])
