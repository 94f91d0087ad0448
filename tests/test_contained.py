"""Datasets and predict's samples read nothing from another file than their own unless --allow-external: an
external link, a soft link through one, a virtual dataset, external storage (issue 61, item 5); with it, a
link's rows are read from the file it names, and the run ends done.

Checkpoints' files are tested with them: tests/test_checkpoint.py (one file), tests/test_sharded.py (an index
and its parts)."""

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.runtime.errors import UsageError
from mpidist.tools.ingest import write_dataset
from mpidist.tools.prediction_inputs import HDF5Samples
from crafted import MARKER, external_storage


def dataset(path):
    rng = np.random.default_rng(0)
    splits = {
        "train": (rng.random((40, 4)), np.arange(40) % 3),
        "test": (rng.random((10, 4)), np.arange(10) % 3),
    }
    return write_dataset(path, "toy", splits, 3, "made by a test", stats=(np.zeros(4), np.ones(4)))


def outside(tmp_path):
    """A raw file and an HDF5 file (its ``x``, of train/x's shape) of markers, beside the dataset."""
    np.full(160, MARKER).tofile(tmp_path / "values.bin")
    with h5py.File(tmp_path / "other.h5", "w") as handle:
        handle["x"] = np.full((40, 4), MARKER)
    return tmp_path / "values.bin", tmp_path / "other.h5"


def soft_link_through_an_external_link(name):
    def change(handle, raw, other):
        del handle[name]
        handle["door"] = h5py.ExternalLink(str(other), "/")
        handle[name] = h5py.SoftLink("/door/x")

    return change


@pytest.mark.parametrize(
    "change, words",
    [
        (external_storage("train/x"), "'train/x' keeps its values in '"),
        (external_storage("stats/mean"), "'stats/mean' keeps its values in '"),
        (soft_link_through_an_external_link("train/x"), "'train/x' leads through its links to '"),
    ],
    ids=["samples in external storage", "statistics in external storage", "a soft link through a link"],
)
def test_a_dataset_item_kept_in_another_file_is_refused_unless_allowed(tmp_path, change, words):
    path = dataset(tmp_path / "toy.h5")
    raw, other = outside(tmp_path)
    with h5py.File(path, "a") as handle:
        change(handle, raw, other)
    with pytest.raises(UsageError) as refused:
        data.inspect(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and words in message, message
    assert "refused, as it reads another file (--allow-external " in message, message
    data.inspect(path, allow_external=True)  # (the user's to allow: HDF5 reads them then)


@pytest.mark.parametrize(
    "change, words",
    [
        (external_storage("x"), "'x' keeps its values in '"),
        (soft_link_through_an_external_link("x"), "'x' leads through its links to '"),
    ],
    ids=["external storage", "a soft link through a link"],
)
def test_samples_to_predict_kept_in_another_file_are_refused(tmp_path, change, words):
    path = tmp_path / "plain.h5"
    raw, other = outside(tmp_path)
    with h5py.File(path, "w") as handle:
        handle["x"] = np.zeros((40, 4))
        change(handle, raw, other)
    with pytest.raises(UsageError) as refused:
        HDF5Samples(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and words in message, message
    assert message.endswith("refused, as it reads another file"), message


def linked_to_another_file(tmp_path):
    """A dataset whose train/x is an external link to another file's x (values unlike its own), stored
    uncompressed (what a stream reads from the file itself)."""
    rng = np.random.default_rng(1)
    other = write_dataset(
        tmp_path / "other.h5",
        "other",
        {"train": (rng.random((40, 4)), np.arange(40) % 3), "test": (rng.random((10, 4)), np.arange(10) % 3)},
        3,
        "",
        compression="none",
    )
    path = write_dataset(
        tmp_path / "linked.h5",
        "linked",
        {"train": (np.full((40, 4), 7.0), np.arange(40) % 3), "test": (np.zeros((10, 4)), np.arange(10) % 3)},
        3,
        "",
        compression="none",
    )
    with h5py.File(path, "a") as handle:
        del handle["train/x"]
        handle["train/x"] = h5py.ExternalLink(str(other), "/train/x")
    with h5py.File(other, "r") as handle:
        return path, handle["train/x"][...]


def test_rows_a_link_leads_to_are_read_from_the_file_it_names_when_allowed(tmp_path):
    from mpidist.data import stream as streaming

    path, expected = linked_to_another_file(tmp_path)
    info = data.inspect(path, allow_external=True)
    source = data.SplitRows(info, "train", (4,), np.float64)
    handles = {}  # (a stream's open files: its reads go around h5py where the rows are the file's own)
    try:
        x, _ = source.read(np.arange(0, 40), handles)
    finally:
        streaming._close(handles)
    np.testing.assert_array_equal(x, expected)  # (not the bytes at those offsets of linked.h5)


def test_a_run_allowed_to_follow_a_link_ends_done(tmp_path):
    from conftest import mpidist

    path, _ = linked_to_another_file(tmp_path)
    done, _ = mpidist(
        1,
        "--data",
        str(path),
        "--allow-external",
        "--batch-size",
        "8",
        "--steps",
        "2",
        "--metrics",
        "",
        "--run-dir",
        "",
    )
    assert done.returncode == 0 and "mpidist: error" not in done.stderr, done.stderr
