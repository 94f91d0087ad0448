"""Ingest: .npz, .csv and the named sources the bundled datasets come from."""

import os

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.runtime.errors import UsageError
from mpidist.tools.ingest import build_source, ingest, write_dataset


def accepted(path):
    """What ``train`` does with a file: inspect it and read both splits; returns the description."""
    info = data.inspect(path)
    for split in data.SPLITS:
        data.Shard(info, split, 0, 1, info.sample_shape, np.float32)
    return info


def test_npz_with_x_and_y_is_split_and_labelled(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "toy.npz", x=rng.random((50, 6)), y=np.arange(50) % 3)
    info = accepted(ingest(str(tmp_path / "toy.npz"), tmp_path / "toy.h5", test_fraction=0.2))
    assert info.sizes == {"train": 40, "test": 10} and info.num_classes == 3 and info.name == "toy"


def test_npz_with_its_own_split_keeps_it(tmp_path):
    np.savez(
        tmp_path / "s.npz",
        x_train=np.zeros((7, 2)),
        y_train=np.arange(7) % 2,
        x_test=np.ones((3, 2)),
        y_test=np.array([0, 1, 1]),
    )
    path = ingest(str(tmp_path / "s.npz"), tmp_path / "s.h5")
    assert accepted(path).sizes == {"train": 7, "test": 3}
    with h5py.File(path) as handle:
        np.testing.assert_array_equal(handle["test/x"][...], np.ones((3, 2)))


@pytest.mark.parametrize(
    "extra, left_out",
    [
        ({"x_test": np.ones((3, 2)), "y_test": np.array([0, 1, 1])}, "x_test, y_test"),  # (beside x, y)
        ({"x_val": np.ones((3, 2))}, "x_val"),
    ],
)
def test_npz_arrays_that_ingest_would_leave_out_are_refused_not_dropped(tmp_path, extra, left_out):
    np.savez(tmp_path / "s.npz", x=np.zeros((10, 2)), y=np.arange(10) % 2, meta=np.zeros(1), **extra)
    with pytest.raises(UsageError, match=f"ingest reads x, y and would leave out {left_out}"):
        ingest(str(tmp_path / "s.npz"), tmp_path / "s.h5")
    assert not (tmp_path / "s.h5").exists()
    np.savez(tmp_path / "own.npz", x_train=np.zeros((7, 2)), y_train=np.arange(7) % 2, y_val=np.zeros(2),
             x_test=np.ones((3, 2)), y_test=np.array([0, 1, 1]))  # fmt: skip
    with pytest.raises(UsageError, match="reads x_train, y_train, x_test, y_test and would leave out y_val"):
        ingest(str(tmp_path / "own.npz"), tmp_path / "own.h5")


def test_npz_holding_objects_is_refused_without_unpickling(tmp_path):
    np.savez(tmp_path / "evil.npz", x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    with pytest.raises(UsageError, match="plain arrays"):
        ingest(str(tmp_path / "evil.npz"), tmp_path / "evil.h5")


def test_csv_with_a_header_and_float_targets_is_regression(tmp_path):
    rows = "\n".join(f"{i},{2 * i},{0.5 * i}" for i in range(20))
    (tmp_path / "r.csv").write_text("a,b,target\n" + rows + "\n")
    path = ingest(str(tmp_path / "r.csv"), tmp_path / "r.h5", test_fraction=0.25)
    info = accepted(path)
    assert info.num_classes == 0 and info.sample_shape == (2,) and info.sizes == {"train": 15, "test": 5}
    with h5py.File(path) as handle:
        x, y = handle["train/x"][...], handle["train/y"][...]
    np.testing.assert_allclose(y, 0.5 * x[:, 0])


def test_csv_label_column_can_be_chosen(tmp_path):
    (tmp_path / "c.csv").write_text("\n".join(f"{i % 2},{i}.5,{i}.25" for i in range(10)) + "\n")
    info = accepted(ingest(str(tmp_path / "c.csv"), tmp_path / "c.h5", label_column=0))
    assert info.num_classes == 2 and info.sample_shape == (2,)


@pytest.mark.parametrize(
    "source,message",
    [("nothing-here", "neither a file nor a known source"), ("table.txt", "unsupported file type")],
)
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
    splits, num_classes, source, _ = build_source(name)
    with h5py.File(data.resolve(name)) as handle:
        assert int(handle.attrs["num_classes"]) == num_classes and handle.attrs["source"] == source
        for split, (x, y) in splits.items():
            np.testing.assert_array_equal(handle[f"{split}/y"][...], y)
            if exact:
                np.testing.assert_array_equal(handle[f"{split}/x"][...], x)
            else:  # generated with scipy interpolation: allow last-bit differences across versions
                np.testing.assert_allclose(handle[f"{split}/x"][...], x, rtol=1e-5, atol=1e-6)


def test_a_missing_source_package_is_named_with_the_install_command(monkeypatch, tmp_path):
    for module in ("mnist1d", "mnist1d.data"):  # importing them now fails,
        monkeypatch.setitem(__import__("sys").modules, module, None)  # even if a test loaded them
    with pytest.raises(UsageError, match="needs the package 'mnist1d': pip install 'mnist1d'"):
        ingest("mnist1d", tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()


# -- a hostile sweep: every bad input is one UsageError naming the file, the item and the value --------------
def refused(tmp_path, source, message, **options):
    """Ingest ``source`` into ``out.h5``: it must fail with ``message``, on one line, leaving no output."""
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(UsageError, match=message) as caught:
        ingest(str(source), tmp_path / "out.h5", **options)
    assert "\n" not in str(caught.value)
    assert sorted(tmp_path.rglob("*")) == before
    return str(caught.value)


@pytest.mark.parametrize(
    "rows,message",
    [
        ("a,b,label\n1,2,0\n3,,1\n5,6,0\n", r"n.csv: row 3, column 'b' \(column 2\) is empty \(NaN\)"),
        (
            "a,b,label\n1,2,0\n3,4,1\n5,nan,0\n",
            r"n.csv: row 4, column 2 is NaN \('nan'\); ingest needs finite",
        ),
        ("1,2,0\n3,4,nan\n5,6,1\n", r"n.csv: row 2, column 3 is NaN"),  # the label column
        ("1,2,0\n\n3,-inf,1\n5,6,1\n", r"n.csv: row 3, column 2 is Inf \('-inf'\)"),  # blank lines count
        ("1,2,0\n3,4,1e999\n5,6,1\n", r"n.csv: row 2, column 3 is Inf \('1e999'\)"),
    ],
)
def test_csv_nan_and_inf_are_refused_with_their_row_and_column(tmp_path, rows, message):
    (tmp_path / "n.csv").write_text(rows)
    refused(tmp_path, tmp_path / "n.csv", message)


@pytest.mark.parametrize(
    "text,message",
    [
        ("1,2\n", "1 row of data; a train and a test split need at least 2"),
        (
            "a,b\n1,2\n",
            r"1 row of data after the header \(line 1\); a train and a test split need at least 2",
        ),
        ("a,b\n", r"0 rows of data after the header \(line 1\)"),
        ("", "the file is empty"),
        ("\n\n", "0 rows of data"),
    ],
)
def test_csv_too_small_for_two_splits_is_refused(tmp_path, text, message):
    (tmp_path / "t.csv").write_text(text)
    refused(tmp_path, tmp_path / "t.csv", "t.csv: " + message)


@pytest.mark.parametrize(
    "arrays,message",
    [
        (
            dict(x=np.zeros((1, 3)), y=np.zeros(1, int)),
            "x has 1 sample; a train and a test split need at least 2",
        ),
        (dict(x=np.zeros((0, 3)), y=np.zeros(0, int)), "x has 0 samples"),
        (
            dict(x_train=np.zeros((0, 3)), y_train=np.zeros(0, int), x_test=np.zeros((2, 3)), y_test=[0, 1]),
            "x_train has 0 samples; train and test each need at least 1",
        ),
        (
            dict(x_train=np.zeros((2, 3)), y_train=[0, 1], x_test=np.zeros((0, 3)), y_test=np.zeros(0, int)),
            "x_test has 0 samples",
        ),
    ],
)
def test_npz_too_small_or_empty_is_refused(tmp_path, arrays, message):
    np.savez(tmp_path / "e.npz", **arrays)
    refused(tmp_path, tmp_path / "e.npz", "e.npz: " + message)


def re_shape(shape):
    """``shape`` as a regular expression."""
    return str(shape).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("x", [np.arange(10.0), np.zeros((10, 0)), np.float64(3.0)])
def test_npz_samples_without_a_feature_axis_are_refused_not_guessed(tmp_path, x):
    np.savez(tmp_path / "v.npz", x=x, y=np.arange(10) % 2)
    refused(
        tmp_path,
        tmp_path / "v.npz",
        rf"v.npz: x has shape {re_shape(np.shape(x))}; it needs samples first "
        r"and at least one feature axis, shape \(N, features...\)",
    )


@pytest.mark.parametrize(
    "arrays,message",
    [
        (dict(x=np.zeros((10, 2)), y=np.arange(9) % 2), "x has 10 samples but y has 9"),
        (dict(x=np.zeros((10, 2)), y=np.arange(12) % 2), "x has 10 samples but y has 12"),
        (dict(x=np.zeros((10, 2)), y=np.int64(1)), "x has 10 samples but y has one value"),
        (
            dict(x_train=np.zeros((6, 2)), y_train=np.arange(5) % 2, x_test=np.zeros((2, 2)), y_test=[0, 1]),
            "x_train has 6 samples but y_train has 5",
        ),
        (
            dict(
                x_train=np.zeros((6, 2)), y_train=np.arange(6) % 2, x_test=np.zeros((2, 2)), y_test=[0, 1, 1]
            ),
            "x_test has 2 samples but y_test has 3",
        ),
        (
            dict(x_train=np.zeros((6, 2)), y_train=np.arange(6) % 2, x_test=np.zeros((2, 3)), y_test=[0, 1]),
            r"x_train has items of shape \(2,\) but x_test of shape \(3,\)",
        ),
        (
            dict(
                x_train=np.zeros((6, 2)), y_train=np.zeros((6, 2)), x_test=np.zeros((2, 2)), y_test=[0.5, 1]
            ),
            r"y_train has items of shape \(2,\) but y_test of shape \(\)",
        ),
    ],
)
def test_npz_lengths_and_shapes_that_differ_are_named(tmp_path, arrays, message):
    np.savez(tmp_path / "l.npz", **arrays)
    refused(tmp_path, tmp_path / "l.npz", "l.npz: " + message)


@pytest.mark.parametrize(
    "arrays,message",
    [
        (
            dict(x=np.array([["a", "b"]] * 4), y=np.arange(4) % 2),
            r"x has dtype <U1 \(text\); ingest needs numbers",
        ),
        (
            dict(x=np.zeros((4, 2)), y=np.array(["2020-01-01"] * 4, "M8[D]")),
            r"y has dtype datetime64\[D\] \(dates\)",
        ),
        (
            dict(x=np.zeros((4, 2), complex), y=np.arange(4) % 2),
            r"x has dtype complex128 \(complex numbers\)",
        ),
    ],
)
def test_npz_text_and_other_non_numbers_are_refused_with_their_dtype(tmp_path, arrays, message):
    np.savez(tmp_path / "w.npz", **arrays)
    refused(tmp_path, tmp_path / "w.npz", "w.npz: " + message)


def test_csv_words_after_the_header_are_refused_with_their_column(tmp_path):
    (tmp_path / "w.csv").write_text("a,b,label\n1,2,0\n3,cat,1\n5,6,0\n")
    refused(
        tmp_path,
        tmp_path / "w.csv",
        r"w.csv: column 'b' \(column 2\) holds text \('cat' in row 3\); ingest needs numbers",
    )


def test_a_text_column_is_named_by_its_header_and_counted_as_a_data_frame_counts_it(tmp_path):
    """Issue 63, item 8: after pandas' unnamed index, 'name' is the data frame's column 1 (the file's 2nd);
    without a header, the file's count alone."""
    (tmp_path / "i.csv").write_text(",size,name,label\n0,1.5,abc,0\n1,2.5,def,1\n2,3.5,ghi,0\n")
    refused(
        tmp_path,
        tmp_path / "i.csv",
        r"i.csv: column 'name' \(column 2 after pandas' index, 3 of the file\) holds text \('abc' in row 2\)",
    )
    (tmp_path / "n.csv").write_text("1.5,abc,0\n2.5,def,1\n3.5,ghi,0\n")
    refused(tmp_path, tmp_path / "n.csv", r"n.csv: column 2 holds text \('abc' in row 1\)")


@pytest.mark.parametrize(
    "text,message",
    [
        ("1,2,0\n3,4\n5,6,1\n", "row 2 has 2 columns but row 1 has 3"),
        ("a,b\n1,2,0\n3,4,1\n", "the header has 2 columns but the rows have 3"),
        ("1\n2\n3\n", "has 1 column; it needs at least one feature column and a label column"),
    ],
)
def test_csv_ragged_or_narrow_tables_are_refused(tmp_path, text, message):
    (tmp_path / "r.csv").write_text(text)
    refused(tmp_path, tmp_path / "r.csv", "r.csv: " + message)


def test_csv_label_column_out_of_range_is_refused(tmp_path):
    (tmp_path / "c.csv").write_text("1,2,0\n3,4,1\n5,6,0\n")
    refused(
        tmp_path,
        tmp_path / "c.csv",
        r"--label-column 3: .*c.csv has 3 columns \(0 to 2, or -3 to -1\)",
        label_column=3,
    )


def test_a_single_class_is_refused_unless_the_task_is_regression(tmp_path):
    (tmp_path / "one.csv").write_text("".join(f"{i},{i + 1},0\n" for i in range(6)))
    refused(
        tmp_path,
        tmp_path / "one.csv",
        r"one.csv: every label in the label column \(column 3\) is 0, so "
        r"there is 1 class; training needs 2 or more \(or pass --task regression\)",
    )
    np.savez(tmp_path / "one.npz", x=np.zeros((6, 2)), y=np.zeros(6, np.int64))
    refused(tmp_path, tmp_path / "one.npz", "one.npz: every label in y is 0", task="classification")
    info = accepted(ingest(str(tmp_path / "one.csv"), tmp_path / "r.h5", task="regression"))
    assert info.num_classes == 0


def test_whole_number_targets_with_fewer_than_two_rows_a_class_ask_for_the_task(tmp_path):
    # scikit-learn's diabetes targets as its CSV has them (151.0, 75.0, ...): 442 rows of whole numbers 25 to
    # 346
    rng = np.random.default_rng(0)
    y = rng.integers(25, 347, 442).astype(float)
    (tmp_path / "diabetes.csv").write_text(
        "age,bmi,target\n"
        + "".join(f"{a:.4f},{b:.4f},{t}\n" for a, b, t in zip(rng.normal(size=442), rng.normal(size=442), y))
    )
    refused(
        tmp_path,
        tmp_path / "diabetes.csv",
        r"diabetes.csv: the label column \(column 3\) holds whole numbers "
        r"from 25.0 to 346.0: as classes, 347 of them for 442 rows \(fewer than 2 rows a class\); if they "
        r"are "
        r"quantities to predict, pass --task regression, if classes, --task classification",
    )
    assert (
        accepted(ingest(str(tmp_path / "diabetes.csv"), tmp_path / "r.h5", task="regression")).num_classes
        == 0
    )
    assert (
        accepted(ingest(str(tmp_path / "diabetes.csv"), tmp_path / "c.h5", task="classification")).num_classes
        == 347
    )
    # 20 classes or fewer, or 2 rows a class or more: classes, as before
    (tmp_path / "few.csv").write_text("".join(f"{i},{i % 20}\n" for i in range(30)))
    assert accepted(ingest(str(tmp_path / "few.csv"), tmp_path / "f.h5")).num_classes == 20


@pytest.mark.parametrize(
    "labels,message",
    [
        ([0, 1, 2.5, 1], "y has 2.5"),
        ([0, 1, -1, 1], "y has -1"),
        (np.zeros((4, 2), int), r"y has shape \(4, 2\)"),
    ],
)
def test_classification_asked_of_non_labels_names_the_value(tmp_path, labels, message):
    np.savez(tmp_path / "k.npz", x=np.zeros((4, 2)), y=np.array(labels))
    refused(
        tmp_path,
        tmp_path / "k.npz",
        "k.npz: --task classification needs one column of non-negative integer labels; " + message,
        task="classification",
    )


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("x", np.nan, r"x\[3, 1\] is nan; ingest needs finite numbers"),
        ("x", -np.inf, r"x\[3, 1\] is -inf"),
        (
            "x",
            1e300,
            r"x has values up to 1e\+300 in magnitude, beyond float32 \(max 3.4e\+38\); scale the data",
        ),
        ("y", np.nan, r"y\[3\] is nan"),
        ("y", -1e300, r"y has values up to 1e\+300 in magnitude, beyond float32"),
    ],
)
def test_npz_values_that_are_not_finite_in_float32_are_refused(tmp_path, key, value, message):
    arrays = {"x": np.random.default_rng(0).random((8, 2)), "y": np.linspace(-1, 1, 8)}
    arrays[key][(3, 1) if key == "x" else 3] = value
    np.savez(tmp_path / "f.npz", **arrays)
    refused(tmp_path, tmp_path / "f.npz", "f.npz: " + message)


def test_csv_values_beyond_float32_are_refused_naming_the_largest(tmp_path):
    (tmp_path / "big.csv").write_text("1,2,0\n3,4e300,1\n5e305,6,0\n7,8,1\n")
    refused(
        tmp_path,
        tmp_path / "big.csv",
        r"big.csv: row 3, column 1 is too large \('5e305'\); beyond float32 "
        r"\(max 3.4e\+38\); scale the data",
    )


def test_float_samples_are_stored_as_float32(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).random((10, 3)), y=np.arange(10) % 2)
    with h5py.File(ingest(str(tmp_path / "d.npz"), tmp_path / "d.h5")) as handle:
        assert handle["train/x"].dtype == np.float32 and handle["train/y"].dtype == np.int64


@pytest.mark.parametrize("n,fraction", [(2, 0.9), (2, 0.1), (3, 0.99)])
def test_the_split_never_leaves_train_or_test_empty(tmp_path, n, fraction):
    np.savez(tmp_path / "s.npz", x=np.zeros((n, 2)), y=np.arange(n) % 2)
    info = accepted(ingest(str(tmp_path / "s.npz"), tmp_path / "s.h5", test_fraction=fraction))
    assert info.sizes["train"] >= 1 and info.sizes["test"] >= 1


def good_csv(tmp_path):
    (tmp_path / "g.csv").write_text("".join(f"{i},{i % 2}\n" for i in range(10)))
    return tmp_path / "g.csv"


def never_read(*args, **kwargs):
    raise AssertionError("the source was read before the output was checked")


def test_an_output_under_a_regular_file_is_refused_before_reading(tmp_path, monkeypatch):
    source = good_csv(tmp_path)
    (tmp_path / "plain").write_text("a file, not a directory")
    monkeypatch.setattr("mpidist.tools.ingest.from_csv", never_read)
    for out in (tmp_path / "plain" / "out.h5", tmp_path / "plain" / "deeper" / "out.h5"):
        with pytest.raises(
            UsageError,
            match=f"{out}: cannot write the dataset there: {tmp_path / 'plain'}: {os.strerror(20)}",
        ):
            ingest(str(source), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.csv", "plain"]


def test_an_output_that_is_a_directory_is_refused_before_reading(tmp_path, monkeypatch):
    source = good_csv(tmp_path)
    (tmp_path / "dir").mkdir()
    monkeypatch.setattr("mpidist.tools.ingest.from_csv", never_read)
    with pytest.raises(
        UsageError, match=f"{tmp_path / 'dir'}: cannot write the dataset there: {os.strerror(21)}"
    ):
        ingest(str(source), tmp_path / "dir")
    assert list((tmp_path / "dir").iterdir()) == []


def test_an_output_in_a_read_only_directory_is_refused_before_reading(tmp_path, monkeypatch):
    source = good_csv(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        try:  # root writes there anyway: then there is nothing to test
            (locked / "probe").touch()
            (locked / "probe").unlink()
            pytest.skip("this user can write into a read-only directory (root)")
        except PermissionError:
            pass
        monkeypatch.setattr("mpidist.tools.ingest.from_csv", never_read)
        with pytest.raises(
            UsageError, match=f"{locked / 'out.h5'}: cannot write the dataset there: {os.strerror(13)}"
        ):
            ingest(str(source), locked / "out.h5")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_an_output_that_is_the_source_is_refused(tmp_path):
    source = good_csv(tmp_path)
    text = source.read_text()
    with pytest.raises(UsageError, match="is .*g.csv, an input of this command"):
        ingest(str(source), tmp_path / "." / "g.csv")
    (tmp_path / "hard.csv").hardlink_to(source)  # (the same file by another name)
    with pytest.raises(UsageError, match="an input of this command"):
        ingest(str(tmp_path / "hard.csv"), source)
    assert source.read_text() == text


def test_directories_made_for_a_failed_ingest_are_removed(tmp_path):
    (tmp_path / "bad.csv").write_text("1,2\n3,nan\n5,6\n")
    with pytest.raises(UsageError, match="row 2, column 2 is NaN"):
        ingest(str(tmp_path / "bad.csv"), tmp_path / "new" / "deeper" / "out.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv"]
    good = ingest(str(good_csv(tmp_path)), tmp_path / "new" / "deeper" / "out.h5")
    assert accepted(good).sizes == {"train": 8, "test": 2}


@pytest.mark.parametrize(
    "splits,classes,message",
    [
        (
            {"train": (np.zeros((0, 2)), np.zeros(0, int)), "test": (np.zeros((2, 2)), [0, 1])},
            2,
            "train/x has 0 samples",
        ),
        (
            {"train": (np.zeros(4), [0, 1, 0, 1]), "test": (np.zeros((2, 2)), [0, 1])},
            2,
            "train/x has shape .4,.; it needs samples first",
        ),
        (
            {"train": (np.zeros((4, 2)), [0, 1, 0]), "test": (np.zeros((2, 2)), [0, 1])},
            2,
            "train/x has 4 samples but train/y has 3",
        ),
        (
            {"train": (np.zeros((4, 2)), np.zeros(4, int)), "test": (np.zeros((2, 2)), [0, 0])},
            1,
            "num_classes = 1",
        ),
        (
            {"train": (np.zeros((4, 2)), [0, 1, 0, 1]), "test": (np.zeros((2, 3)), [0, 1])},
            2,
            "train and test differ in shape",
        ),
        (
            {"train": (np.array([["a"]] * 4), [0, 1, 0, 1]), "test": (np.zeros((2, 1)), [0, 1])},
            2,
            r"train/x has dtype <U1 \(text\); ingest needs numbers",
        ),
    ],
)
def test_write_dataset_refuses_a_layout_train_would_refuse(tmp_path, splits, classes, message):
    with pytest.raises(UsageError, match=message):
        write_dataset(tmp_path / "w.h5", "w", splits, classes, "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "x,y,message",
    [
        (np.full((4, 2), np.nan), [0, 1, 0, 1], r"train/x\[0, 0\] is nan"),
        (np.full((4, 2), 1e300), [0, 1, 0, 1], "train/x has values up to 1e\\+300"),
        (np.zeros((4, 2)), [0, 1, 5, 1], r"train/y\[2\] is 5, outside \[0, 2\)"),
    ],
)
def test_write_dataset_checks_values_when_asked(tmp_path, x, y, message):
    splits = {"train": (x, np.array(y)), "test": (np.zeros((2, 2)), np.array([0, 1]))}
    with pytest.raises(UsageError, match=message):
        write_dataset(tmp_path / "w.h5", "w", splits, 2, "", check_values=True)
    assert list(tmp_path.iterdir()) == []
    # the default writes bad values for tests
    data.inspect(write_dataset(tmp_path / "w.h5", "w", splits, 2, ""))


@pytest.mark.parametrize(
    "options,message",
    [
        ({"test_fraction": 1.0}, "--test-fraction must be between 0 and 1"),
        ({"test_fraction": float("nan")}, "--test-fraction"),
        ({"seed": -1}, "--seed must be 0 or more, got -1"),
        ({"task": "clustering"}, "--task must be auto, classification"),
    ],
)
def test_bad_options_are_refused_before_anything_is_read(tmp_path, options, message):
    refused(tmp_path, good_csv(tmp_path), message, **options)


def test_the_command_line_exits_2_with_one_line_and_no_traceback(tmp_path):
    from conftest import mpidist

    (tmp_path / "bad.csv").write_text("x1,x2,label\n1,2,0\n3,,1\n5,6,0\n")
    done, _ = mpidist(1, "ingest", str(tmp_path / "bad.csv"), str(tmp_path / "bad.h5"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mpidist: error: {tmp_path / 'bad.csv'}: row 3, column 'x2' (column 2) is empty (NaN); ingest needs "
        "finite numbers"
    ]
    assert not (tmp_path / "bad.h5").exists()


# -- preparing raw data: standardisation, class names, delimiters, headers, the summary ----------------------
def stored(path):
    """``{split: (x, y)}`` and ``(mean, std)`` (or None) as written to ``path``."""
    with h5py.File(path) as handle:
        splits = {split: (handle[f"{split}/x"][...], handle[f"{split}/y"][...]) for split in data.SPLITS}
        stats = (handle["stats/mean"][...], handle["stats/std"][...]) if "stats" in handle else None
    return splits, stats


def test_standardize_stores_the_training_rows_statistics_and_leaves_x_as_it_was(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(60, 3)) * [100.0, 0.01, 1.0] + [1000.0, -3.0, 0.0]
    x[:, 2] = 7.25  # a constant feature: its std is 1
    np.savez(tmp_path / "s.npz", x=x, y=np.arange(60) % 3)
    raw = ingest(str(tmp_path / "s.npz"), tmp_path / "raw.h5", seed=4)
    result = ingest(str(tmp_path / "s.npz"), tmp_path / "s.h5", seed=4, standardize=True)
    assert result.standardized and not raw.standardized
    (splits, (mean, std)), (raw_splits, none) = stored(result), stored(raw)
    assert none is None and mean.dtype == std.dtype == np.float64 and mean.shape == std.shape == (3,)
    train = splits["train"][0].astype(np.float64)
    np.testing.assert_array_equal(mean, train.mean(axis=0))  # numpy's, of the training rows only
    np.testing.assert_array_equal(std[:2], train.std(axis=0)[:2])
    assert std[2] == 1.0
    every = np.concatenate([splits["train"][0], splits["test"][0]]).astype(np.float64)
    assert not np.allclose(mean[:2], every.mean(axis=0)[:2], rtol=1e-9, atol=0)  # the test rows are left out
    for split in data.SPLITS:  # x and y stored as without --standardize
        for got, want in zip(splits[split], raw_splits[split]):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        np.sort(every, axis=0), np.sort(x.astype(np.float32).astype(np.float64), axis=0)
    )
    info = data.inspect(result)
    np.testing.assert_array_equal(info.mean, mean)
    np.testing.assert_array_equal(info.std, std)
    shard = data.Shard(info, "test", 0, 1, info.sample_shape, np.float64)
    np.testing.assert_allclose(shard.x, (splits["test"][0] - mean) / std, rtol=1e-12)


def test_shard_reads_standardised_samples_in_closed_form(tmp_path):
    np.savez(
        tmp_path / "t.npz",
        x_train=np.array([[1.0, 10.0], [3.0, 10.0], [5.0, 10.0]]),
        y_train=[0, 1, 0],
        x_test=np.array([[7.0, 12.0]]),
        y_test=[1],
    )
    info = data.inspect(ingest(str(tmp_path / "t.npz"), tmp_path / "t.h5", standardize=True))
    np.testing.assert_array_equal(info.mean, [3.0, 10.0])  # 7 and 12 are test rows: not counted
    np.testing.assert_allclose(info.std, [np.sqrt(8 / 3), 1.0])  # the constant feature: 1, not 0
    s = np.sqrt(8 / 3)
    for dtype in (np.float32, np.float64):
        train, test = (data.Shard(info, split, 0, 1, (2,), dtype) for split in data.SPLITS)
        assert train.x.dtype == dtype
        np.testing.assert_allclose(train.x, [[-2 / s, 0.0], [0.0, 0.0], [2 / s, 0.0]], rtol=1e-6)
        np.testing.assert_allclose(test.x, [[4 / s, 2.0]], rtol=1e-6)
    with h5py.File(info.path) as handle:  # stored raw
        np.testing.assert_array_equal(handle["test/x"][...], [[7.0, 12.0]])


def test_text_labels_in_a_csv_become_classes_named_in_sorted_order(tmp_path):
    animals = ["emu", "cat", "dog"]
    rows = "".join(f"{i},{i * 0.5},{animals[i % 3]}\n" for i in range(30))
    (tmp_path / "a.csv").write_text("index,half,animal\n" + rows)
    result = ingest(str(tmp_path / "a.csv"), tmp_path / "a.h5")
    info = accepted(result)
    assert info.num_classes == 3 and info.class_names == ("cat", "dog", "emu") == result.class_names
    for x, y in stored(result)[0].values():
        assert y.dtype == np.int64
        assert [info.class_names[label] for label in y] == [animals[int(i) % 3] for i in x[:, 0]]


@pytest.mark.parametrize("train,test", [(["b", "a", "b"], ["c", "a"]), ([b"b", b"a", b"b"], [b"c", b"a"])])
def test_text_or_bytes_labels_in_an_npz_become_named_classes(tmp_path, train, test):
    np.savez(
        tmp_path / "n.npz",
        x_train=np.zeros((3, 2)),
        y_train=np.array(train),
        x_test=np.ones((2, 2)),
        y_test=np.array(test),
    )
    info = accepted(ingest(str(tmp_path / "n.npz"), tmp_path / "n.h5"))
    assert info.class_names == ("a", "b", "c")
    splits, _ = stored(info.path)
    assert splits["train"][1].tolist() == [1, 0, 1] and splits["test"][1].tolist() == [2, 0]


@pytest.mark.parametrize(
    "text,options,message",
    [
        ("1,cat\n2,dog\n3,\n", {}, r"row 3, column 2 is empty; the label column holds class names"),
        (
            "1,cat\n2,dog\n3,4\n",
            {},
            r"the label column \(column 2\) mixes numbers and class names \('4' in row 3\)",
        ),
        (
            "1,0\n2,1\n3,dog\n",
            {},
            r"the label column \(column 2\) mixes numbers and class names \('0' in row 1\)",
        ),
        ("1,cat\nx,dog\n3,cat\n", {}, r"column 1 holds text \('x' in row 2\); ingest needs numbers"),
        (
            "1,cat\n2,cat\n3,cat\n",
            {},
            r"every label in the label column \(column 2\) is 'cat', so there is 1 class",
        ),
        (
            "1,cat\n2,dog\n",
            {"task": "regression"},
            r"the label column \(column 2\) holds text \(class names such as "
            r"'cat'\); --task regression needs numbers",
        ),
        ("1;cat\n2;dog\n3;nan;\n", {}, r"row 3 has 3 columns but row 1 has 2"),
        ("1;cat\n2;dog\n\n3e99;emu\n", {}, r"row 4, column 1 is too large \('3e99'\)"),  # a line of the file
        (
            f"1,cat\n2,{'d' * 201}\n",
            {},
            r"the label column \(column 2\) holds a class name of 201 characters "
            r"\('ddd.*\.\.\.\); a class name has at most 200",
        ),
    ],
)
def test_bad_text_labels_are_refused_with_their_row(tmp_path, text, options, message):
    (tmp_path / "b.csv").write_text(text)
    refused(tmp_path, tmp_path / "b.csv", "b.csv: " + message, **options)


def test_text_labels_in_an_npz_are_checked(tmp_path):
    np.savez(tmp_path / "e.npz", x=np.zeros((4, 2)), y=np.array(["a", "b", " ", "a"]))
    refused(tmp_path, tmp_path / "e.npz", r"e.npz: y\[2\] is empty; every sample needs a class name")
    np.savez(
        tmp_path / "m.npz",
        x_train=np.zeros((2, 2)),
        y_train=np.array(["a", "b"]),
        x_test=np.zeros((1, 2)),
        y_test=np.array([1]),
    )
    refused(tmp_path, tmp_path / "m.npz", "m.npz: one of y_train and y_test holds text")


def test_a_semicolon_file_keeps_its_first_row_as_data_and_says_which_delimiter(tmp_path):
    (tmp_path / "s.csv").write_text("".join(f"{i};{i * 2}.5;{i % 2}\n" for i in range(10)))
    result = ingest(str(tmp_path / "s.csv"), tmp_path / "s.h5")
    assert sum(result.sizes.values()) == 10 and result.sample_shape == (2,)
    assert (result.delimiter, result.delimiter_detected, result.header_line) == ("';'", True, None)
    splits, _ = stored(result)
    assert 0.0 in np.concatenate([x[:, 0] for x, _ in splits.values()])  # row 1 (0;0.5;0) is data
    assert "';' (detected)" in result.summary() and "none: the first line is data" in result.summary()


@pytest.mark.parametrize(
    "delimiter,cut,shown",
    [
        (",", ",", "','"),
        ("tab", "\t", "tab"),
        ("whitespace", "   ", "whitespace"),
        ("auto", "\t", "tab"),
        ("auto", " ", "whitespace"),
        ("auto", ", ", "','"),
    ],
)
def test_a_header_is_detected_and_the_delimiter_reported(tmp_path, delimiter, cut, shown):
    header = (
        cut.join(["first feature", "second", "label"]) if cut.strip(" ") else cut.join(["a", "b", "label"])
    )
    rows = "".join(cut.join([str(i), f"{i / 4}", "yes" if i % 3 else "no"]) + "\n" for i in range(12))
    (tmp_path / "h.csv").write_text("\n" + header + "\n" + rows)  # a blank first line: the header is line 2
    result = ingest(str(tmp_path / "h.csv"), tmp_path / "h.h5", delimiter=delimiter)
    assert (result.delimiter, result.delimiter_detected) == (shown, delimiter == "auto")
    assert (
        result.header_line == 2 and sum(result.sizes.values()) == 12 and result.class_names == ("no", "yes")
    )
    assert "line 2 skipped (column names)" in result.summary()


def test_a_delimiter_is_refused_where_it_means_nothing(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.arange(4) % 2)
    refused(tmp_path, tmp_path / "d.npz", "--delimiter applies to .csv files", delimiter=";")
    refused(
        tmp_path, good_csv(tmp_path), "--delimiter must be auto, ',', ';', tab or whitespace", delimiter="|"
    )


def test_the_result_is_the_path_and_the_summary_says_what_was_written(tmp_path):
    rows = "".join(f"{i},{i % 5},{['low', 'high'][i % 2]}\n" for i in range(20))
    (tmp_path / "t.csv").write_text("x1,x2,level\n" + rows)
    result = ingest(str(tmp_path / "t.csv"), tmp_path / "t.h5", test_fraction=0.25, standardize=True)
    assert os.fspath(result) == str(tmp_path / "t.h5") and result.path == tmp_path / "t.h5"
    assert (result.sizes, result.sample_shape, result.num_classes) == ({"train": 15, "test": 5}, (2,), 2)
    lines = result.summary().splitlines()
    assert lines[0] == f"mpidist ingest: wrote {tmp_path / 't.h5'} (dataset 't' from {tmp_path / 't.csv'})"
    assert lines[1:] == [
        "  samples       15 train, 5 test",
        "  features      2 per sample, sample shape (2,)",
        "  classes       2 named by the text labels: 0 'high', 1 'low'",
        "  delimiter     ',' (detected)",
        "  header        line 1 skipped (column names)",
        "  index         column 1 ('x1') holds the row numbers 0 to 19; kept as a feature (if it "
        "is an index, it carries nothing to learn: remove it from the file)",
        "  standardised  yes: stats/mean and stats/std of the training rows stored; train, eval and "
        "predict read (x - mean) / std",
    ]
    np.savez(tmp_path / "r.npz", x=np.zeros((8, 3, 2)), y=np.linspace(0, 1, 16).reshape(8, 2))
    text = ingest(str(tmp_path / "r.npz"), tmp_path / "r.h5").summary()
    assert "6 per sample, sample shape (3, 2)" in text and "regression, 2 targets per sample" in text
    assert "delimiter" not in text and "standardised  no" in text
    text = ingest(str(good_csv(tmp_path)), tmp_path / "g.h5").summary()
    assert "classes       2 (labels 0 to 1)" in text


def test_the_command_line_prints_the_summary(tmp_path):
    from conftest import mpidist

    (tmp_path / "c.csv").write_text("".join(f"{i};{i % 3};{'ab'[i % 2]}\n" for i in range(10)))
    done, _ = mpidist(
        1, "ingest", str(tmp_path / "c.csv"), str(tmp_path / "c.h5"), "--standardize", "--delimiter", ";"
    )
    assert done.returncode == 0, done.stderr
    for text in (
        "wrote",
        "8 train, 2 test",
        "0 'a', 1 'b'",
        "';' (given)",
        "header        none",
        "yes: stats",
    ):
        assert text in done.stdout


@pytest.mark.parametrize("first_cell,start", [("", 0), ("Unnamed: 0", 0), ("", 1)])
def test_an_unnamed_first_column_of_row_numbers_is_an_index_and_is_dropped_with_a_note(
    tmp_path, first_cell, start
):
    rng = np.random.default_rng(0)
    features, labels = rng.random((12, 2)), rng.integers(0, 2, 12)

    def write(name, first, column):
        path = tmp_path / name
        path.write_text(
            "\n".join(
                [f"{first},a,b,label"]
                + [f"{column(i)},{f[0]},{f[1]},{c}" for i, (f, c) in enumerate(zip(features, labels))]
            )
            + "\n"
        )
        return str(path)

    written = ingest(
        write("indexed.csv", first_cell, lambda i: start + i), str(tmp_path / "out.h5"), test_fraction=0.25
    )
    assert written.sample_shape == (2,)  # a, b: the index is gone
    assert "dropped" in written.index_note and "index" in written.summary()
    with h5py.File(written.path, "r") as f:
        rows = np.concatenate([f["train/x"][...], f["test/x"][...]])
    assert sorted(map(tuple, rows.round(5))) == sorted(map(tuple, features.astype(np.float32).round(5)))
    # named, the row numbers stay a feature, and the summary says what they look like
    named = ingest(write("named.csv", "step", lambda i: i), str(tmp_path / "named.h5"), test_fraction=0.25)
    assert named.sample_shape == (3,) and "kept as a feature" in named.index_note
    # unnamed above named columns, whatever it numbers (a subset's index, pandas' "Unnamed: 0"): an index too
    for first in ("", "Unnamed: 0"):
        other = ingest(
            write("other.csv", first, lambda i: 2 * i + 101), str(tmp_path / "other.h5"), test_fraction=0.25
        )
        assert other.sample_shape == (2,) and "dropped" in other.index_note
        assert other.feature_names == ("a", "b")
    # a file without a header: its columns are kept, and it has no names to store
    path = tmp_path / "bare.csv"
    path.write_text(
        "\n".join(f"{2 * i + 101},{f[0]},{f[1]},{c}" for i, (f, c) in enumerate(zip(features, labels)))
    )
    bare = ingest(str(path), str(tmp_path / "bare.h5"), test_fraction=0.25)
    assert bare.sample_shape == (3,) and bare.index_note is None and bare.feature_names is None


@pytest.mark.parametrize(
    "source,options,message",
    [
        (
            "digits",
            {"task": "regression"},
            "--task regression applies to .npz and .csv files; digits is a named source",
        ),
        ("synthetic:40,3,2", {"task": "regression"}, "synthetic:40,3,2 is a named source of classes"),
        ("digits", {"label_column": 0}, "--label-column applies to .csv files, not to digits"),
        ("synthetic:40,3,2", {"label_column": 0}, "--label-column applies to .csv files"),
        ("synthetic:40,3,2", {"delimiter": ";"}, "--delimiter applies to .csv files"),
        ("d.npz", {"label_column": 1}, "--label-column applies to .csv files, not to .*d.npz"),
        (
            "digits",
            {"test_fraction": 0.3},
            "--test-fraction applies where the source has no test split; digits comes with its own",
        ),
        ("mnist-5k", {"test_fraction": 0.2}, "mnist-5k comes with its own"),  # (the default's value, given)
        ("split.npz", {"test_fraction": 0.3}, "split.npz: has a test split of its own"),
    ],
)
def test_an_option_the_source_would_ignore_is_refused(tmp_path, source, options, message):
    """Issue 41, item 13: ``--task regression`` on a named source wrote a classification file without a word;
    so did --label-column and --delimiter wherever there is no CSV to apply them to, and --test-fraction
    wherever the source has a test split of its own."""
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.arange(4) % 2)
    np.savez(
        tmp_path / "split.npz",
        x_train=np.zeros((4, 2)),
        y_train=np.arange(4) % 2,
        x_test=np.ones((2, 2)),
        y_test=np.arange(2),
    )
    refused(tmp_path, tmp_path / source if source.endswith(".npz") else source, message, **options)


def test_task_classification_on_a_named_source_is_what_it_is(tmp_path):
    result = ingest("synthetic:40,3,2", tmp_path / "s.h5", task="classification")
    assert result.num_classes == 2


def test_ingest_task_regression_of_a_named_source_exits_2_on_one_line(tmp_path):
    from conftest import mpidist

    done, _ = mpidist(1, "ingest", "digits", str(tmp_path / "d.h5"), "--task", "regression")
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--task regression applies to .npz and .csv files" in lines[0], done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "text,x,class_names",
    [
        ("a,b,label\n0.5,1.5,2\n", [[0.5, 1.5, 2.0]], None),  # a header, one row
        (",a,b\n7,0.5,1.5\n", [[0.5, 1.5]], None),  # pandas' header and index, one row: the index dropped
        ("0.5,1.5,2\n", [[0.5, 1.5, 2.0]], None),  # no header: the only row is data
        ("0.5,1.5,cat\n", [[0.5, 1.5]], ("cat",)),  # its one text cell is a class name: data
        ("0.5\n", [[0.5]], None),  # one column: one feature
        (
            "0.5,1.5,cat\n2.5,3.5,cat\n",
            [[0.5, 1.5], [2.5, 3.5]],
            ("cat",),
        ),  # one class: left out, not refused
    ],
)
def test_a_csv_that_predict_reads_may_hold_one_row_one_column_and_one_class(tmp_path, text, x, class_names):
    """Issue 61, item 11: predict read its CSV with ingest's needs, and refused one row with "a train and a
    test split need at least 2" (and one column, and labels of one class, in ingest's words too)."""
    from mpidist.tools.csv_table import PREDICT, read_csv

    (tmp_path / "one.csv").write_text(text)
    table = read_csv(tmp_path / "one.csv", needs=PREDICT)
    columns = table.x if class_names else np.column_stack([table.x, table.y])
    assert columns.tolist() == x and table.class_names == class_names


@pytest.mark.parametrize(
    "text,message",
    [
        ("a,b,label\n", r"0 rows of data after the header \(line 1\); predict needs at least 1"),
        ("label\n", r"0 rows of data after the header \(line 1\); predict needs at least 1"),
        ("", "the file is empty; predict needs at least 1"),
        ("\n \n", "0 rows of data; predict needs at least 1"),
        ("a,b\n1,\n", r"row 2, column 'b' \(column 2\) is empty \(NaN\); predict needs finite numbers"),
        (
            "a,b,c\n1,x,0\n2,3,1\n",
            r"column 'b' \(column 2\) holds text \('x' in row 2\); predict needs numbers",
        ),
    ],
)
def test_a_csv_that_predict_refuses_is_refused_in_predicts_words(tmp_path, text, message):
    from mpidist.tools.csv_table import PREDICT, read_csv

    (tmp_path / "none.csv").write_text(text)
    with pytest.raises(UsageError, match=f"none.csv: {message}") as caught:
        read_csv(tmp_path / "none.csv", needs=PREDICT)
    assert "ingest" not in str(caught.value) and "train" not in str(caught.value)


@pytest.mark.parametrize(
    "text,message",
    [
        ("a,b,label\n0.5,1.5,2\n", r"1 row of data after the header \(line 1\); a train and a test split"),
        ("0.5,1.5,2\n", "1 row of data; a train and a test split need at least 2"),
        ("0.5,1.5,cat\n", "1 row of data; a train and a test split need at least 2"),
        ("0.5\n1.5\n", "has 1 column; it needs at least one feature column and a label column"),
        ("0.5,cat\n1.5,cat\n", r"every label in the label column \(column 2\) is 'cat', so there is 1 class"),
    ],
)
def test_ingest_still_needs_two_rows_two_columns_and_two_classes(tmp_path, text, message):
    (tmp_path / "few.csv").write_text(text)
    refused(tmp_path, tmp_path / "few.csv", message)


@pytest.mark.parametrize("labels", ["numbers", "names"])
def test_a_csv_with_every_cell_quoted_reads_as_the_same_file_unquoted(tmp_path, labels):
    """csv.QUOTE_ALL quotes every number: its labels were 'a column that mixes numbers and class names'."""
    import csv

    rng = np.random.default_rng(3)
    rows = [["sepal", "petal", "kind"]] + [
        [f"{rng.random():.3f}", f"{rng.random():.3f}", str(i % 2) if labels == "numbers" else f"k{i % 2}"]
        for i in range(20)
    ]
    for name, quoting in (("plain.csv", csv.QUOTE_MINIMAL), ("quoted.csv", csv.QUOTE_ALL)):
        with open(tmp_path / name, "w", newline="") as handle:
            csv.writer(handle, quoting=quoting).writerows(rows)
    assert '"0.' in (tmp_path / "quoted.csv").read_text()
    # (a blank after each comma, as people write them)
    spaced = (tmp_path / "quoted.csv").read_text().replace('","', '", "')
    (tmp_path / "spaced.csv").write_text(spaced)
    read = {}
    for name in ("plain", "quoted", "spaced"):
        path = ingest(str(tmp_path / f"{name}.csv"), tmp_path / f"{name}.h5", seed=1)
        with h5py.File(path) as handle:
            read[name] = [handle[f"{split}/{key}"][...] for split in ("train", "test") for key in ("x", "y")]
    for plain, quoted, spaced in zip(read["plain"], read["quoted"], read["spaced"]):
        np.testing.assert_array_equal(plain, quoted)
        np.testing.assert_array_equal(plain, spaced)
