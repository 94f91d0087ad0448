"""``python -m mpidist plot --plan PLAN.json [RUN_DIR ...]``: ``plan``'s predictions drawn, runs on top.

Predicted samples/s against the node count, one line per layout (a ps on
every node, ``--ps NODES``, is one line), a cross where the ranks would not
fit a node's memory, and linear scaling from the best one-node layout
dotted; each run directory given is a measured point at its node count, in
its layout's colour.  The plan file is untrusted: rows without the figures
drawn are passed over and counted, labels are drawn as written (never as
TeX), and a file that is not a plan, or holds more than a figure can show,
is one message.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np

from ..plan.check import read_layout
from ..runtime.errors import UsageError
from ..store.outputs import read_input
from .plotting import is_finite_number, legend_beside, new_figure, run_label, save_png

MAX_BYTES = 64 << 20  # a plan of every layout at thousands of node counts is a few MB
MAX_LINES = 40  # beyond these, a figure no one can read (and minutes of matplotlib)
MAX_COUNTS = 64
MAX_LABEL = 120
NAME = "plan.png"


@dataclasses.dataclass
class Plan:
    """What a plan file says to draw: ``lines`` (``{layout: [(nodes, samples/s, fits), ...]}``, by node
    count), ``linear`` (samples/s per node of linear scaling from the best one-node layout; None where the
    rows do not say) and ``skipped`` (rows without the fields drawn)."""

    lines: dict
    linear: float
    skipped: int
    batch_per_rank: int = None  # what the predictions assume (None where the file does not say)


def read_plan(path):
    """The :class:`Plan` of ``plan --output``'s JSON (untrusted: checked row by row, and bounded)."""
    raw = read_input(path, MAX_BYTES, "plot --plan", "a plan mpidist wrote")
    try:
        document = json.loads(raw.decode("utf-8", errors="replace"))
        rows = document.get("rows")
    except (ValueError, AttributeError, RecursionError) as err:
        raise UsageError(f"plot --plan {path}: not a plan mpidist wrote ({err})") from None
    batch = document.get("batch_per_rank")
    rows = rows if isinstance(rows, list) else []
    lines, linear = {}, []
    for row in rows:
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("layout"), str)
            or len(row["layout"]) > MAX_LABEL
        ):
            continue
        nodes, rate, efficiency = row.get("nodes"), row.get("samples_per_s"), row.get("efficiency")
        if not (
            isinstance(nodes, int)
            and is_finite_number(nodes)
            and nodes >= 1
            and is_finite_number(rate)
            and rate > 0
        ):
            continue
        fits = row.get("fits") is not False
        lines.setdefault(_family(row["layout"], nodes), []).append((nodes, float(rate), fits))
        # (every row's: rate / (nodes x the best one-node))
        if is_finite_number(efficiency) and efficiency > 0:
            linear.append(rate / (efficiency * nodes))
    if not lines:
        raise UsageError(f"plot --plan {path}: holds no rows of predictions to draw")
    counts = {nodes for points in lines.values() for nodes, _, _ in points}
    if len(lines) > MAX_LINES or len(counts) > MAX_COUNTS:
        raise UsageError(
            f"plot --plan {path}: {len(lines)} layouts at {len(counts)} node counts: more than a "
            f"figure shows ({MAX_LINES} and {MAX_COUNTS}); plan fewer --nodes"
        )
    return Plan(
        {layout: sorted(points) for layout, points in lines.items()},
        float(np.median(linear)) if linear else None,
        len(rows) - sum(map(len, lines.values())),
        batch if isinstance(batch, int) and is_finite_number(batch) and batch > 0 else None,
    )


def _family(layout, nodes):
    """The line ``layout`` at ``nodes`` nodes belongs to: a ps a node (``--ps 8`` on 8 nodes) is one line."""
    ps = f"--ps {nodes}"
    if nodes > 1 and (layout.endswith(ps) or f"{ps} " in layout):
        return layout.replace(ps, "--ps NODES")
    return layout


def unlike(plan, measured):
    """Notes on the measured points that ran another batch per rank than ``plan``'s predictions assume
    (their stars are not on the lines' terms)."""
    if plan.batch_per_rank is None:
        return []
    notes = []
    for name, layout, _ in measured:
        per_rank = layout.batch / layout.ranks
        if per_rank != plan.batch_per_rank:
            again = (
                f" (plan --batch-per-rank {per_rank:g} draws lines for it)" if per_rank.is_integer() else ""
            )
            notes.append(
                f"{name} trained {per_rank:g} samples a rank (--batch-size {layout.batch} on {layout.ranks} "
                f"ranks), the plan's lines {plan.batch_per_rank}: its point is not on their terms{again}"
            )
    return notes


def measured_points(run_dirs):
    """``([(run name, Layout, samples/s measured), ...], notes on the runs passed over)``."""
    points, notes = [], []
    for run_dir in run_dirs:
        read = read_layout(run_dir)
        if isinstance(read, str):
            notes.append(f"passed over: {read}")
        elif not (is_finite_number(read[1]) and read[1] > 0):
            notes.append(f"passed over: {run_dir}: no samples/s measured")
        else:
            points.append((run_label(run_dir), read[0], read[1]))
    return points, notes


def _text(label):
    """``label`` drawn as written: matplotlib would read ``$...$`` as mathematics (and fail on bad TeX)."""
    return str(label).replace("$", r"\$")


def draw_plan(plan, measured, title):
    """The figure of a :class:`Plan` and :func:`measured_points`' ``measured``."""
    figure, (axes,) = new_figure(columns=1)
    figure.set_size_inches(8, 5)
    # (20 colours, then the same dashed: a run's star takes the colour of its own layout's line)
    import matplotlib  # (the plot extra, present once new_figure has returned)

    palette = matplotlib.colormaps["tab20"]
    colours = {layout: palette(index % 20) for index, layout in enumerate(plan.lines)}
    for index, (layout, points) in enumerate(plan.lines.items()):
        nodes, rates, _ = zip(*points)
        axes.plot(
            nodes,
            rates,
            "-" if index < 20 else "--",
            color=colours[layout],
            marker="o",
            markersize=3,
            label=_text(layout),
        )
        crossed = [(n, r) for n, r, fits in points if not fits]
        if crossed:
            axes.plot(*zip(*crossed), "x", color=colours[layout], markersize=9)
    counts = sorted({n for points in plan.lines.values() for n, _, _ in points})
    if plan.linear:
        axes.plot(counts, [plan.linear * n for n in counts], ":", color="grey", label="linear")
    for name, layout, rate in measured:  # (in the colour of its layout's line, where the plan has one)
        described = _family(layout.describe(), layout.nodes)
        axes.plot(
            [layout.nodes],
            [rate],
            "*",
            color=colours.get(described, "black"),
            markersize=14,
            markeredgecolor="black",
            label=_text(f"measured: {name} ({described})"),
        )
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts, [str(count) for count in counts])
    axes.minorticks_off()
    axes.set_yscale("log")
    axes.set(
        xlabel="nodes",
        ylabel="samples/s",
        title=_text(f"{title}: predicted samples/s (x: does not fit memory)"),
    )
    axes.grid(True, which="major", alpha=0.3)
    if len(counts) == 1:  # (one node count: an axis around it, not a point wide)
        axes.set_xlim(counts[0] / 2, counts[0] * 2)
    legend_beside(axes)
    return figure


def main(plan_path, run_dirs, output=None):
    """The command: ``plan.png`` into ``output`` (default: beside the plan file); the paths and notes."""
    plan = read_plan(plan_path)
    measured, notes = measured_points(run_dirs)
    if plan.skipped:
        notes.insert(0, f"passed over {plan.skipped} row(s) of {plan_path} without the figures drawn")
    notes += unlike(plan, measured)
    output = Path(output) if output else Path(plan_path).parent
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"plot --output {output}: cannot create ({err.strerror})") from None
    return [save_png(draw_plan(plan, measured, Path(plan_path).name), output / NAME)], notes
