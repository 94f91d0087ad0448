"""Ingest: .npz, .csv and the named sources the bundled datasets come from."""

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.errors import UsageError
from mpidist.ingest import build_source, ingest


def test_npz_with_x_and_y_is_split_and_labelled(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "toy.npz", x=rng.random((50, 6)), y=np.arange(50) % 3)
    info = data.inspect(ingest(str(tmp_path / "toy.npz"), tmp_path / "toy.h5", test_fraction=0.2))
    assert info.sizes == {"train": 40, "test": 10} and info.num_classes == 3 and info.name == "toy"


def test_npz_with_its_own_split_keeps_it(tmp_path):
    np.savez(tmp_path / "s.npz", x_train=np.zeros((7, 2)), y_train=np.arange(7) % 2,
             x_test=np.ones((3, 2)), y_test=np.array([0, 1, 1]))
    path = ingest(str(tmp_path / "s.npz"), tmp_path / "s.h5")
    with h5py.File(path) as handle:
        np.testing.assert_array_equal(handle["test/x"][...], np.ones((3, 2)))


def test_npz_holding_objects_is_refused_without_unpickling(tmp_path):
    np.savez(tmp_path / "evil.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    with pytest.raises(UsageError, match="plain arrays"):
        ingest(str(tmp_path / "evil.npz"), tmp_path / "evil.h5")


def test_csv_with_a_header_and_float_targets_is_regression(tmp_path):
    rows = "\n".join(f"{i},{2 * i},{0.5 * i}" for i in range(20))
    (tmp_path / "r.csv").write_text("a,b,target\n" + rows + "\n")
    path = ingest(str(tmp_path / "r.csv"), tmp_path / "r.h5", test_fraction=0.25)
    info = data.inspect(path)
    assert info.num_classes == 0 and info.sample_shape == (2,) and info.sizes == {"train": 15, "test": 5}
    with h5py.File(path) as handle:
        x, y = handle["train/x"][...], handle["train/y"][...]
    np.testing.assert_allclose(y, 0.5 * x[:, 0])


def test_csv_label_column_can_be_chosen(tmp_path):
    (tmp_path / "c.csv").write_text("\n".join(f"{i % 2},{i}.5,{i}.25" for i in range(10)) + "\n")
    info = data.inspect(ingest(str(tmp_path / "c.csv"), tmp_path / "c.h5", label_column=0))
    assert info.num_classes == 2 and info.sample_shape == (2,)


@pytest.mark.parametrize("source,message", [("nothing-here", "neither a file nor a known source"),
                                            ("table.txt", "unsupported file type")])
def test_bad_sources_are_named(tmp_path, source, message):
    (tmp_path / "table.txt").write_text("1,2\n")
    with pytest.raises(UsageError, match=message):
        ingest(str(tmp_path / source) if source.endswith(".txt") else source, tmp_path / "out.h5")


def test_a_failed_ingest_leaves_no_file_behind(tmp_path):
    (tmp_path / "bad.csv").write_text("1,2\n3,x\n")
    with pytest.raises(UsageError):
        ingest(str(tmp_path / "bad.csv"), tmp_path / "out.h5")
    assert list(tmp_path.iterdir()) == [tmp_path / "bad.csv"]


@pytest.mark.parametrize("name,exact", [("digits", True), ("mnist1d", False), ("mnist-5k", True)])
def test_bundled_files_are_rebuilt_from_their_sources(name, exact):
    splits, num_classes, source = build_source(name)
    with h5py.File(data.resolve(name)) as handle:
        assert int(handle.attrs["num_classes"]) == num_classes and handle.attrs["source"] == source
        for split, (x, y) in splits.items():
            np.testing.assert_array_equal(handle[f"{split}/y"][...], y)
            if exact:
                np.testing.assert_array_equal(handle[f"{split}/x"][...], x)
            else:   # generated with scipy interpolation: allow last-bit differences across versions
                np.testing.assert_allclose(handle[f"{split}/x"][...], x, rtol=1e-5, atol=1e-6)


def test_a_missing_source_package_is_named_with_the_install_command(monkeypatch, tmp_path):
    for module in ("mnist1d", "mnist1d.data"):                            # importing them now fails,
        monkeypatch.setitem(__import__("sys").modules, module, None)      # even if a test loaded them
    with pytest.raises(UsageError, match="needs the package 'mnist1d': pip install 'mnist1d'"):
        ingest("mnist1d", tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()
