"""Checkpoint files: atomic writes, everything in them checked when loaded, falling back past a corrupt one."""

import json

import h5py
import numpy as np
import pytest

from mpidist.runtime.errors import UsageError
from mpidist.store import checkpoint


def write(directory, step):
    return checkpoint.save(directory, np.full(5, float(step)), {"m": np.zeros(5)}, step, step, 0, step,
                           '{"seed": 1}', seed=11, workers=3)


def test_a_checkpoint_round_trips_and_leaves_nothing_aside(tmp_path):
    path = write(tmp_path, 7)
    loaded = checkpoint.load(path)
    assert path.name == "ckpt-00000007.h5" and loaded.step == 7 and loaded.optimizer_steps == 7   # no lineage
    np.testing.assert_array_equal(loaded.params, np.full(5, 7.0))
    assert loaded.seed == 11 and loaded.config == {"seed": 1}   # the seed that drew the streams wins
    with h5py.File(path) as handle:
        order, rng = json.loads(handle.attrs["data_order"]), json.loads(handle.attrs["rng"])
    assert (order["seed"], order["epoch_step"], order["workers"], rng["step"]) == (11, 7, 3, 7)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000007.h5"]


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


def set_attr(name, value, group="/"):
    def change(handle):
        handle[group].attrs[name] = value
    return change


@pytest.mark.parametrize("change,message", [
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
])
def test_everything_read_from_a_checkpoint_is_checked_before_use(tmp_path, change, message):
    path = tampered(tmp_path, change)
    with pytest.raises(UsageError) as caught:
        checkpoint.load(path)
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_a_link_out_of_the_file_is_refused(tmp_path):
    elsewhere = tmp_path / "other.h5"
    with h5py.File(elsewhere, "w") as handle:
        handle["secret"] = np.ones(5)
    path = tampered(tmp_path, lambda handle: (handle.__delitem__("params"),
                                              handle.__setitem__("params", h5py.ExternalLink(str(elsewhere),
                                                                                              "secret"))))
    with pytest.raises(UsageError, match="params is a link to elsewhere"):
        checkpoint.load(path)


def test_a_checkpoint_larger_than_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from mpidist.runtime import memory
    monkeypatch.setattr(memory, "available_bytes", lambda: 50)
    monkeypatch.setattr(memory, "ranks_per_node", lambda: 1)
    with pytest.raises(UsageError, match="needs 80 B, more than this rank's share"):
        checkpoint.load(write(tmp_path, 3))
