"""python -m mpidist plot: PNG figures of runs, read back and checked."""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

from mpidist.runtime.errors import UsageError
from mpidist.tools import plotting

from conftest import mpidist

# (found, not imported: importing matplotlib here put it into every collection of the suite, each MPI
# rank's too)
if importlib.util.find_spec("matplotlib") is None:
    pytest.skip("the plot extra", allow_module_level=True)


def png(path):
    from matplotlib import image

    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.std() > 0.01, path  # not one colour: something is drawn
    return pixels.shape[1], pixels.shape[0]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A traced allreduce run and a ps-async run of the same model, 4 epochs each."""
    root = tmp_path_factory.mktemp("plots")
    for name, flags in [("allreduce", ["--trace"]), ("ps-async", ["--strategy", "ps-async", "--ps", "1"])]:
        done, _ = mpidist(
            3, "train", "--epochs", "4", "--run-dir", str(root / name), *flags, "--progress", "none"
        )
        assert done.returncode == 0, done.stderr
    return root


def test_plot_draws_two_runs_on_one_set_of_axes_and_a_timeline(two_runs, tmp_path):
    done, _ = mpidist(
        1, "plot", str(two_runs / "allreduce"), str(two_runs / "ps-async"), "--output", str(tmp_path / "out")
    )
    assert done.returncode == 0, done.stderr
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["accuracy.png", "loss.png", "throughput.png", "timeline-allreduce.png"]
    assert done.stdout.count("mpidist plot: wrote") == 4
    # (issue 63, item 10: a traced run beside an untraced one is said to be unlike for like)
    assert (
        "mpidist plot: allreduce traced (--trace), the others not: tracing costs time, so throughput.png "
        "compares them unlike for like" in done.stdout
    )
    assert png(tmp_path / "out" / "loss.png") == (1000, 400)
    assert png(tmp_path / "out" / "accuracy.png") == (1000, 400)
    assert png(tmp_path / "out" / "throughput.png") == (500, 400)
    width, height = png(tmp_path / "out" / "timeline-allreduce.png")
    assert width == 1200 and height >= 250
    done, _ = mpidist(1, "plot", str(two_runs / "ps-async"))  # default: the run's own plots/
    assert done.returncode == 0 and (two_runs / "ps-async" / "plots" / "loss.png").exists(), done.stderr


def test_the_evaluations_axis_says_what_it_shows_and_a_last_partial_interval_is_not_drawn(two_runs):
    """Issue 63, item 10: accuracy.png's y-axis said "figure"; throughput.png ended in a spike, the rate of
    the run's last few steps (fewer than --log-every)."""
    runs = [plotting.read_run(two_runs / name) for name in ("allreduce", "ps-async")]
    figure = plotting._evaluations(runs)
    assert [axes.get_ylabel() for axes in figure.axes[:2]] == ["accuracy", "accuracy"]
    regression = plotting.Run("r", {}, [{"step": 5, "time": 1.0, "test_mse": 0.5}])
    assert plotting._evaluations([regression]).axes[0].get_ylabel() == "MSE"
    steps, times, rates = (
        np.array(values, dtype=float) for values in ([10, 20, 30, 33], [1, 2, 3, 3.1], [5, 5, 5, 50])
    )
    assert [a.tolist() for a in plotting.whole_intervals(steps, times, rates)] == [
        [10, 20, 30],
        [1, 2, 3],
        [5, 5, 5],
    ]
    whole = steps[:3], times[:3], rates[:3]  # (every interval of 10 steps: all kept)
    assert [a.tolist() for a in plotting.whole_intervals(*whole)] == [a.tolist() for a in whole]


def test_metrics_are_read_as_untrusted_lines(tmp_path):
    lines = [
        {"event": "start", "step": 0},
        {"event": "step", "step": 10, "loss": 2.0, "time": 1.0},
        {"event": "step", "step": 20, "loss": 1.0, "time": 2.0},
        {"event": "eval", "step": 20, "test_accuracy": 0.5},
        {"event": "start", "step": 10},
        {"event": "step", "step": 20, "loss": 0.5, "time": 3.0},
        {"event": "step", "step": "x"},
        [1, 2],
        {"event": "eval", "step": 20, "test_accuracy": 0.75},
        {"event": "step", "step": 10**400},
    ]
    text = "\n".join(json.dumps(line) for line in lines) + '\n{"event": "step", "st'
    (tmp_path / "metrics.jsonl").write_text(text)
    run = plotting.read_run(tmp_path)
    steps, times, loss = run.series("loss")
    assert steps.tolist() == [10, 20] and loss.tolist() == [2.0, 0.5] and times.tolist() == [1.0, 3.0]
    # the repeat wins
    assert [e["test_accuracy"] for e in run.evals] == [0.75] and run.evals[0]["time"] == 3.0
    with pytest.raises(UsageError, match="holds no step events"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "metrics.jsonl").write_text('{"event": "start"}\n')
        plotting.read_run(tmp_path / "empty")
    with pytest.raises(UsageError, match="nowhere: no metrics to plot"):
        plotting.read_run(tmp_path / "nowhere")
    (tmp_path / "trace.json").write_text("{not json")
    with pytest.raises(UsageError, match="not a trace mpidist wrote"):
        plotting.plot_timeline(tmp_path / "trace.json", tmp_path / "t.png")


def test_bad_input_and_a_missing_matplotlib_are_one_message_and_exit_code_2(tmp_path, monkeypatch):
    done, _ = mpidist(1, "plot", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "no metrics to plot" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "metrics.jsonl").write_text('{"event": "step", "step": 1, "loss": 1.0, "time": 0.1}\n')
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(UsageError, match=r"plot needs matplotlib: pip install 'mpidist\[plot\]'"):
        plotting.main([tmp_path])


def test_a_timeline_passes_over_events_of_the_wrong_shape(tmp_path):
    good = [
        {
            "name": "step",
            "cat": "step",
            "ph": "X",
            "pid": p,
            "tid": 1,
            "ts": 10.0 * s,
            "dur": 9.0,
            "args": {"step": s},
        }
        for p in (0, 1)
        for s in range(1, 6)
    ]
    good += [
        {"name": "compute", "cat": "compute", "ph": "X", "pid": p, "tid": 0, "ts": 10.0 * s, "dur": 5.0}
        for p in (0, 1)
        for s in range(1, 6)
    ]
    good += [
        {"name": "a", "cat": "pipeline", "ph": "s", "pid": 0, "tid": 0, "ts": 31.0, "id": 5},
        {"name": "a", "cat": "pipeline", "ph": "f", "pid": 1, "tid": 0, "ts": 33.0, "id": 5, "bp": "e"},
    ]
    bad = [
        {"ph": "X", "pid": 0, "ts": 30, "dur": 1},
        {"ph": "X", "pid": 0, "tid": 0, "ts": 30, "dur": 1, "cat": ["a"]},
        {"ph": "s", "pid": 0, "tid": 0, "ts": 31, "id": [1]},
        {"ph": "f", "pid": 0, "tid": 0, "ts": 31, "id": {"a": 1}},
        {"ph": "s", "pid": 0, "tid": 0, "ts": "31", "id": 9},
        {"ph": "f", "pid": 1, "tid": 0, "ts": 32, "id": 9},
        {"ph": "s", "pid": 7, "tid": 0, "ts": 31, "id": 8},
        {"ph": "f", "pid": 1, "tid": 0, "ts": 32, "id": 8},
        {"ph": "X", "pid": 10**400, "tid": 0, "ts": 30, "dur": 1},
        {"ph": "X", "pid": 0, "tid": 0, "ts": 30, "dur": 1, "args": [1]},
        "text",
        None,
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": good + bad}))
    path = plotting.plot_timeline(tmp_path / "trace.json", tmp_path / "t.png")
    assert png(path)[0] == 1200
    (tmp_path / "deep.json").write_text("[" * 100000)
    with pytest.raises(UsageError, match="not a trace mpidist wrote"):
        plotting.plot_timeline(tmp_path / "deep.json", tmp_path / "d.png")


def test_legends_stand_beside_the_curves_not_on_them():
    figure, (by_step, by_time) = plotting.new_figure()
    for index, name in enumerate(
        ["my_script-build-digits-ps-sync-20261125-101010", "mlp-digits-allreduce-2"]
    ):
        for axes in (by_step, by_time):
            axes.plot(range(50), [1 / (step + 1 + index) for step in range(50)], label=name)
    plotting._label(figure, (by_step, by_time), "training loss", "loss")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    assert by_step.get_legend() is None  # one legend for the pair
    legend, plot = by_time.get_legend().get_window_extent(renderer), by_time.get_window_extent(renderer)
    assert legend.x0 >= plot.x1  # right of the curves
    assert legend.x1 <= figure.bbox.x1 + 1  # and inside the figure


def test_plot_draws_a_plan_one_line_per_layout_with_measured_runs_on_top(two_runs, tmp_path):
    from mpidist.plan import calibration
    from mpidist.tools import plan_figure
    from test_plan import made_up

    calibration.save(made_up(), tmp_path / "c.json")
    done, _ = mpidist(
        1,
        "plan",
        "--calibration",
        str(tmp_path / "c.json"),
        "--nodes",
        "1,2,4",
        "--output",
        str(tmp_path / "plan.json"),
    )
    assert done.returncode == 0, done.stderr
    plan = plan_figure.read_plan(tmp_path / "plan.json")
    assert [n for n, _, _ in plan.lines["allreduce"]] == [1, 2, 4]  # (by node count; some layouts need 2)
    assert all({n for n, _, _ in points} <= {1, 2, 4} for points in plan.lines.values())
    # (--ps 2 on 2 nodes, --ps 4 on 4: one line)
    assert "ps-sync --ps NODES" in plan.lines and plan.skipped == 0
    written = json.loads((tmp_path / "plan.json").read_text())
    best_one_node = max(row["samples_per_s"] for row in written["rows"] if row["nodes"] == 1 and row["fits"])
    assert plan.linear == pytest.approx(best_one_node)  # (the efficiency column's reference)
    done, _ = mpidist(
        1,
        "plot",
        "--plan",
        str(tmp_path / "plan.json"),
        str(two_runs / "allreduce"),
        str(tmp_path / "nowhere"),
    )
    assert done.returncode == 0, done.stderr
    assert png(tmp_path / "plan.png") == (800, 500)
    assert "passed over" in done.stdout and "nowhere" in done.stdout
    # (issue 63, item 2: the run's batch per rank is not the plan's, said)
    assert (
        "mpidist plot: allreduce trained 21.3333 samples a rank (--batch-size 64 on 3 ranks), the plan's "
        "lines 64: its point is not on their terms\n" in done.stdout
    )
    # what is drawn: a line per layout, the linear scaling, and the allreduce run (3 ranks, one node) as a
    # star in allreduce's colour
    measured, _ = plan_figure.measured_points([two_runs / "allreduce"])
    figure = plan_figure.draw_plan(plan, measured, "plan.json")
    drawn = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert set(plan.lines) | {"linear", "measured: allreduce (allreduce)"} <= set(drawn)
    star = drawn["measured: allreduce (allreduce)"]
    assert star.get_xdata().tolist() == [1] and star.get_color() == drawn["allreduce"].get_color()
    assert drawn["linear"].get_ydata().tolist() == pytest.approx([best_one_node * n for n in (1, 2, 4)])


def test_a_plan_file_is_untrusted(tmp_path):
    from mpidist.tools import plan_figure

    rows = [
        {"nodes": 1, "layout": "allreduce", "samples_per_s": 100.0, "fits": True, "efficiency": 1.0},
        {"nodes": 2, "layout": "allreduce", "samples_per_s": 180.0, "fits": False, "efficiency": 0.9},
        {"nodes": True, "layout": "x", "samples_per_s": 1.0},
        {"nodes": 0, "layout": "x", "samples_per_s": 1.0},
        {"nodes": 4, "layout": 7, "samples_per_s": 1.0},
        {"nodes": 4, "layout": "x", "samples_per_s": -1},
        {"nodes": 4, "layout": "x", "samples_per_s": 10**400},
        {"nodes": 4, "layout": "x" * 500, "samples_per_s": 1.0},
        "row",
        None,
    ]
    (tmp_path / "p.json").write_text(json.dumps({"rows": rows}))
    plan = plan_figure.read_plan(tmp_path / "p.json")
    assert plan.lines == {"allreduce": [(1, 100.0, True), (2, 180.0, False)]} and plan.skipped == 8
    assert plan.linear == pytest.approx(100.0)
    many = [{"nodes": n, "layout": f"l{k}", "samples_per_s": 1.0} for n in (1, 2) for k in range(41)]
    for text, message in (
        ("{not json", "not a plan mpidist wrote"),
        ("[1]", "not a plan mpidist wrote"),
        ('{"rows": [{"nodes": 0}]}', "holds no rows"),
        ("[" * 100000, "not a plan"),
        (json.dumps({"rows": many}), "more than a figure shows"),
    ):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(UsageError, match=message):
            plan_figure.read_plan(tmp_path / "bad.json")
    # labels are drawn as written: matplotlib would read $...$ as TeX, and fail on a bad one
    (tmp_path / "tex.json").write_text(
        json.dumps({"rows": [{"nodes": 1, "layout": "$\\foo$", "samples_per_s": 1.0}]})
    )
    done, _ = mpidist(1, "plot", "--plan", str(tmp_path / "tex.json"))
    assert done.returncode == 0 and (tmp_path / "plan.png").exists(), done.stderr
    assert "passed over" not in done.stdout
    done, _ = mpidist(1, "plot", "--plan", str(tmp_path / "p.json"))
    assert done.returncode == 0 and "passed over 8 row(s)" in done.stdout, done.stderr
    os.mkfifo(tmp_path / "pipe.json")  # (a named pipe would block the reader forever)
    with pytest.raises(UsageError, match="named pipe"):
        plan_figure.read_plan(tmp_path / "pipe.json")
    (tmp_path / "piped").mkdir()
    os.mkfifo(tmp_path / "piped" / "metrics.jsonl")
    with pytest.raises(UsageError, match="named pipe"):
        plotting.read_run(tmp_path / "piped")
    done, _ = mpidist(1, "plot", "--plan", str(tmp_path / "nowhere.json"))
    assert done.returncode == 2 and "cannot be read" in done.stderr and "Traceback" not in done.stderr
    done, _ = mpidist(1, "plot")
    assert done.returncode == 2 and "give run directories to draw, or --plan" in done.stderr
