"""How a run records its dataset (an absolute path, a fingerprint of its content), and the names it builds
files of."""

import os

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.data import fingerprint as fingerprints
from mpidist.runtime.errors import UsageError
from mpidist.runtime.text import check_utf8, file_label
from mpidist.tools.dataset_file import write_dataset


def dataset(path, seed=0, rows=200, name="d"):
    x = np.random.default_rng(seed).random((rows, 4)).astype(np.float32)
    return write_dataset(
        path, name, {"train": (x, np.arange(rows) % 3), "test": (x[:20], np.arange(20) % 3)}, 3, ""
    )


def test_a_path_is_recorded_absolute_and_resolved_and_a_bundled_name_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dataset(tmp_path / "d.h5")
    os.symlink(tmp_path / "d.h5", tmp_path / "current.h5")
    assert fingerprints.recorded("d.h5") == str(tmp_path / "d.h5")
    assert fingerprints.recorded("current.h5") == str(tmp_path / "d.h5")  # the file it stood for
    assert fingerprints.recorded("digits") == "digits"
    assert fingerprints.recorded("missing.h5") == str(tmp_path / "missing.h5")
    assert fingerprints.recorded("shards/*.h5") == str(tmp_path / "shards" / "*.h5")
    assert (
        fingerprints.recorded(
            data.ArrayData((np.zeros((4, 2)), np.zeros(4, int)), (np.zeros((2, 2)), np.zeros(2, int)))
        )
        == "<arrays: arrays>"
    )


def test_the_fingerprint_knows_a_dataset_by_content_not_by_name(tmp_path):
    first = data.inspect(dataset(tmp_path / "a.h5"))
    same = data.inspect(dataset(tmp_path / "b.h5"))
    other = data.inspect(dataset(tmp_path / "c.h5", seed=1))
    assert fingerprints.fingerprint(first) == fingerprints.fingerprint(same)
    assert fingerprints.fingerprint(first) != fingerprints.fingerprint(other)
    assert fingerprints.fingerprint(first).startswith(fingerprints.SCHEME + ":")
    with h5py.File(tmp_path / "b.h5", "a") as handle:  # one label changed, at the end of the test split
        handle["test/y"][-1] = 1 - handle["test/y"][-1]
    assert fingerprints.fingerprint(data.inspect(tmp_path / "b.h5")) != fingerprints.fingerprint(first)


def test_the_fingerprint_reads_a_bounded_sample_of_a_large_dataset(tmp_path, monkeypatch):
    """A sample of 1,000,000 values per row: the reads stay within SAMPLE_BYTES per place, whatever the
    rows."""
    path = tmp_path / "wide.h5"
    with h5py.File(path, "w") as handle:
        handle.attrs.update(name="wide", num_classes=3, source="")
        for split, rows in (("train", 50), ("test", 5)):
            handle.create_dataset(
                f"{split}/x", shape=(rows, 1000, 1000), dtype=np.float32, chunks=(1, 100, 100)
            )
            handle[f"{split}/y"] = np.arange(rows) % 3
    read = []
    real = h5py.Dataset.__getitem__

    def counting(self, key):
        out = real(self, key)
        read.append(np.asarray(out).nbytes)
        return out

    monkeypatch.setattr(h5py.Dataset, "__getitem__", counting)
    assert fingerprints.fingerprint(data.inspect(path))
    assert read and max(read) <= fingerprints.SAMPLE_BYTES


def test_a_mismatch_is_told_only_for_the_dataset_recorded_and_only_when_its_content_changed(tmp_path):
    path = dataset(tmp_path / "d.h5")
    recorded_print = fingerprints.fingerprint(data.inspect(path))
    assert fingerprints.mismatch(recorded_print, str(path), data.inspect(path)) is None
    dataset(path, seed=1)  # written again under the same name
    changed = fingerprints.mismatch(recorded_print, str(path), data.inspect(path))
    assert changed.startswith(f"dataset {path} is not the dataset it was trained on")
    other = dataset(tmp_path / "other.h5", seed=2)  # another dataset, named by the user: nothing to compare
    assert fingerprints.mismatch(recorded_print, str(path), data.inspect(other)) is None
    # a checkpoint from before fingerprints
    assert fingerprints.mismatch("", str(path), data.inspect(path)) is None


def test_names_and_paths_that_are_not_utf8_are_refused_with_their_bytes_shown(tmp_path, monkeypatch):
    with pytest.raises(UsageError) as refused:
        check_utf8("run\udcff", "--run-dir")
    assert str(refused.value).startswith("--run-dir run\\xff: not UTF-8 text")
    check_utf8("données/é", "--run-dir", absolute=True)
    check_utf8(None, "--name")
    odd = tmp_path / "cwd\udcff"
    odd.mkdir()
    monkeypatch.chdir(odd)
    check_utf8("runs", "--run-dir")  # the text alone is UTF-8 ...
    with pytest.raises(UsageError, match="the working directory's name is not UTF-8"):
        check_utf8("runs", "--run-dir", absolute=True)  # ... the path it stands for is not


@pytest.mark.parametrize(
    "name, label",
    [
        ("../../etc/passwd", "etc-passwd"),
        ("..", "dataset"),
        ("a/b", "a-b"),
        ("données v2", "données-v2"),
        ("\x1b[2J", "2J"),
        ("-rf", "rf"),
        ("x" * 300, "x" * 60),
    ],
)
def test_a_label_becomes_a_safe_part_of_a_file_name(name, label):
    assert file_label(name) == label
    assert "/" not in file_label(name) and not file_label(name).startswith(".")
