"""Validation splits, --keep-best, --early-stop, and the figures of each step."""

import filecmp
import json
import os
import re

import h5py
import numpy as np
import pytest

import mpidist
from mpidist import data
from mpidist.loop.evaluations import BestSoFar
from mpidist.nn.schedules import LearningRate
from mpidist.runtime.errors import UsageError
from mpidist.settings.config import Settings


def digits_info():
    return data.inspect(data.resolve("digits"))


def every_row(selection):
    """The file's rows a selection of a split picks, in order, as an array."""
    return selection[np.arange(len(selection))]


def events(path, kind):
    return [e for e in map(json.loads, open(path)) if e["event"] == kind]


# -- carving a validation split ----------------------------------------------------------------------------
def test_a_carved_validation_split_is_disjoint_reproducible_and_sized_by_the_fraction():
    info = digits_info()
    n = info.sizes["train"]
    carved = data.carve_validation(info, 0.25, seed=3)
    train, val = (every_row(carved.rows_of(split)[1]) for split in ("train", "val"))
    assert carved.sizes["val"] == len(val) == int(np.ceil(0.25 * n)) and carved.sizes["train"] == len(train)
    assert np.array_equal(np.union1d(train, val), np.arange(n)) and not np.intersect1d(train, val).size
    assert np.all(np.diff(val) > 0)  # file order
    again = every_row(data.carve_validation(info, 0.25, seed=3).rows_of("val")[1])
    other = every_row(data.carve_validation(info, 0.25, seed=4).rows_of("val")[1])
    assert np.array_equal(again, val) and not np.array_equal(other, val)
    assert info.sizes["train"] == n  # (a copy: the original is untouched)


@pytest.mark.parametrize("n", [2, 5, 4095, 4097, 10_000, 12_289])
def test_the_rows_held_out_and_kept_are_any_of_their_rows_alone_as_a_table_of_them_holds_them(n):
    """A carved split holds no table: the rows at any positions, and how many of its rows come before any of
    the file's rows, are computed alone, and agree with the whole selection made one row at a time."""
    from mpidist.data.selection import Carved, Strided

    picks = np.random.default_rng(n)
    for held in sorted({1, 7, n // 3, n // 2, n - 1} & set(range(1, n))):
        selections = [Carved(n, held, seed=9, held_out=out) for out in (True, False)]
        tables = [every_row(selection) for selection in selections]
        assert [len(t) for t in tables] == [held, n - held]
        assert np.array_equal(np.sort(np.concatenate(tables)), np.arange(n))  # disjoint, every row once
        for selection, table in zip(selections, tables):
            assert (np.diff(table) > 0).all()  # file order
            some = np.sort(picks.choice(len(table), min(len(table), 9), replace=False))
            np.testing.assert_array_equal(selection[some], table[some])
            rows = np.arange(-1, n + 2)
            np.testing.assert_array_equal(selection.below(rows), np.searchsorted(table, rows))
            strided = Strided(len(table) // 3 or 1, 3, selection)  # (--eval-samples of a carved split)
            np.testing.assert_array_equal(every_row(strided), table[::3][: len(strided)])
            np.testing.assert_array_equal(strided.below(rows), np.searchsorted(every_row(strided), rows))


def test_the_rows_held_out_are_spread_over_the_split_and_drawn_anew_by_each_seed():
    """Each block of 4096 rows holds out its share of the rows (a file sorted by label keeps each class's
    share of the validation split); which rows, the seed draws: within a block, any row as likely as any."""
    from mpidist.data.selection import DRAW_ROWS, Carved

    n, held = 40 * DRAW_ROWS + 100, 4 * DRAW_ROWS + 10  # about a tenth
    rows = every_row(Carved(n, held, seed=1, held_out=True))
    share = held * DRAW_ROWS // n  # (409: a block's share)
    per_block = np.bincount(rows // DRAW_ROWS, minlength=41)
    assert per_block[:40].min() >= share and per_block[:40].max() <= share + 1
    classes = np.arange(n) * 5 // n  # (a file sorted into 5 classes: each its share, but for the two blocks
    assert np.abs(np.bincount(classes[rows]) - held / 5).max() <= 2 * share + 2  # across its edges)
    hits = np.zeros(n)
    for seed in range(60):
        hits[every_row(Carved(n, held, seed=seed, held_out=True))] += 1
    within = hits[: 40 * DRAW_ROWS].reshape(40, DRAW_ROWS).sum(axis=0) / 60  # (each place of a block)
    assert abs(within.mean() - 40 * held / n) < 0.1 and within.std() < 0.5, (within.mean(), within.std())
    assert not np.array_equal(rows, every_row(Carved(n, held, seed=2, held_out=True)))


def test_a_carved_shard_reads_exactly_its_rows():
    info = data.carve_validation(digits_info(), 0.2, seed=0)
    rows = every_row(info.rows_of("val")[1])
    with h5py.File(info.path) as handle:
        expected_x, expected_y = handle["train/x"][()], handle["train/y"][()]
    for worker in range(3):
        shard = data.Shard(info, "val", worker, 3, info.sample_shape, np.float64)
        mine = rows[worker::3]
        np.testing.assert_array_equal(shard.x, expected_x[mine].astype(np.float64))
        np.testing.assert_array_equal(shard.y, expected_y[mine])
    # blocks smaller than the split: the same rows
    with h5py.File(info.path) as handle:
        np.testing.assert_array_equal(
            data._read_rows(handle["train/x"], rows, block_bytes=1000), expected_x[rows]
        )


def test_fractions_that_leave_a_split_empty_and_a_file_with_its_own_val_split_are_refused(tmp_path):
    info = digits_info()
    with pytest.raises(UsageError, match="leaves no training samples"):
        data.carve_validation(info, 0.99999999, 0)
    assert data.carve_validation(info, 1e-9, 0).sizes["val"] == 1  # (any fraction above 0 holds a sample out)
    path = tmp_path / "with-val.h5"
    with_val_split(path)
    with pytest.raises(UsageError, match="has a val/ split of its own"):
        data.carve_validation(data.inspect(path), 0.1, 0)


def with_val_split(path, val_rows=100):
    """The digits file with its last ``val_rows`` training rows moved into a val/ split."""
    with h5py.File(data.resolve("digits")) as source, h5py.File(path, "w") as out:
        out.attrs.update(dict(source.attrs))
        for split in ("train", "test"):
            for key in ("x", "y"):
                array = source[f"{split}/{key}"][()]
                out[f"{split}/{key}"] = array[:-val_rows] if split == "train" else array
        for key in ("x", "y"):
            out[f"val/{key}"] = source[f"train/{key}"][-val_rows:]


def test_a_files_val_split_is_checked_and_used(tmp_path):
    path = tmp_path / "with-val.h5"
    with_val_split(path)
    info = data.inspect(path)
    assert info.sizes["val"] == 100
    metrics = tmp_path / "m.jsonl"
    result = mpidist.train(data=str(path), epochs=2, progress="none", metrics=str(metrics))
    evals = events(metrics, "eval")
    assert [sorted(k for k in e if k.endswith("_loss")) for e in evals] == [
        ["val_loss"],
        ["val_loss"],
        ["test_loss"],
    ]
    assert result.figures["test_accuracy"] > 0.5 and "val_accuracy" in result.figures
    with h5py.File(path, "a") as handle:  # a val/ split is checked like the others
        del handle["val/y"]
        handle["val/y"] = np.zeros(99, dtype=np.int64)
    with pytest.raises(UsageError, match="val/x has 100 samples but val/y has 99"):
        data.inspect(path)


# -- training with a validation split ----------------------------------------------------------------------
def test_validation_runs_every_epoch_and_the_test_split_once_at_the_end(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = mpidist.train(data="digits", epochs=3, val_fraction=0.2, progress="none", metrics=str(metrics))
    evals = events(metrics, "eval")
    assert ["val_accuracy" in e for e in evals] == [True, True, True, False]
    assert "test_accuracy" in evals[-1] and evals[-1]["step"] == result.figures["steps"]
    start = events(metrics, "start")[0]
    assert start["steps_per_epoch"] == (1438 - 288) // 64  # the training split lost the carved rows


def test_keep_best_keeps_the_checkpoint_of_the_best_validation_beyond_pruning(tmp_path):
    metrics, directory = tmp_path / "m.jsonl", tmp_path / "ckpt"
    result = mpidist.train(
        data="digits",
        epochs=4,
        val_fraction=0.2,
        keep_best="val_loss",
        keep=1,
        checkpoint_dir=str(directory),
        checkpoint_every=5,
        checkpoint_wait=True,
        progress="none",
        metrics=str(metrics),
        dtype="float64",
    )
    losses = [(e["val_loss"], e["step"]) for e in events(metrics, "eval") if "val_loss" in e]
    best_loss, best_step = min(losses)
    best = result.figures["best"]
    assert best["value"] == best_loss and best["step"] == best_step
    kept = mpidist.store.checkpoint.load(best["path"])
    assert kept.step == best_step
    names = sorted(p.name for p in directory.glob("*.h5"))
    assert len(names) == 2 and names[0].startswith("best-")  # the newest (--keep 1) and the best
    # the kept state is the one that was validated: evaluating it on the validation rows gives the same loss
    assert events(metrics, "best")[-1]["step"] == best_step


def test_keep_best_of_a_run_resumed_at_its_end_keeps_the_checkpoint_it_resumed_from(tmp_path):
    """A run resumed where it ended writes no checkpoint of its own: its best (its one validation) is the
    checkpoint it resumed from, kept by its own name, where an assertion traceback ended it."""
    directory = tmp_path / "ckpt"
    quiet = dict(
        data="digits", steps=5, checkpoint_dir=str(directory), progress="none", metrics="", run_dir=""
    )
    mpidist.train(**quiet)
    resumed = mpidist.train(**quiet, resume="auto", val_fraction=0.2, keep_best="val_loss")
    best = resumed.figures["best"]
    assert best["step"] == 5 and best["path"].startswith(str(directory / "best-"))
    (written,) = directory.glob("ckpt-*.h5")
    assert os.path.samefile(best["path"], written) or filecmp.cmp(best["path"], written, shallow=False)


def test_early_stop_ends_the_run_when_the_validation_figure_stops_improving(tmp_path):
    metrics = tmp_path / "m.jsonl"
    # a learning rate too small to change any prediction: the validation accuracy never improves
    result = mpidist.train(
        data="digits",
        epochs=10,
        lr=1e-12,
        val_fraction=0.2,
        keep_best="val_accuracy",
        checkpoint_dir=str(tmp_path / "c"),
        early_stop=2,
        progress="none",
        metrics=str(metrics),
    )
    assert result.status == "done" and result.figures.get("stopped_early")
    val_evals = [e for e in events(metrics, "eval") if "val_accuracy" in e]
    at_epoch_ends = [e for e in val_evals if e["step"] % 17 == 0]
    assert len(at_epoch_ends) == 3  # the first sets the mark; two more without a gain stop the run
    assert val_evals[-1]["step"] == result.figures["steps"]  # and the state it ends with is validated too
    assert result.figures["epochs"] < 10


def test_best_so_far_knows_which_way_is_better():
    lower, higher = BestSoFar("val_loss"), BestSoFar("val_accuracy")
    assert [lower.offer(v, s) for s, v in enumerate([2.0, 1.0, 1.0, 3.0, 0.5])] == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert (lower.value, lower.step) == (0.5, 4)
    assert [higher.offer(v, s) for s, v in enumerate([0.5, float("nan"), 0.4, 0.6])] == [
        True,
        False,
        False,
        True,
    ]


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            {"keep_best": "val_loss", "run_dir": ""},
            "--keep-best val_loss keeps a checkpoint: it needs --checkpoint-dir",
        ),
        ({"early_stop": 2}, "--early-stop judge"),
        (
            {"keep_best": "val_mse", "checkpoint_dir": "c", "val_fraction": 0.1},
            "validated with val_loss, val_accuracy",
        ),
        ({"val_fraction": 1.0}, "--val-fraction must be a fraction in \\[0, 1\\)"),
        (
            {"keep_best": "val_loss", "checkpoint_dir": "c", "val_fraction": 0.1, "eval_every": 0},
            "--eval-every 0 has none",
        ),
    ],
)
def test_validation_settings_that_cannot_work_are_refused(flags, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        mpidist.train(data="digits", epochs=1, progress="none", metrics="", **flags)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_an_early_stopping_watching_a_validation_the_run_lacks_is_refused(tmp_path, monkeypatch, capsys):
    """It would never fire: the run trained on to its end as if it were not there."""
    monkeypatch.chdir(tmp_path)
    stopping = mpidist.EarlyStopping(monitor="val_loss")
    with pytest.raises(SystemExit) as exit_info:
        mpidist.train(data="digits", epochs=1, progress="none", metrics="", callbacks=[stopping])
    assert exit_info.value.code == 2
    assert "EarlyStopping(monitor='val_loss') watches a validation split" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # (no validation before the end: it could not stop early)
        mpidist.train(
            data="digits", epochs=1, progress="none", metrics="", val_fraction=0.1, eval_every=0,
            callbacks=[stopping],
        )  # fmt: skip
    assert exit_info.value.code == 2
    assert "eval_every=0 (--eval-every 0) has none before its end" in capsys.readouterr().err
    result = mpidist.train(
        data="digits", epochs=1, progress="none", metrics="", val_fraction=0.1, callbacks=[stopping]
    )
    assert result is not None


def test_a_schedule_that_would_end_above_its_learning_rate_is_refused():
    """--lr-min above --lr made cosine and linear schedules rise (accepted without a word)."""
    with pytest.raises(UsageError, match="--lr-min 0.1 is above --lr 0.01: the cosine schedule"):
        Settings(lr=0.01, lr_min=0.1, lr_schedule="cosine").validate(1)
    Settings(lr=0.01, lr_min=0.01, lr_schedule="linear").validate(1)
    Settings(lr=0.01, lr_min=0.1, lr_schedule="constant").validate(1)  # (no end to reach: unused)


def test_keep_best_needs_a_strategy_whose_ranks_take_each_step_together():
    settings = Settings(strategy="ps-async", ps=1, keep_best="val_loss", checkpoint_dir="c")
    with pytest.raises(UsageError, match="not with --strategy ps-async"):
        settings.validate(3)


# -- what each step reports --------------------------------------------------------------------------------
def test_step_events_carry_the_learning_rate_the_training_accuracy_and_clipped_steps(tmp_path):
    metrics = tmp_path / "m.jsonl"
    mpidist.train(
        data="digits",
        epochs=2,
        lr=0.01,
        lr_schedule="cosine",
        warmup_steps=5,
        clip_norm=0.5,
        log_every=4,
        progress="none",
        metrics=str(metrics),
    )
    steps = events(metrics, "step")
    rate = LearningRate(
        0.01, "cosine", total_steps=2 * (1438 // 64), steps_per_epoch=1438 // 64, warmup_steps=5
    )
    assert [e["lr"] for e in steps] == pytest.approx([rate(e["step"] - 1) for e in steps])
    assert all(0 <= e["train_accuracy"] <= 1 for e in steps) and all(0 <= e["clipped"] <= 4 for e in steps)
    done = events(metrics, "done")[0]
    assert done["clipped_steps"] >= sum(e["clipped"] for e in steps) > 0


def test_a_regression_run_logs_its_training_error_and_no_accuracy(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    arrays = mpidist.ArrayData(train=(x[:160], y[:160]), test=(x[160:], y[160:]), num_classes=0)
    metrics = tmp_path / "m.jsonl"
    mpidist.train(
        model="mlp:16",
        data=arrays,
        epochs=2,
        batch_size=16,
        log_every=5,
        progress="none",
        metrics=str(metrics),
    )
    text = metrics.read_text()
    assert "accuracy" not in text
    assert all(e["train_mae"] >= 0 for e in events(metrics, "step"))


def test_a_resumed_run_keeps_its_validation_rows_and_its_best_so_far(tmp_path, monkeypatch):
    seeds, carve = [], data.carve_validation
    monkeypatch.setattr(
        data,
        "carve_validation",
        lambda info, fraction, seed: seeds.append(seed) or carve(info, fraction, seed),
    )
    directory, metrics = tmp_path / "c", tmp_path / "m.jsonl"
    common = dict(
        data="digits",
        val_fraction=0.2,
        keep_best="val_loss",
        checkpoint_dir=str(directory),
        progress="none",
        metrics=str(metrics),
    )
    mpidist.train(epochs=2, seed=5, **common)
    first = mpidist.store.checkpoint.load(next(directory.glob("best-*.h5")))
    assert first.best["figure"] == "val_loss" and first.best["step"] == first.step
    # resumed with another --seed on the command line and a rate that makes it worse: the rows stay the
    # checkpoint's, and the best file is not replaced by a worse state
    mpidist.train(epochs=3, seed=0, lr=5.0, resume="auto", **common)
    bests = events(metrics, "best")
    assert all(later["value"] < earlier["value"] for earlier, later in zip(bests, bests[1:]))
    kept = mpidist.store.checkpoint.load(next(directory.glob("best-*.h5")))
    assert kept.best["value"] <= first.best["value"]
    assert seeds and set(seeds) == {5}  # the rows held out are the first run's, whatever --seed says now


def test_predict_finds_the_carved_validation_split_again(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = mpidist.train(
        data="digits",
        epochs=2,
        val_fraction=0.3,
        seed=5,
        checkpoint_dir=str(tmp_path / "c"),
        progress="none",
        metrics=str(metrics),
    )
    last_val = [e for e in events(metrics, "eval") if "val_accuracy" in e][-1]
    predictions = mpidist.predict(result.checkpoints[-1], split="val")
    assert predictions.samples == int(np.ceil(0.3 * 1438))
    assert predictions.figures["accuracy"] == last_val["val_accuracy"]
