"""``predict``: a checkpoint's predictions on new samples, spread over the ranks, in input order.

The multi-rank tests run in-process under ``mpiexec -n N python -m pytest -m mpi
--with-mpi tests/test_predict.py`` (any N); the others are serial, and launch
``python -m mpidist predict`` at 1, 2 and 4 ranks as users do.
"""

import io
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist.data import resolve
from mpidist.tools.ingest import write_dataset

from conftest import mpidist as launch

QUIET = dict(progress="none", metrics="", stream=io.StringIO())


def shared_dir(tmp_path_factory, name):
    """A directory every rank of the world sees: rank 0's."""
    return Path(MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp(name)), root=0))


def digits_test():
    with h5py.File(resolve("digits"), "r") as handle:
        return handle["test/x"][...], handle["test/y"][...]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """``(checkpoint, the trained model on rank 0 or None)`` of a short digits run on every rank of the
    world."""
    directory = shared_dir(tmp_path_factory, "digits")
    result = mpidist.train("mlp", "digits", epochs=2, checkpoint_dir=str(directory / "ck"), **QUIET)
    checkpoint = MPI.COMM_WORLD.bcast(str(result.checkpoints[-1]) if result.is_chief else None, root=0)
    return Path(checkpoint), result.model


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    """``(checkpoint, dataset file)`` of a short run of ``linear`` on a 2-target regression."""
    directory = shared_dir(tmp_path_factory, "regression")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 3)).astype(np.float32)
    y = (x @ np.array([[1.0, 0.5], [-2.0, 0.0], [0.5, 3.0]])).astype(np.float32)
    dataset = directory / "lin.h5"
    if MPI.COMM_WORLD.Get_rank() == 0:
        write_dataset(dataset, "lin", {"train": (x[:230], y[:230]), "test": (x[230:], y[230:])}, 0, "test")
    MPI.COMM_WORLD.Barrier()
    result = mpidist.train(
        "linear", str(dataset), epochs=3, lr=0.05, checkpoint_dir=str(directory / "ck"), **QUIET
    )
    checkpoint = MPI.COMM_WORLD.bcast(str(result.checkpoints[-1]) if result.is_chief else None, root=0)
    return Path(checkpoint), dataset


def softmax(logits):
    e = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


# -- on every rank of the world, in-process ------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_predict_on_the_test_split_reproduces_evals_accuracy_exactly_in_input_order(
    digits_run, tmp_path_factory
):
    checkpoint, model = digits_run
    world = MPI.COMM_WORLD
    output = shared_dir(tmp_path_factory, "out") / "preds.h5"
    figures = mpidist.evaluate(checkpoint)
    result = mpidist.predict(checkpoint, output=output)
    assert result.samples == figures["samples"] == 359 and result.output == output
    assert result.task == "classification" and result.step == figures["step"]
    assert result.figures["accuracy"] == figures["test_accuracy"]  # on every rank, exactly
    if world.Get_rank() != 0:
        assert result.classes is None and result.probabilities is None and result.values is None
        return
    x, y = digits_test()
    with h5py.File(output, "r") as handle:
        classes, probabilities = handle["class"][...], handle["probabilities"][...]
        attrs = dict(handle.attrs)
    assert (
        classes.dtype == np.int64 and probabilities.dtype == np.float32 and probabilities.shape == (359, 10)
    )
    assert (classes == y).mean() == figures["test_accuracy"]
    assert np.array_equal(classes, result.classes) and np.array_equal(probabilities, result.probabilities)
    # input order: as one process's forward pass over the whole split
    logits = model.forward(x)
    assert np.array_equal(classes, logits.argmax(axis=1))
    np.testing.assert_allclose(probabilities, softmax(logits), rtol=1e-4, atol=1e-6)
    assert attrs["checkpoint"] == str(checkpoint.resolve()) and attrs["step"] == result.step
    assert attrs["model"] == "mlp" and attrs["split"] == "test" and attrs["data"] == str(resolve("digits"))
    assert attrs["task"] == "classification" and attrs["samples"] == 359
    assert not list(output.parent.glob(".*tmp*"))  # nothing left aside


@pytest.mark.mpi(min_size=1)
def test_a_regression_writes_values_whose_mse_is_evals(regression_run, tmp_path_factory):
    checkpoint, dataset = regression_run
    output = shared_dir(tmp_path_factory, "out") / "values.h5"
    figures = mpidist.evaluate(checkpoint)
    result = mpidist.predict(checkpoint, output=output)
    assert result.task == "regression" and result.samples == 70
    assert result.figures["mse"] == pytest.approx(figures["test_mse"], rel=1e-9)
    if MPI.COMM_WORLD.Get_rank() == 0:
        with h5py.File(output, "r") as handle:
            values = handle["values"][...]
            assert "class" not in handle and "probabilities" not in handle
        with h5py.File(dataset, "r") as handle:
            x, y = handle["test/x"][...], handle["test/y"][...]
        assert values.shape == (70, 2) and np.array_equal(values, result.values)
        assert np.mean((values.astype(np.float64) - y) ** 2) == pytest.approx(figures["test_mse"], rel=1e-6)
        # plain samples of the same rows give the same values
        plain = mpidist.predict(checkpoint, x, comm=MPI.COMM_SELF)
        assert np.array_equal(plain.values, values) and plain.figures == {} and plain.output is None


@pytest.mark.mpi(min_size=1)
def test_an_array_of_fewer_samples_than_ranks_predicts_each_in_order_and_writes_nothing(digits_run):
    checkpoint, model = digits_run
    world = MPI.COMM_WORLD
    x, _ = digits_test()
    few = x[: max(1, world.Get_size() - 1)]  # some ranks have no rows at all
    result = mpidist.predict(checkpoint, few)
    assert result.output is None and result.samples == len(few) and result.figures == {}
    if world.Get_rank() == 0:
        assert np.array_equal(result.classes, model.forward(few).argmax(axis=1))


@pytest.mark.mpi(min_size=1)
def test_bad_samples_on_one_rank_end_every_rank_with_exit_code_2(digits_run):
    checkpoint, _ = digits_run
    world = MPI.COMM_WORLD
    x, _ = digits_test()
    x = x[: 2 * world.Get_size()].copy()
    x[-1, 3, 3] = np.nan  # in the last rank's block only
    with pytest.raises(SystemExit) as stopped:
        mpidist.predict(checkpoint, x)
    assert stopped.value.code == 2


# -- serial: the command line at 1, 2 and 4 ranks, and bad input ---------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_command_reproduces_evals_accuracy_exactly_at_1_2_and_4_ranks(digits_run, tmp_path, ranks):
    checkpoint, model = digits_run
    figures = mpidist.evaluate(checkpoint, comm=MPI.COMM_SELF)
    output = tmp_path / "preds.h5"
    done, _ = launch(ranks, "predict", str(checkpoint), "--output", str(output), timeout=120)
    assert done.returncode == 0, done.stderr
    x, y = digits_test()
    with h5py.File(output, "r") as handle:
        classes = handle["class"][...]
    assert (classes == y).mean() == figures["test_accuracy"]
    assert np.array_equal(classes, model.forward(x).argmax(axis=1))
    assert done.stdout.count("mpidist predict: ") == 1  # rank 0 alone reports
    assert "359 samples" in done.stdout and str(output) in done.stdout
    assert f"accuracy {100 * figures['test_accuracy']:.2f}%" in done.stdout


def test_eval_and_predict_on_a_checkpoint_directory_read_its_newest_as_resume_auto_picks_it(
    digits_run, tmp_path
):
    """Issue 63, item 5: the directory names its newest loadable checkpoint (of the lineage written last); a
    newer one that cannot be read is passed over with a warning; a directory with none is refused."""
    import shutil

    checkpoint, _ = digits_run
    directory = tmp_path / "ck"
    shutil.copytree(checkpoint.parent, directory)
    newest = directory / checkpoint.name
    figures = mpidist.evaluate(directory, comm=MPI.COMM_SELF)
    assert figures["checkpoint"] == str(newest)
    assert figures["test_accuracy"] == mpidist.evaluate(checkpoint, comm=MPI.COMM_SELF)["test_accuracy"]
    done, _ = launch(2, "eval", str(directory))
    assert done.returncode == 0 and f"mpidist eval: {newest} (step " in done.stdout, done.stderr
    # a newer file of the same lineage that is no checkpoint: passed over, said
    step, lineage = checkpoint.stem.split("-")[1:]
    broken = directory / f"ckpt-{int(step) + 10:08d}-{lineage}.h5"
    broken.write_bytes(b"not HDF5")
    done, _ = launch(1, "predict", str(directory), "--output", str(tmp_path / "p.csv"))
    assert done.returncode == 0, done.stderr
    assert f"mpidist: warning: skipped unreadable checkpoint {broken.name}: " in done.stdout
    assert f"({checkpoint.name}, step " in done.stdout
    (tmp_path / "none").mkdir()
    done, _ = launch(2, "eval", str(tmp_path / "none"))
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"mpidist: error: {tmp_path / 'none'}: a directory that holds no checkpoint to read"
    )


def test_plain_sample_files_of_every_kind_give_the_dataset_splits_predictions(digits_run, tmp_path):
    checkpoint, model = digits_run
    x, _ = digits_test()
    expected = model.forward(x).argmax(axis=1)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "x.npz", x=x)
    with h5py.File(tmp_path / "x.h5", "w") as handle:
        handle["x"] = x.astype(np.float64)
    for name in ("x.npy", "x.npz", "x.h5"):
        done, _ = launch(
            2,
            "predict",
            str(checkpoint),
            "--data",
            str(tmp_path / name),
            "--output",
            str(tmp_path / f"{name}.out.h5"),
        )
        assert done.returncode == 0, done.stderr
        assert "359 samples of" in done.stdout and "accuracy" not in done.stdout  # plain samples: no labels
        with h5py.File(tmp_path / f"{name}.out.h5", "r") as handle:
            assert np.array_equal(handle["class"][...], expected), name
            assert handle.attrs["data"] == str(tmp_path / name) and handle.attrs["split"] == ""


def test_the_train_split_and_a_split_the_file_lacks(digits_run, tmp_path):
    checkpoint, _ = digits_run
    done, _ = launch(2, "predict", str(checkpoint), "--split", "train", "--output", str(tmp_path / "t.h5"))
    assert done.returncode == 0, done.stderr
    assert "1438 samples" in done.stdout and "train split" in done.stdout
    done, _ = launch(2, "predict", str(checkpoint), "--split", "val", "--output", str(tmp_path / "v.h5"))
    assert done.returncode == 2 and "has no val split" in done.stderr
    assert not (tmp_path / "v.h5").exists()


def _bad_inputs(tmp_path, checkpoint):
    x, _ = digits_test()
    np.save(tmp_path / "wide.npy", np.zeros((4, 65), np.float32))
    nan = x[:10].copy()
    nan[7, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    np.save(tmp_path / "objects.npy", np.array([[1, None]] * 3, dtype=object), allow_pickle=True)
    with h5py.File(tmp_path / "text.h5", "w") as handle:
        handle["x"] = np.array([b"ab", b"cd"])
    np.savez(tmp_path / "noxs.npz", samples=x[:3])
    return {
        "wrong shape": (["--data", str(tmp_path / "wide.npy")], "samples of shape (65,)"),
        "NaN": (["--data", str(tmp_path / "nan.npy")], "NaN or Inf (first at sample 7)"),
        "objects": (["--data", str(tmp_path / "objects.npy")], "dtype object"),
        "text": (["--data", str(tmp_path / "text.h5")], "predict needs numbers"),
        "no x": (["--data", str(tmp_path / "noxs.npz")], "needs an array x; has samples"),
        "missing": (["--data", str(tmp_path / "missing.npy")], "no such file"),
        "output = input": (
            ["--data", str(tmp_path / "nan.npy"), "--output", str(tmp_path / "nan.npy")],
            "an input of this command",
        ),
        "output = checkpoint": (["--output", str(checkpoint)], "an input of this command"),
        "no output": ([], "arguments are required: --output"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "wrong shape",
        "NaN",
        "objects",
        "text",
        "no x",
        "missing",
        "output = input",
        "output = checkpoint",
        "no output",
    ],
)
def test_bad_input_exits_2_on_every_rank_with_one_message_and_leaves_the_old_output(
    digits_run, tmp_path, case
):
    checkpoint, _ = digits_run
    flags, message = _bad_inputs(tmp_path, checkpoint)[case]
    output = tmp_path / "old.h5"
    output.write_bytes(b"the previous predictions")
    if "--output" not in flags and case != "no output":
        flags = flags + ["--output", str(output)]
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    done, _ = launch(2, "predict", str(checkpoint), *flags)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and done.stderr.count("mpidist: error") == 1, done.stderr
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written, nothing aside
    assert checkpoint.is_file()


def test_an_existing_output_is_replaced_whole(digits_run, tmp_path):
    checkpoint, _ = digits_run
    output = tmp_path / "preds.h5"
    output.write_bytes(b"the previous predictions")
    done, _ = launch(1, "predict", str(checkpoint), "--output", str(output))
    assert done.returncode == 0, done.stderr
    with h5py.File(output, "r") as handle:
        assert handle["class"].shape == (359,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.h5"]


def test_plain_samples_of_a_checkpoint_whose_dataset_cannot_be_read_are_refused(tmp_path):
    x, y = digits_test()
    arrays = mpidist.ArrayData(train=(x, y), test=(x, y), name="in-memory")
    result = mpidist.train("mlp", arrays, steps=2, checkpoint_dir=str(tmp_path), comm=MPI.COMM_SELF, **QUIET)
    checkpoint = result.checkpoints[-1]
    # the dataset itself, given again, is predicted
    assert mpidist.predict(checkpoint, arrays, comm=MPI.COMM_SELF).figures["accuracy"] >= 0.0
    with pytest.raises(SystemExit) as stopped:
        mpidist.predict(checkpoint, x, comm=MPI.COMM_SELF)
    assert stopped.value.code == 2


def test_the_api_refuses_an_unknown_split_and_non_numeric_arrays(digits_run, capsys):
    checkpoint, _ = digits_run
    x, _ = digits_test()
    for data, split, message in (
        (None, "validation", "split 'validation'"),
        (x.astype(np.complex64), "test", "complex numbers"),
        (x[:, 0, 0], "test", "needs samples first"),
    ):
        with pytest.raises(SystemExit) as stopped:
            mpidist.predict(checkpoint, data, comm=MPI.COMM_SELF, split=split)
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_output_is_refused_as_the_predictions_and_nothing_is_left(digits_run, tmp_path, capsys):
    checkpoint, _ = digits_run
    (tmp_path / "plain").write_text("a file, not a directory")
    output = tmp_path / "plain" / "preds.h5"
    with pytest.raises(SystemExit) as stopped:
        mpidist.predict(checkpoint, output=output, comm=MPI.COMM_SELF)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("mpidist: error") == 1, err
    assert f"{output}: cannot write the predictions there: {tmp_path / 'plain'}: " in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_a_csv_in_and_a_csv_out_reproduce_evals_accuracy_on_the_breast_cancer_rows(tmp_path):
    """Rows of scikit-learn's breast-cancer table as a CSV user has them: ingest (standardised), train, eval;
    then predict the test split's rows from a CSV (label column included) into a CSV."""
    import csv

    datasets = pytest.importorskip("sklearn.datasets", reason="the test extra")
    x, y = datasets.load_breast_cancer(return_X_y=True)
    header = ",".join(f"f{i}" for i in range(x.shape[1])) + ",label"
    (tmp_path / "bc.csv").write_text(
        "\n".join([header] + [",".join(map(repr, map(float, row))) + f",{label}" for row, label in zip(x, y)])
        + "\n"
    )
    for flags in (
        ["ingest", "bc.csv", "bc.h5", "--standardize"],
        ["train", "--data", "bc.h5", "--epochs", "5", "--run-dir", "run", "--progress", "none"],
    ):
        done, _ = launch(1, *flags, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*.h5"))[-1]
    figures = mpidist.evaluate(checkpoint, comm=MPI.COMM_SELF)
    with h5py.File(tmp_path / "bc.h5", "r") as handle:
        # (stored as read: predict standardises)
        test_x, test_y = (
            handle["test/x"][...],
            handle["test/y"][...],
        )
    (tmp_path / "new.csv").write_text(
        "\n".join(
            [header]
            + [",".join(map(repr, map(float, row))) + f",{label}" for row, label in zip(test_x, test_y)]
        )
        + "\n"
    )
    done, _ = launch(
        2, "predict", str(checkpoint), "--data", "new.csv", "--output", "preds.csv", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "preds.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["class", "p0", "p1"] and len(rows) == len(test_y)
    classes = np.array([int(row["class"]) for row in rows])
    assert (classes == test_y).mean() == figures["test_accuracy"]
    probabilities = np.array([[float(row["p0"]), float(row["p1"])] for row in rows])
    assert (
        np.allclose(probabilities.sum(axis=1), 1, atol=1e-5)
        and (probabilities.argmax(axis=1) == classes).all()
    )
    # .npy by its suffix: the classes; a row of the wrong width is refused with the counts
    done, _ = launch(
        1, "predict", str(checkpoint), "--data", "new.csv", "--output", "classes.npy", cwd=tmp_path
    )
    assert done.returncode == 0 and np.array_equal(np.load(tmp_path / "classes.npy"), classes), done.stderr
    (tmp_path / "narrow.csv").write_text("1,2,3\n4,5,6\n")  # (no header: the columns are taken in order)
    done, _ = launch(1, "predict", str(checkpoint), "--data", "narrow.csv", "--output", "x.csv", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "narrow.csv: 3 columns of numbers, but the model takes 30 features" in done.stderr, done.stderr
    # the same rows as pandas writes a subset (df.iloc[100:].to_csv): an unnamed index column first, numbering
    # rows from 100, no label; then by name in another order with the label; predicted as ingest would read
    # them
    names = [f"f{i}" for i in range(x.shape[1])]

    def table(name, columns, rows):
        lines = [",".join(columns)] + [",".join(map(str, row)) for row in rows]
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    table(
        "indexed.csv", [""] + names, [[100 + i, *map(repr, map(float, row))] for i, row in enumerate(test_x)]
    )
    order = names[::-1]
    table(
        "shuffled.csv",
        order + ["label"],
        [[*map(repr, map(float, row[::-1])), label] for row, label in zip(test_x, test_y)],
    )
    for name in ("indexed.csv", "shuffled.csv"):
        done, _ = launch(
            1, "predict", str(checkpoint), "--data", name, "--output", f"{name}.npy", cwd=tmp_path
        )
        assert done.returncode == 0 and np.array_equal(np.load(tmp_path / f"{name}.npy"), classes), (
            done.stderr
        )
    # columns that are not the model's, by name: refused, named (a feature missing; one the model does not
    # take)
    table(
        "missing.csv",
        names[:3] + names[4:],
        [list(map(repr, map(float, np.delete(row, 3)))) for row in test_x],
    )
    table(
        "extra.csv",
        names[:3] + ["id"] + names[3:] + ["label"],
        [
            [*map(repr, map(float, row[:3])), 7, *map(repr, map(float, row[3:])), label]
            for row, label in zip(test_x, test_y)
        ],
    )
    for name, why in (
        ("missing.csv", "lacks the model's features, by the names ingest stored: 'f3'"),
        ("extra.csv", "has columns the model does not take, by the names ingest stored: 'id'"),
    ):
        done, _ = launch(1, "predict", str(checkpoint), "--data", name, "--output", "x.npy", cwd=tmp_path)
        assert done.returncode == 2 and f"{name}: {why}" in done.stderr, done.stderr


# -- CSV cells a spreadsheet would run (issue 41, item 12) ---------------------------------------------------
FORMULAS = ["=1+2", "+SUM(A1:A9)", "-2+3", "@cmd", "\tx=1", "\r=2", "-1.5", "+3", "plain", "a=b"]


@pytest.mark.parametrize(
    "cell,written",
    [
        ("=1+2", "'=1+2"),
        ("+SUM(A1:A9)", "'+SUM(A1:A9)"),
        ("-2+3", "'-2+3"),
        ("@cmd", "'@cmd"),
        ("\tx=1", "'\tx=1"),
        ("\r=2", "'\r=2"),
        ("-", "'-"),
        ("--1", "'--1"),
        ("-1.5e3x", "'-1.5e3x"),
        ("-1.5", "-1.5"),
        ("+3", "+3"),
        ("-.5", "-.5"),
        ("-2E-3", "-2E-3"),
        ("plain", "plain"),
        ("a=b", "a=b"),
        ("'=quoted", "'=quoted"),
        ("", ""),
    ],
)
def test_a_csv_cell_that_begins_like_a_formula_is_made_text_and_a_negative_number_stays_a_number(
    cell, written
):
    from mpidist.tools.csv_table import spreadsheet_safe

    assert spreadsheet_safe(cell) == written


def test_predicts_csv_neutralises_class_names_a_spreadsheet_would_run(tmp_path):
    """Class names are the user's data: ``=1+2`` was written verbatim into the CSV's ``name`` column."""
    import csv

    from mpidist.runtime.text import printable

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype(np.float32)
    y = np.arange(200) % len(FORMULAS)
    write_dataset(
        tmp_path / "named.h5",
        "named",
        {"train": (x[:150], y[:150]), "test": (x[150:], y[150:])},
        len(FORMULAS),
        "test",
        class_names=sorted(FORMULAS),
    )
    done, _ = launch(
        1,
        "--data",
        str(tmp_path / "named.h5"),
        "--steps",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--run-dir",
        "",
        "--metrics",
        "",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (checkpoint,) = (tmp_path / "ck").glob("ckpt-*.h5")
    done, _ = launch(2, "predict", str(checkpoint), "--output", str(tmp_path / "p.csv"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "p.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 50
    names = sorted(FORMULAS)
    for row in rows:
        name = names[int(row["class"])]
        shown = printable(name)  # (a dataset's class names are read with control characters escaped)
        expected = shown if name in ("-1.5", "+3", "plain", "a=b", "\tx=1", "\r=2") else "'" + name
        assert row["name"] == expected
        assert not row["name"].startswith(("=", "+", "-", "@", "\t", "\r")) or name in ("-1.5", "+3")


# -- CSV files as users write them (issue 61, items 7 and 11) ------------------------------------------------
def csv_file(path, header, rows):
    """``path`` written as a CSV file: the ``header`` cells (none where empty), then ``rows``."""
    lines = [",".join(header)] if header else []
    path.write_text("\n".join(lines + [",".join(map(str, row)) for row in rows]) + "\n", encoding="utf-8")
    return path


def csv_run(directory, names=None, features=4, regression=False):
    """``(checkpoint, x, y)`` of a one-epoch run on a CSV of 60 rows headed by ``names`` and ``label`` (no
    header where ``names`` is None)."""
    from mpidist.tools.ingest import ingest

    rng = np.random.default_rng(5)
    x = rng.normal(size=(60, len(names) if names else features)).round(4)
    y = (x @ np.linspace(1, 2, x.shape[1])).round(4) if regression else (x[:, 0] > 0).astype(int)
    header = list(names) + ["label"] if names else None
    csv_file(directory / "train.csv", header, [[*row, label] for row, label in zip(x, y)])
    ingest(str(directory / "train.csv"), str(directory / "train.h5"), task="auto")
    result = mpidist.train(
        "mlp",
        str(directory / "train.h5"),
        epochs=1,
        batch_size=16,
        checkpoint_dir=str(directory / "ck"),
        **QUIET,
    )
    return result.checkpoints[-1], x, y


def predicted(checkpoint, path):
    """What ``predict`` gives for the CSV file ``path`` on this rank alone: classes, or values."""
    result = mpidist.predict(str(checkpoint), data=str(path), comm=MPI.COMM_SELF)
    return result.classes if result.task == "classification" else result.values


@pytest.fixture(scope="module")
def invisible_run(tmp_path_factory):
    """A run on a CSV whose header names hold characters that print as escapes (no line separator: a CSV
    line cannot hold one)."""
    from test_data import INVISIBLE_NAMES

    names = [name for name in INVISIBLE_NAMES if "\u2028" not in name]
    return csv_run(tmp_path_factory.mktemp("invisible"), names) + (names,)


def test_the_training_csvs_own_header_is_matched_whatever_characters_its_names_hold(invisible_run, tmp_path):
    """Issue 61, item 11: the stored names came back escaped (``'no\\xa0break'``), and predict refused the
    very header they were read from; in another order, the columns are taken by those names."""
    checkpoint, x, y, names = invisible_run
    expected = predicted(checkpoint, csv_file(tmp_path / "bare.csv", None, x))  # (no header: in order)
    own = csv_file(tmp_path / "own.csv", names + ["label"], [[*row, label] for row, label in zip(x, y)])
    assert np.array_equal(predicted(checkpoint, own), expected)
    order = np.random.default_rng(0).permutation(len(names))
    shuffled = csv_file(tmp_path / "shuffled.csv", [names[i] for i in order], x[:, order])
    assert np.array_equal(predicted(checkpoint, shuffled), expected)


def test_a_csv_of_one_row_is_predicted_and_one_of_none_refused_in_predicts_words(
    invisible_run, tmp_path, capsys
):
    """Issue 61, item 11: one row was refused with ingest's "a train and a test split need at least 2"."""
    checkpoint, x, y, names = invisible_run
    expected = predicted(checkpoint, csv_file(tmp_path / "all.csv", None, x))
    for name, header, row in (
        ("headed.csv", names + ["label"], [*x[3], y[3]]),
        ("features.csv", names, x[3]),
        ("bare.csv", None, [*x[3], y[3]]),
        ("bare-features.csv", None, x[3]),
    ):
        assert np.array_equal(predicted(checkpoint, csv_file(tmp_path / name, header, [row])), expected[3:4])
    for name, text, found in (
        ("header.csv", ",".join(names) + "\n", "0 rows of data after the header (line 1)"),
        ("empty.csv", "", "the file is empty"),
    ):
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(SystemExit) as stopped:
            predicted(checkpoint, tmp_path / name)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"{name}: {found}; predict needs at least 1\n" in err, err


@pytest.fixture(scope="module")
def regression_csv_run(tmp_path_factory):
    """A regression trained on a CSV without a header: no names stored, its labels any number."""
    return csv_run(tmp_path_factory.mktemp("bare"), regression=True)


def refusal(checkpoint, path, capsys):
    """The one message ``predict`` refuses the CSV file ``path`` with (exit code 2)."""
    with pytest.raises(SystemExit) as stopped:
        predicted(checkpoint, path)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("mpidist: error: ") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("run", ["invisible_run", "regression_csv_run"])
def test_a_csv_without_a_header_is_read_by_its_column_count_and_its_columns_never_shifted(
    run, request, tmp_path, capsys
):
    """Issue 61, item 7: pandas' ``to_csv(header=False)`` of the features wrote its index first; predict read
    it as the first feature and dropped the last feature as a label (12.5% where the header gave 100%), exit
    0, without a word.  Every reading of a file without a header now gives the predictions of its features
    and says what it left out, or is refused, saying why."""
    checkpoint, x, y = request.getfixturevalue(run)[:3]
    features = x.shape[1]
    expected = predicted(checkpoint, csv_file(tmp_path / "x.csv", None, x))
    capsys.readouterr()
    index, subset = np.arange(len(x)), 100 + np.arange(len(x))
    shuffled = np.random.default_rng(1).permutation(len(x))
    # (a regression's label is any number: its last feature could be one, so an index and the features are
    # as likely as the features and a label)
    either = ("refused", "one more than the model's") if run.startswith("regression") else None
    for name, columns, (outcome, text) in (
        ("features", [x], ("taken", "")),
        ("labelled", [x, y], ("taken", f"column {features + 1} (")),
        ("indexed", [index, x], either or ("taken", "column 1 (0 to 59) left out as pandas' index")),
        ("subset", [subset, x], either or ("taken", "column 1 (100 to 159) left out as pandas' index")),
        ("shuffled", [shuffled, x], either or ("taken", "column 1 (0 to 59) left out as pandas' index")),
        ("indexed-labelled", [index, x, y], ("taken", "(0 to 59) left out as pandas' index, and column ")),
        ("subset-labelled", [subset, x, y], ("taken", "(100 to 159) left out as pandas' index, and column ")),
        (
            "short",
            [x[:, :-1]],
            ("refused", f"{features - 1} columns of numbers, but the model takes {features}"),
        ),
        (
            "wide",
            [x, y, y],
            ("refused", f"{features + 2} columns of numbers, but the model takes {features}"),
        ),
    ):
        path = csv_file(tmp_path / f"{name}.csv", None, np.column_stack(columns))
        if outcome == "refused":
            assert f"{name}.csv: " in (err := refusal(checkpoint, path, capsys)) and text in err, (name, err)
            continue
        assert np.array_equal(predicted(checkpoint, path), expected), name
        out = capsys.readouterr().out
        assert (f"mpidist: note: {path}: " in out and text in out) if text else "note" not in out, (name, out)


@pytest.mark.parametrize("run", ["invisible_run", "regression_csv_run"])
def test_pandas_to_csv_with_its_header_and_index_gives_the_features_predictions_and_says_so(
    run, request, tmp_path, capsys
):
    """``df.to_csv()``: a header whose first name is empty above the index, then the features and the label;
    taken by the names ingest stored, or by count where it stored none (a CSV without a header trained it)."""
    checkpoint, x, y, *names = request.getfixturevalue(run)
    names = names[0] if names else [f"f{i}" for i in range(x.shape[1])]
    expected = predicted(checkpoint, csv_file(tmp_path / "x.csv", None, x))
    capsys.readouterr()
    rows = [[100 + i, *row, label] for i, (row, label) in enumerate(zip(x, y))]
    path = csv_file(tmp_path / "pandas.csv", [""] + list(names) + ["label"], rows)
    assert np.array_equal(predicted(checkpoint, path), expected)
    out = capsys.readouterr().out
    assert f"mpidist: note: {path}: column 1 (unnamed) dropped: an index" in out, out
    assert f"mpidist: note: {path}: column {x.shape[1] + 1} ('label'" in out, out


def test_a_csv_row_holds_a_samples_values_in_row_major_order_whatever_its_shape(tmp_path):
    """digits' samples are 8 x 8: 64 columns of a CSV file were refused as samples of shape (64,) by a model
    of samples of shape (8, 8)."""
    checkpoint = Path(__file__).parent / "checkpoints" / "format1-mlp8-digits.h5"
    x, _ = digits_test()
    np.save(tmp_path / "x.npy", x)
    expected = predicted(checkpoint, tmp_path / "x.npy")
    rows = x.reshape(len(x), -1)
    assert np.array_equal(predicted(checkpoint, csv_file(tmp_path / "x.csv", None, rows)), expected)


def test_samples_of_no_shape_or_a_negative_size_are_refused_in_one_line(tmp_path):
    """An HDF5 x of an empty dataspace has no shape; a .npy header may declare a negative size, which numpy
    reads without a word: both were tracebacks."""
    from mpidist.runtime.errors import UsageError
    from mpidist.tools.prediction_inputs import reader_for

    with h5py.File(tmp_path / "null.h5", "w") as handle:
        handle.create_dataset("x", data=h5py.Empty("f4"))
    with pytest.raises(UsageError, match="x holds no array"):
        reader_for(str(tmp_path / "null.h5"), "test")
    np.save(tmp_path / "neg.npy", np.zeros((5, 8, 8), np.float32))
    raw = (tmp_path / "neg.npy").read_bytes()
    (tmp_path / "neg.npy").write_bytes(raw.replace(b"(5, 8, 8)", b"(-5, 8, 8)", 1))
    with pytest.raises(UsageError, match=r"x has shape \(-5, 8, 8\), with a negative size"):
        reader_for(str(tmp_path / "neg.npy"), "test")


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_an_npz_members_rows_are_read_a_block_at_a_time_in_any_order(tmp_path, save):
    """Each block once decompressed, on from the last (a compressed .npz was decompressed whole per block)."""
    from mpidist.tools.npy_rows import MemberRows
    from mpidist.tools.prediction_inputs import NumpyFile

    x = np.arange(1000 * 6, dtype=">f4").reshape(1000, 2, 3)  # (big-endian: read as stored)
    save(tmp_path / "s.npz", x=x, y=np.zeros(1000))
    samples = NumpyFile(tmp_path / "s.npz")
    assert isinstance(samples.member, MemberRows)
    blocks = [(0, 300), (300, 301), (301, 999), (999, 1000), (100, 250), (0, 0)]
    for lo, hi in blocks:  # (in order, to the end, then back to an earlier block)
        np.testing.assert_array_equal(samples.read(lo, hi, np.float32), x[lo:hi])
    assert samples.member.stream is not None  # (open after an earlier block; closed after the last row)
    samples.read(990, 1000, np.float32)
    assert samples.member.stream is None
    # (a member cut short is refused in words)
    raw = (tmp_path / "s.npz").read_bytes()
    np.savez(tmp_path / "cut.npz", x=x)
    cut = MemberRows(tmp_path / "cut.npz", "x.npy", x.dtype, (2000, 2, 3))
    with pytest.raises(ValueError, match="x.npy ends before row 1,500 of 2,000: cut short"):
        cut.read(1000, 1500)
    assert raw == (tmp_path / "s.npz").read_bytes()
    fortran = NumpyFile(_saved_fortran(tmp_path))
    assert fortran.member is None
    np.testing.assert_array_equal(fortran.read(2, 5, np.float32), np.asfortranarray(x)[2:5])


def _saved_fortran(tmp_path):
    x = np.asfortranarray(np.arange(1000 * 6, dtype=">f4").reshape(1000, 2, 3))
    np.savez(tmp_path / "f.npz", x=x)
    return tmp_path / "f.npz"
