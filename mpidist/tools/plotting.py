"""``python -m mpidist plot RUN_DIR [RUN_DIR ...]``: PNG figures of finished runs (the ``plot`` extra).

From each run directory's ``metrics.jsonl``: the training loss and the
evaluations' figures against the step and against wall time, and the
throughput over time, every run on one set of axes (``allreduce`` against
``ps-async``, say); from a traced run's ``trace.json``, a picture of a few
steps of every rank's timeline.  Files written by a run are untrusted: lines
that are not whole JSON objects with the fields used are passed over.
"""

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.lines import bounded_lines
from ..store import atomic
from ..store.outputs import refuse_special, special_input
from ..store.rundir import TRACE, metrics_of

INSTALL = "plot needs matplotlib: pip install 'mpidist[plot]' (or: pip install matplotlib)"
COLOURS = {
    "compute": "#4c72b0",
    "exchange": "#dd8452",
    "wait": "#c7c7c7",
    "serve": "#55a868",
    "pipeline": "#c44e52",
    "eval": "#8172b3",
    "checkpoint": "#937860",
    "io": "#da8bc3",
    "setup": "#8c8c8c",
    "step": "#ccb974",
}


@dataclasses.dataclass
class Run:
    """What a run's metrics say: its step events (by step, the last line of each wins) and its evaluations."""

    name: str
    steps: dict  # step -> {"time", "loss", "samples_per_s", ...}
    evals: list  # [{"step", "time" (where known), and the figures}]

    def series(self, figure):
        """``(steps, times, values)`` of a step-event figure, by step, finite values only."""
        rows = [(step, event.get("time"), event.get(figure)) for step, event in sorted(self.steps.items())]
        rows = [row for row in rows if is_finite_number(row[2]) and is_finite_number(row[1])]
        return tuple(np.array(column, dtype=float) for column in zip(*rows)) if rows else (np.array([]),) * 3


def read_run(run_dir):
    """The :class:`Run` of ``run_dir`` (or of a metrics file given itself)."""
    metrics = metrics_of(run_dir)
    special = special_input(metrics)
    if special:
        raise UsageError(f"plot: {run_dir}: no metrics to plot ({metrics}: {special})")
    if not os.path.lexists(metrics):
        raise UsageError(f"plot: {run_dir}: no metrics to plot ({metrics}: no such file)")
    steps, evals = {}, []
    for _, line in bounded_lines(metrics, f"plot: {metrics}"):  # (a line of a gigabyte: refused, never held)
        try:
            event = json.loads(line)
        except (ValueError, RecursionError):  # a line a crash cut short, or not JSON one can read
            continue
        if not isinstance(event, dict) or not is_finite_number(event.get("step")):
            continue
        if event.get("event") == "step":
            steps[int(event["step"])] = event
        elif event.get("event") == "eval":  # (a resumed run's repeated evaluation replaces the first)
            evals = [e for e in evals if e["step"] != event["step"] or set(e) != set(event)] + [event]
    if not steps:
        raise UsageError(f"plot: {metrics}: holds no step events to plot")
    known = sorted(
        (step, event["time"]) for step, event in steps.items() if is_finite_number(event.get("time"))
    )
    for event in evals:  # an evaluation's time: its step's, from the step events around it
        event["time"] = float(np.interp(event["step"], *zip(*known))) if known else math.nan
    return Run(name=run_label(run_dir), steps=steps, evals=evals)


def run_label(path):
    """A run's name on a figure: its directory's (of a metrics file given itself, the directory holding
    it)."""
    path = Path(path).resolve()
    return path.name if path.is_dir() else path.parent.name


def is_finite_number(value):
    """A finite int or float of a size a float holds (JSON allows a 400-digit integer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) < 2**53 if isinstance(value, int) else math.isfinite(value)


def new_figure(columns=2):
    """A matplotlib figure and its axes, made without pyplot (no global state, no display)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(INSTALL) from None
    figure = Figure(figsize=(5 * columns, 4), dpi=100, layout="constrained")
    return figure, figure.subplots(1, columns, squeeze=False)[0]


def save_png(figure, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    refuse_special(path, "the figure")
    try:  # written aside and renamed into place: a stopped plot leaves no half figure
        with atomic.replacing(Path(path)) as aside:
            figure.savefig(aside, format="png")
    except OSError as err:
        raise UsageError(f"plot: cannot write {path} ({err.strerror or err})") from None
    except ValueError as err:  # (text matplotlib cannot lay out: what a file gave it, not a bug to trace)
        raise UsageError(
            f"plot: cannot draw {path}: {str(err).splitlines()[0] if str(err) else err!r}"
        ) from None
    return Path(path)


def plot_runs(runs, output):
    """``loss.png``, ``accuracy.png`` (where there are evaluations) and ``throughput.png`` in ``output``."""
    written = []
    figure, (by_step, by_time) = new_figure()
    for index, run in enumerate(runs):
        steps, times, loss = run.series("loss")
        marker = "o" if len(steps) == 1 else None  # (one point: a line would not show)
        by_step.plot(steps, loss, color=f"C{index}", marker=marker, label=run.name)
        by_time.plot(times, loss, color=f"C{index}", marker=marker, label=run.name)
    _label(
        figure,
        (by_step, by_time),
        "training loss",
        "loss",
        log=all((r.series("loss")[2] > 0).all() for r in runs),
    )
    written.append(save_png(figure, Path(output) / "loss.png"))
    figure = _evaluations(runs)
    if figure is not None:
        written.append(save_png(figure, Path(output) / "accuracy.png"))
    figure, (axes,) = new_figure(columns=1)
    for index, run in enumerate(runs):
        _, times, rate = whole_intervals(*run.series("samples_per_s"))
        axes.plot(times, rate, color=f"C{index}", label=run.name)
    axes.set(title="throughput", xlabel="time (s)", ylabel="samples/s")
    legend_beside(axes)
    written.append(save_png(figure, Path(output) / "throughput.png"))
    return written


def whole_intervals(steps, times, rates):
    """A throughput series without its last point where that point's interval is shorter than the others'
    (the run's end, after fewer steps than ``--log-every``): a rate over a few steps is noise, and it drew
    a spike at the end of every such run."""
    if len(steps) >= 3 and steps[-1] - steps[-2] < np.median(np.diff(steps[:-1])):
        return steps[:-1], times[:-1], rates[:-1]
    return steps, times, rates


def _evaluations(runs):
    """Test (or validation) accuracy, or MSE for a regression, against step and time; None without any."""
    names = ("test_accuracy", "val_accuracy", "test_mse", "val_mse")
    figure, (by_step, by_time) = new_figure()
    drawn = False
    for index, run in enumerate(runs):  # a run's colour; its test figure solid, its training one dashed
        for style, name in zip(("-o", ":s", "-o", ":s"), names):
            points = [
                (e["step"], e.get("time", math.nan), e[name])
                for e in run.evals
                if is_finite_number(e.get(name))
            ]
            if points:
                steps, times, values = np.array(points, dtype=float).T
                for axes, x in ((by_step, steps), (by_time, times)):
                    axes.plot(x, values, style, color=f"C{index}", label=f"{run.name} {name}")
                drawn = True
        steps, times, train = run.series("train_accuracy")
        if len(steps):
            for axes, x in ((by_step, steps), (by_time, times)):
                axes.plot(x, train, "--", color=f"C{index}", alpha=0.6, label=f"{run.name} train_accuracy")
    if not drawn:
        return None
    kinds = {
        "MSE" if "mse" in name else "accuracy"
        for run in runs
        for e in run.evals
        for name in names
        if name in e
    }
    _label(figure, (by_step, by_time), "evaluations", " / ".join(sorted(kinds)) or "accuracy")
    return figure


def _label(figure, axes_pair, title, ylabel, log=False):
    by_step, by_time = axes_pair
    figure.suptitle(title)
    by_step.set(xlabel="step", ylabel=ylabel)
    by_time.set(xlabel="time (s)", ylabel=ylabel)
    for axes in axes_pair:
        if log:
            axes.set_yscale("log")
    legend_beside(by_time)  # (both axes draw the same runs: one legend, right of them)


def legend_beside(axes):
    """The legend right of ``axes``, off the curves (the constrained layout makes room for it)."""
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", borderaxespad=0.0)


def read_trace(path):
    """The ``traceEvents`` of a Chrome trace file, checked to be a list of objects."""
    try:
        events = json.loads(Path(path).read_text(encoding="utf-8", errors="replace")).get("traceEvents")
    except (OSError, ValueError, AttributeError, RecursionError) as err:
        raise UsageError(f"plot: {path}: not a trace mpidist wrote ({type(err).__name__})") from None
    if not isinstance(events, list):
        raise UsageError(f"plot: {path}: has no traceEvents list")
    return [
        e
        for e in events
        if isinstance(e, dict)
        and _whole(e.get("pid"))
        and _whole(e.get("tid", 0))
        and is_finite_number(e.get("ts", 0))
    ]


def _whole(value):
    return is_finite_number(value) and isinstance(value, int)


def plot_timeline(trace_path, output, steps=3):
    """A picture of ``steps`` steps from the middle of a traced run: one row per rank, spans coloured by
    kind."""
    events = read_trace(trace_path)
    spans = [
        dict(e, tid=e.get("tid", 0), cat=e.get("cat") if isinstance(e.get("cat"), str) else "wait")
        for e in events
        if e.get("ph") == "X" and is_finite_number(e.get("ts")) and is_finite_number(e.get("dur"))
    ]
    if not spans:
        raise UsageError(f"plot: {trace_path}: holds no spans")
    marks = sorted(
        (_args(s)["step"], s["ts"], s["ts"] + s["dur"])
        for s in spans
        if s.get("name") == "step" and s.get("tid") == 1 and is_finite_number(_args(s).get("step"))
    )
    if marks:
        middle = marks[len(marks) // 2][0]
        chosen = [m for m in marks if middle <= m[0] < middle + steps]
        start, end = min(m[1] for m in chosen), max(m[2] for m in chosen)
    else:
        start, end = min(s["ts"] for s in spans), max(s["ts"] + s["dur"] for s in spans)
    names = {e["pid"]: str(_args(e).get("name")) for e in events if e.get("name") == "process_name"}
    ranks = sorted({s["pid"] for s in spans})
    figure, (axes,) = new_figure(columns=1)
    figure.set_size_inches(12, 1.0 + 0.6 * len(ranks))
    seen = set()
    for row, rank in enumerate(ranks):
        for span in spans:
            if (
                span["pid"] != rank
                or span["tid"] not in (0, 2)
                or span["ts"] > end
                or span["ts"] + span["dur"] < start
            ):
                continue
            depth = 0.25 if span["tid"] == 2 else 0.0  # buckets: a thin band under the main thread
            cat = span.get("cat", "wait")
            left, right = max(span["ts"], start), min(span["ts"] + span["dur"], end)  # (cut to the window)
            axes.broken_barh(
                [((left - start) / 1e3, (right - left) / 1e3)],
                (row - 0.4 + depth, 0.55 if depth else 0.8),
                color=COLOURS.get(cat, "#999999"),
                label=None if cat in seen else cat,
            )
            seen.add(cat)
    where = {rank: row for row, rank in enumerate(ranks)}
    arrows = [
        e
        for e in events
        if e.get("ph") in ("s", "f")
        and isinstance(e.get("id"), (int, str))
        and "ts" in e
        and e["pid"] in where
    ]
    starts = {e["id"]: e for e in arrows if e["ph"] == "s"}
    for finish in (e for e in arrows if e["ph"] == "f" and e["id"] in starts):
        begin = starts[finish["id"]]
        if start <= begin["ts"] <= end and start <= finish["ts"] <= end:
            axes.annotate(
                "",
                xy=((finish["ts"] - start) / 1e3, where[finish["pid"]]),
                xytext=((begin["ts"] - start) / 1e3, where[begin["pid"]]),
                arrowprops={"arrowstyle": "->", "linewidth": 0.6, "color": "black"},
            )
    axes.set_yticks(range(len(ranks)), [names.get(rank, f"rank {rank}") for rank in ranks], fontsize="small")
    axes.invert_yaxis()
    axes.set(xlabel="time (ms)", title=f"{Path(trace_path).parent.name}: {steps} steps of every rank")
    legend_beside(axes)
    return save_png(figure, output)


def _args(event):
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def main(run_dirs, output=None):
    """The command: figures of ``run_dirs`` into ``output`` (default: the first run's ``plots/``); ``(the
    paths, notes for the user)``."""
    runs = [read_run(path) for path in run_dirs]
    names = [run.name for run in runs]
    for index, run in enumerate(runs):  # two runs of one name (a/run, b/run) each keep their own
        if names.count(run.name) > 1:
            run.name = f"{run.name} ({index + 1})"
    first = Path(run_dirs[0])
    output = Path(output) if output else (first if first.is_dir() else first.parent) / "plots"
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"plot --output {output}: cannot create ({err.strerror})") from None
    written = plot_runs(runs, output)
    traced = [(Path(path) / TRACE).is_file() for path in run_dirs]
    for path, run, timeline in zip(run_dirs, runs, traced):
        if timeline:
            name = "".join(c if c.isalnum() or c in "-_." else "-" for c in run.name)
            written.append(plot_timeline(Path(path) / TRACE, output / f"timeline-{name}.png"))
    notes = []
    if any(traced) and not all(traced):
        shown = ", ".join(run.name for run, timeline in zip(runs, traced) if timeline)
        notes.append(
            f"{shown} traced (--trace), the others not: tracing costs time, so throughput.png compares "
            "them unlike for like"
        )
    return written, notes
