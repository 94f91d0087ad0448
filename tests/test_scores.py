"""Evaluation figures that fit the task: the pure sums and figures, their reduction over ranks, and runs.

The unit tests use tiny hand-made outputs whose figures are worked out by
hand.  The ``mpi`` tests run under ``mpiexec -n N python -m pytest -m mpi
--with-mpi`` at any N of 2 or more.
"""

import io
import json
import math

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import nn
from mpidist.loop.callbacks import EarlyStopping
from mpidist.nn import scores
from mpidist.parallel import AllreduceStrategy
from mpidist.runtime.cluster import build_cluster
from mpidist.runtime.errors import UsageError
from mpidist.tools.cli import eval_text

# 3 classes, 6 samples.  Predictions (highest logit) 0 1 1 1 2 0 for labels 0 0 1 1 2 2:
# confusion [[1, 1, 0], [0, 2, 0], [1, 0, 1]]; sample 1's label is its second choice, sample 5's its last.
LOGITS = np.array([[3, 1, 0], [2, 3, 0], [0, 2, 1], [1, 5, 0], [0, 1, 4], [4, 1, 0]], dtype=np.float64)
LABELS = np.array([0, 0, 1, 1, 2, 2])


def assert_same(a, b, rel=1e-12):
    """Figures ``a`` equal ``b`` to ``rel``, nested lists and dicts included."""
    if isinstance(a, dict):
        assert set(a) == set(b)
        for name in a:
            assert_same(a[name], b[name], rel)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, rel)
    else:
        assert a == pytest.approx(b, rel=rel, nan_ok=True)


def classify(logits, labels, losses):
    """Figures of ``logits`` added batch by batch: ``losses`` the batches' mean losses, one per batch of 2."""
    scoring = scores.Classification(logits.shape[1])
    sums = scoring.zeros()
    for i, loss in enumerate(losses):
        scoring.add(sums, logits[2 * i : 2 * i + 2], labels[2 * i : 2 * i + 2], loss)
    return scoring.figures(sums)


def test_classification_figures_are_those_worked_out_by_hand():
    figures = classify(LOGITS, LABELS, [1.0, 1.0, 2.5])
    assert figures["samples"] == 6
    assert figures["loss"] == pytest.approx((2 * 1.0 + 2 * 1.0 + 2 * 2.5) / 6)
    assert figures["accuracy"] == pytest.approx(4 / 6)
    assert figures["top2_accuracy"] == pytest.approx(5 / 6)  # k = 2 for 3 classes
    assert "top5_accuracy" not in figures
    assert figures["confusion"] == [[1, 1, 0], [0, 2, 0], [1, 0, 1]]
    per_class = figures["per_class"]
    assert per_class["support"] == [2, 2, 2]
    assert per_class["precision"] == pytest.approx([1 / 2, 2 / 3, 1 / 1])  # correct / predicted (2, 3, 1)
    assert per_class["recall"] == pytest.approx([1 / 2, 2 / 2, 1 / 2])  # correct / support
    assert per_class["f1"] == pytest.approx([1 / 2, 4 / 5, 2 / 3])  # 2 P R / (P + R)


def test_a_class_never_predicted_or_never_seen_scores_zero_as_sklearn_with_zero_division_0():
    scoring = scores.Classification(3)
    # labels 0 0 2, all predicted 0: class 1 has neither support nor predictions, class 2 is never predicted
    logits = np.array([[5, 0, 0], [5, 0, 0], [5, 0, 1]], dtype=np.float64)
    figures = scoring.figures(scoring.add(scoring.zeros(), logits, np.array([0, 0, 2]), 0.0))
    per_class = figures["per_class"]
    assert per_class["precision"] == pytest.approx([2 / 3, 0.0, 0.0])
    assert per_class["recall"] == pytest.approx([1.0, 0.0, 0.0])
    assert per_class["f1"] == pytest.approx([4 / 5, 0.0, 0.0])
    assert per_class["support"] == [2, 0, 1]
    assert figures["top2_accuracy"] == 1.0  # class 2's logit is second for its sample


def test_top_k_is_named_after_its_k_and_absent_for_two_classes():
    assert [scores.top_k(k) for k in (2, 3, 4, 5, 6, 10, 1000)] == [0, 2, 3, 4, 5, 5, 5]
    two = scores.Classification(2)
    figures = two.figures(two.add(two.zeros(), np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([0, 0]), 0.3))
    assert set(scores.headline(figures)) == {"test_loss", "test_accuracy"}
    ten = scores.Classification(10)
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(50, 10)), rng.integers(0, 10, 50)
    figures = ten.figures(ten.add(ten.zeros(), logits, labels, 0.0))
    top5 = (np.argsort(-logits, axis=1)[:, :5] == labels[:, None]).any(axis=1).mean()
    assert figures["top5_accuracy"] == pytest.approx(top5)


def test_above_the_confusion_limit_only_per_class_counts_are_summed_with_the_same_figures(monkeypatch):
    full = classify(LOGITS, LABELS, [1.0, 1.0, 2.5])
    monkeypatch.setattr(scores, "CONFUSION_LIMIT", 2)
    scoring = scores.Classification(3)
    assert scoring.size == 3 + 3 * 3 and not scoring.full_confusion
    counted = classify(LOGITS, LABELS, [1.0, 1.0, 2.5])
    assert "confusion" not in counted
    assert counted == {name: value for name, value in full.items() if name != "confusion"}
    monkeypatch.undo()
    many = scores.Classification(scores.CONFUSION_LIMIT + 50)  # 150 classes: 3 x 150 sums, not 150**2
    assert many.size == 3 + 3 * 150
    rng = np.random.default_rng(1)
    logits, labels = rng.normal(size=(400, 150)), rng.integers(0, 150, 400)
    figures = many.figures(many.add(many.zeros(), logits, labels, 0.0))
    predicted = logits.argmax(axis=1)
    assert figures["accuracy"] == pytest.approx((predicted == labels).mean())
    assert figures["per_class"]["support"] == np.bincount(labels, minlength=150).tolist()
    hits = np.bincount(labels[predicted == labels], minlength=150)
    recall = np.divide(hits, np.bincount(labels, minlength=150), out=np.zeros(150), where=hits > 0)
    assert figures["per_class"]["recall"] == pytest.approx(recall.tolist())


def test_regression_figures_are_those_worked_out_by_hand():
    # target 1: errors 0 0 0 1 (SSE 1, SAE 1), mean 2.5, SST 5: R^2 0.8
    # target 2: errors .5 -1 .5 -1 (SSE 2.5, SAE 3), mean 1, SST 4: R^2 0.375
    targets = np.array([[1, 0], [2, 2], [3, 0], [4, 2]], dtype=np.float64)
    outputs = np.array([[1, 0.5], [2, 1], [3, 0.5], [5, 1]], dtype=np.float64)
    scoring = scores.Regression(2)
    sums = scoring.add(scoring.zeros(), outputs[:1], targets[:1], 0.1)
    sums = scoring.add(sums, outputs[1:], targets[1:], 0.5)
    figures = scoring.figures(sums)
    assert figures == pytest.approx(
        {"loss": (0.1 + 3 * 0.5) / 4, "mse": 3.5 / 8, "mae": 4 / 8, "r2": (0.8 + 0.375) / 2, "samples": 4}
    )
    assert "accuracy" not in figures and "per_class" not in figures


def test_r2_of_a_target_with_no_variance_is_one_if_exact_else_zero_as_sklearn():
    scoring = scores.Regression(1)
    constant = np.full((7, 1), 0.1)  # (0.1 is not exact in binary: SST rounds to about 0, not 0)
    assert scoring.figures(scoring.add(scoring.zeros(), constant.copy(), constant, 0.0))["r2"] == 1.0
    assert scoring.figures(scoring.add(scoring.zeros(), constant + 0.5, constant, 0.0))["r2"] == 0.0
    # a large offset with a real spread is not taken for a constant
    y = 1e4 + np.arange(10.0).reshape(10, 1)
    assert scoring.figures(scoring.add(scoring.zeros(), y + 1.0, y, 0.0))["r2"] == pytest.approx(
        1 - 10 / 82.5
    )
    # nor a mean a million times the deviation, summed over many batches (the review's case: it read 0.0)
    rng = np.random.default_rng(0)
    y = 1e6 + rng.normal(size=(2000, 1))
    pred = y + 0.1 * rng.normal(size=(2000, 1))
    sums = scoring.zeros()
    for lo in range(0, 2000, 50):
        sums = scoring.add(sums, pred[lo : lo + 50], y[lo : lo + 50], 0.0)
    expected = 1 - ((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    assert scoring.figures(sums)["r2"] == pytest.approx(expected, abs=1e-3)


def test_sums_add_up_so_shards_give_the_figures_of_the_whole():
    rng = np.random.default_rng(2)
    logits, labels = rng.normal(size=(37, 7)), rng.integers(0, 7, 37)
    scoring = scores.Classification(7)
    whole = scoring.add(scoring.zeros(), logits, labels, 0.25)
    parts = [
        scoring.add(scoring.zeros(), logits[lo:hi], labels[lo:hi], 0.25)
        for lo, hi in ((0, 3), (3, 30), (30, 37))
    ]
    np.testing.assert_allclose(sum(parts), whole)
    assert_same(scoring.figures(sum(parts)), scoring.figures(whole))


def test_no_samples_give_nan_figures_and_zero_samples():
    for scoring in (scores.Classification(10), scores.Regression(3)):
        figures = scoring.figures(scoring.zeros())
        assert figures["samples"] == 0
        assert all(math.isnan(value) for name, value in figures.items() if name != "samples")


def test_reports_name_the_task_figures_and_the_classes():
    figures = classify(LOGITS, LABELS, [1.0, 1.0, 2.5])
    assert list(scores.headline(figures)) == ["test_loss", "test_accuracy", "test_top2_accuracy"]
    report = scores.report(figures, class_names=["cat", "dog", "emu"])
    assert report["test_per_class"][1] == {
        "class": 1,
        "name": "dog",
        "precision": pytest.approx(2 / 3),
        "recall": 1.0,
        "f1": pytest.approx(0.8),
        "support": 2,
    }
    assert report["test_confusion"] == figures["confusion"]
    assert "name" not in scores.report(figures)["test_per_class"][0]
    regression = scores.Regression(1)
    figures = regression.figures(regression.add(regression.zeros(), np.ones((2, 1)), np.zeros((2, 1)), 1.0))
    assert set(scores.report(figures)) == {"test_loss", "test_mse", "test_mae", "test_r2"}
    assert [label for label, _ in scores.summary_rows(figures)] == [
        "test loss",
        "test MSE",
        "test MAE",
        "test R^2",
    ]
    assert "accuracy" not in scores.progress_text(figures)
    # errors on the targets' scale: 4 significant digits, trailing zeros kept, never a trailing point
    assert [scores.digits4(v) for v in (3581.0, 0.12, 12345.0, 1.0)] == [
        "3581",
        "0.1200",
        "1.234e+04",
        "1.000",
    ]
    big = dict(figures, loss=3581.0, mse=3581.0, mae=47.0)
    assert "val loss 3581  val MSE 3581  MAE 47.00" in scores.progress_text(big, "val")
    assert dict(scores.summary_rows(big))["test loss"] == "3581"


def test_eval_prints_the_figures_of_the_task():
    figures = {
        **scores.report(classify(LOGITS, LABELS, [1.0, 1.0, 2.5]), ["cat", "dog", "emu"]),
        "samples": 6,
        "step": 9,
        "model": "mlp",
        "dataset": "pets",
    }
    text = eval_text("ck.h5", figures)
    assert "test accuracy 66.67%, top-2 accuracy 83.33% over 6 samples" in text
    assert "  dog       0.6667  1.0000  0.8000        2" in text
    regression = {
        "test_loss": 0.5,
        "test_mse": 0.5,
        "test_mae": 0.25,
        "test_r2": 0.9,
        "samples": 4,
        "step": 9,
        "model": "linear",
        "dataset": "prices",
    }
    text = eval_text("ck.h5", regression)
    assert (
        "test loss 0.5000, test MSE 0.5000, MAE 0.2500, R^2 0.9000 over 4 samples" in text
        and "accuracy" not in text
    )


def test_early_stopping_says_what_to_monitor_where_the_figure_is_missing():
    stopper = EarlyStopping()
    with pytest.raises(UsageError, match="'test_loss' with mode='min'"):
        stopper.on_eval(
            {"step": 5, "epoch": 1, "test_loss": 1.0, "test_mse": 1.0, "test_mae": 0.5, "test_r2": 0.1}
        )
    with pytest.raises(ValueError):
        EarlyStopping(mode="lower")
    for patience in (-1, 2.5, float("nan"), "3", None, True):  # (2.5 and "3" were taken as 2 and 3)
        with pytest.raises(ValueError, match="EarlyStopping: patience"):
            EarlyStopping(patience=patience)
    for min_delta in (-0.1, float("nan"), float("inf"), "0.1"):  # (a NaN counted no gain: a stop at once)
        with pytest.raises(ValueError, match="EarlyStopping: min_delta"):
            EarlyStopping(min_delta=min_delta)
    assert EarlyStopping(patience=np.int64(0), min_delta=np.float32(0.5)).patience == 0
    assert EarlyStopping(monitor="test_loss").mode == "min" and EarlyStopping(monitor="test_r2").mode == "max"
    stopper = EarlyStopping(patience=2, monitor="test_mse", mode="min")
    for step, mse in enumerate([1.0, 0.5, 0.6, 0.5, 0.7]):
        stopper.on_eval({"step": step, "test_mse": mse})
    assert stopper.best == 0.5 and stopper.stop_training and stopper.stopped_at == 3


# -- over ranks ------------------------------------------------------------------------------------------


def uneven_part(n, rank, size):
    """Rank ``rank``'s part of ``n`` samples, rank r holding about r + 1 shares (some may hold none)."""
    bounds = np.round(np.cumsum([0] + [r + 1 for r in range(size)]) * n / (size * (size + 1) / 2)).astype(int)
    return slice(bounds[rank], bounds[rank + 1])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("classes", [4, 0])
def test_figures_summed_over_ranks_equal_one_process_on_the_whole_split(classes):
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(41, 5))
    y = rng.integers(0, classes, 41) if classes else rng.normal(size=(41, 2))
    model = nn.Sequential(
        [nn.Dense(8), nn.Tanh(), nn.Dense(classes or 2, init="glorot")], (5,), xp=np, dtype=np.float64
    )
    cluster = build_cluster(world)
    strategy = AllreduceStrategy(model, nn.loss_for(classes, np), None, cluster, exchange="mpi")
    strategy.initialize()
    part = uneven_part(41, rank, size)
    summed = strategy.evaluate([(x[part], y[part])])  # one batch per rank, of rank-dependent size
    loss = nn.loss_for(classes, np)
    out = model.forward(x)
    scoring = scores.scoring(classes > 0, model.output_shape)
    alone = scoring.figures(scoring.add(scoring.zeros(), out, y, float(loss.forward(out, y))))
    assert_same(summed, alone)
    assert summed["samples"] == 41
    if classes:
        assert sum(summed["per_class"]["support"]) == 41 and summed["confusion"] == alone["confusion"]
    else:
        assert summed["mse"] == pytest.approx(summed["loss"], rel=1e-12)  # the MSE loss is the MSE
    strategy.free()
    cluster.free()


# -- runs ------------------------------------------------------------------------------------------------


def regression_data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(160, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 2)) + 0.1 * rng.normal(size=(160, 2))).astype(np.float32)
    return mpidist.ArrayData(train=(x[:120], y[:120]), test=(x[120:], y[120:]), name="linear-targets")


def classification_data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(150, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    return mpidist.ArrayData(train=(x[:110], y[:110]), test=(x[110:], y[110:]), num_classes=3, name="blobs")


def train_with_metrics(tmp_path, data, comm, **settings):
    metrics = tmp_path / "metrics.jsonl"
    stream = io.StringIO()
    result = mpidist.train(
        "mlp:16",
        data,
        comm=comm,
        progress="lines",
        metrics=str(metrics),
        stream=stream,
        epochs=2,
        batch_size=20,
        **settings,
    )
    events = [json.loads(line) for line in metrics.read_text().splitlines()] if result.is_chief else []
    return result, events, stream.getvalue()


def test_a_regression_run_reports_mse_mae_r2_and_no_accuracy_anywhere(tmp_path):
    result, events, shown = train_with_metrics(tmp_path, regression_data(), MPI.COMM_SELF, strategy="local")
    assert "accuracy" not in (tmp_path / "metrics.jsonl").read_text()
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) == 2 and all({"test_loss", "test_mse", "test_mae", "test_r2"} <= set(e) for e in evals)
    done = events[-1]
    assert done["event"] == "done" and {"test_mse", "test_mae", "test_r2"} <= set(done)
    assert "test_per_class" not in done and result.test_accuracy is None
    assert done["test_mse"] == pytest.approx(done["test_loss"], rel=1e-5)  # (the loss is summed in float32)
    assert "accuracy" not in shown and "R^2" in shown and "test MAE" in shown


def test_a_classification_runs_per_class_supports_sum_to_the_test_split(tmp_path):
    result, events, shown = train_with_metrics(
        tmp_path, classification_data(), MPI.COMM_SELF, strategy="local"
    )
    done = events[-1]
    assert sum(record["support"] for record in done["test_per_class"]) == 40
    assert [record["class"] for record in done["test_per_class"]] == [0, 1, 2]
    assert np.array(done["test_confusion"]).sum() == 40
    assert np.trace(np.array(done["test_confusion"])) / 40 == pytest.approx(done["test_accuracy"])
    last_eval = [event for event in events if event["event"] == "eval"][-1]
    assert {"test_loss", "test_accuracy", "test_top2_accuracy"} <= set(last_eval)
    assert "test accuracy" in shown and "test top-2 accuracy" in shown


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy", ["allreduce", "ps-async"])
def test_on_ranks_the_done_event_counts_every_test_sample_once(tmp_path, strategy):
    world = MPI.COMM_WORLD
    ps = 1 if strategy == "ps-async" else 0
    result, events, _ = train_with_metrics(tmp_path, classification_data(), world, strategy=strategy, ps=ps)
    if result.is_chief:
        assert sum(record["support"] for record in events[-1]["test_per_class"]) == 40
    result, events, _ = train_with_metrics(tmp_path / "r", regression_data(), world, strategy=strategy, ps=ps)
    if result.is_chief:
        assert "accuracy" not in (tmp_path / "r" / "metrics.jsonl").read_text()
        assert 0 < events[-1]["test_mse"] and events[-1]["test_r2"] <= 1


def test_outputs_per_position_are_scored_token_by_token_and_samples_count_sequences():
    scoring = scores.scoring(True, (4, 3))  # sequences of 4 positions, 3 classes
    assert (scoring.classes, scoring.positions) == (3, 4)
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(5, 4, 3)), rng.integers(0, 3, (5, 4))
    figures = scoring.figures(scoring.add(scoring.zeros(), logits, labels, 0.5))
    flat = scores.scoring(True, (3,))
    tokens = flat.figures(flat.add(flat.zeros(), logits.reshape(20, 3), labels.reshape(20), 0.5))
    assert figures["samples"] == 5 and tokens["samples"] == 20
    assert figures["accuracy"] == tokens["accuracy"] == (logits.argmax(-1) == labels).mean()
    assert figures["loss"] == 0.5 and figures["confusion"] == tokens["confusion"]
    assert sum(figures["per_class"]["support"]) == 20
