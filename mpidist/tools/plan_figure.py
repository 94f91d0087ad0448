"""``python -m mpidist plot --plan PLAN.json [RUN_DIR ...]``: ``plan``'s predictions drawn, runs on top.

Predicted samples/s against the node count, one line per layout (a ps on
every node, ``--ps NODES``, is one line), a cross where the ranks would not
fit a node's memory, and the linear scaling of the best layout at the fewest
nodes dotted; each run directory given is a measured point at its node
count, in its layout's colour.  The plan file is untrusted: rows without the
fields used are passed over, and a file that is not a plan is one message.
"""

import json
from pathlib import Path

from ..plan.check import read_layout
from ..runtime.errors import UsageError
from .plotting import is_finite_number, legend_beside, new_figure, save_png

MAX_BYTES = 64 << 20     # a plan of every layout at thousands of node counts is a few MB
NAME = "plan.png"


def read_plan(path):
    """``{layout: [(nodes, samples/s, fits), ...]}`` from ``plan --output``'s JSON, by node count."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES:,} bytes")
        rows = json.loads(raw.decode("utf-8", errors="replace")).get("rows")
    except OSError as err:
        raise UsageError(f"plot --plan {path}: cannot be read ({err.strerror or err})") from None
    except (ValueError, AttributeError, RecursionError) as err:
        raise UsageError(f"plot --plan {path}: not a plan mpidist wrote ({err})") from None
    lines = {}
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("layout"), str):
            continue
        nodes, rate = row.get("nodes"), row.get("samples_per_s")
        if isinstance(nodes, int) and is_finite_number(nodes) and nodes >= 1 and is_finite_number(rate) and rate > 0:
            fits = row.get("fits") is not False
            lines.setdefault(_family(row["layout"], nodes), []).append((nodes, float(rate), fits))
    if not lines:
        raise UsageError(f"plot --plan {path}: holds no rows of predictions to draw")
    return {layout: sorted(points) for layout, points in lines.items()}


def _family(layout, nodes):
    """The line ``layout`` at ``nodes`` nodes belongs to: a ps a node (``--ps 8`` on 8 nodes) is one line."""
    ps = f"--ps {nodes}"
    if nodes > 1 and (layout.endswith(ps) or f"{ps} " in layout):
        return layout.replace(ps, "--ps NODES")
    return layout


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
            points.append((Path(run_dir).resolve().name, read[0], read[1]))
    return points, notes


def draw_plan(lines, measured, title):
    """The figure of :func:`read_plan`'s ``lines`` and :func:`measured_points`' ``measured``."""
    figure, (axes,) = new_figure(columns=1)
    figure.set_size_inches(8, 5)
    colours = {layout: f"C{index % 10}" for index, layout in enumerate(lines)}
    for index, (layout, points) in enumerate(lines.items()):
        nodes, rates, _ = zip(*points)
        axes.plot(nodes, rates, "-" if index < 10 else "--", color=colours[layout], marker="o", markersize=3,
                  label=layout)
        crossed = [(n, r) for n, r, fits in points if not fits]
        if crossed:
            axes.plot(*zip(*crossed), "x", color=colours[layout], markersize=9)
    counts = sorted({n for points in lines.values() for n, _, _ in points})
    one_node = max(r for points in lines.values() for n, r, _ in points if n == counts[0])
    axes.plot(counts, [one_node * n / counts[0] for n in counts], ":", color="grey", label="linear")
    for name, layout, rate in measured:   # (in the colour of its layout's line, where the plan has one)
        described = _family(layout.describe(), layout.nodes)
        axes.plot([layout.nodes], [rate], "*", color=colours.get(described, "black"), markersize=14,
                  markeredgecolor="black", label=f"measured: {name} ({described})")
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts, [str(count) for count in counts])
    axes.minorticks_off()
    axes.set_yscale("log")
    axes.set(xlabel="nodes", ylabel="samples/s", title=f"{title}: predicted samples/s (x: does not fit memory)")
    axes.grid(True, which="major", alpha=0.3)
    if len(counts) == 1:   # (one node count: an axis around it, not a point wide)
        axes.set_xlim(counts[0] / 2, counts[0] * 2)
    legend_beside(axes)
    return figure


def main(plan_path, run_dirs, output=None):
    """The command: ``plan.png`` into ``output`` (default: beside the plan file); the paths and notes."""
    lines = read_plan(plan_path)
    measured, notes = measured_points(run_dirs)
    output = Path(output) if output else Path(plan_path).parent
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"plot --output {output}: cannot create ({err.strerror})") from None
    return [save_png(draw_plan(lines, measured, Path(plan_path).name), output / NAME)], notes
