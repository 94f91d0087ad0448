"""``plan --check RUN_DIR...``: the prediction for runs that happened, beside what they measured.

A run's ``metrics.jsonl`` says its layout (the ``start`` event's settings,
ranks and nodes) and its figures (the ``done`` event's ``samples_per_s`` and
``peak_rss_mib``).  The file is untrusted: a run whose events are missing
or malformed is named and passed over, never guessed at.
"""

import json

from ..runtime.errors import UsageError
from ..runtime.lines import bounded_lines
from ..runtime.text import printable
from ..store.outputs import special_input
from ..store.rundir import metrics_of
from .layout import DEFAULT_BUCKET_MB, Layout
from .step import predict, predicted


def read_layout(run_dir):
    """``(Layout, samples/s measured, peak bytes measured, model, data, cores a node gave its ranks or
    None)`` of a finished run, or a reason (a str) it cannot be checked."""
    metrics = metrics_of(run_dir)
    start = done = None
    special = special_input(metrics)
    if special:
        return f"{metrics}: {special}"
    try:  # (a line at a time, each bounded: a line of a gigabyte is refused, never held whole)
        for _, line in bounded_lines(metrics, str(metrics)):
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(event, dict) and event.get("event") in ("start", "done"):
                start, done = (event, done) if event["event"] == "start" else (start, event)
    except UsageError as err:
        return str(err)
    if start is None or done is None:
        return f"{metrics}: no {'start' if start is None else 'done'} event (a run that did not finish?)"
    config = start.get("config")
    try:
        ranks, nodes = int(start["ranks"]), int(start.get("nodes", 1))
        if not isinstance(config, dict) or ranks < 1 or nodes < 1 or ranks % nodes:
            raise ValueError
        layout = Layout(
            strategy=str(config["strategy"]),
            nodes=nodes,
            per_node=ranks // nodes,
            batch=int(config["batch_size"]),
            ps=int(config.get("ps", 0)),
            stages=int(config.get("stages", 1)),
            micro_batches=int(config.get("micro_batches", 4)),
            schedule=str(config.get("schedule", "1f1b")),
            tensor=int(config.get("tensor", 1)),
            exchange=str(config.get("exchange", "auto")),
            shard=str(config.get("shard", "none")),
            bucket_mb=float(config.get("bucket_mb", DEFAULT_BUCKET_MB)),
        )
        measured = float(done["samples_per_s"])
        peak = int(float(done.get("peak_rss_mib", 0)) * (1 << 20))
        cores = start.get("cores_per_node")  # (an earlier version's run has none)
        cores = int(cores) if isinstance(cores, int) and not isinstance(cores, bool) and cores > 0 else None
    except (KeyError, TypeError, ValueError, OverflowError):  # (OverflowError: an infinite figure as an int)
        return f"{metrics}: its start or done event lacks the layout or the figures"
    if not predicted(layout.strategy):
        return f"{metrics}: --strategy {layout.strategy} is not predicted"
    return layout, measured, peak, str(config.get("model")), str(config.get("data")), cores


def check_runs(cal, run_dirs):
    """Rows of prediction against measurement, one per run that can be checked; notes for the others."""
    rows, notes = [], []
    for run_dir in run_dirs:
        read = read_layout(run_dir)
        if isinstance(read, str):
            notes.append(f"passed over: {read}")
            continue
        layout, measured, peak, model, _, cores = read
        if model != cal.model:
            notes.append(
                f"note: {run_dir} trained --model {printable(model, 100)}, the calibration "
                f"{printable(cal.model, 100)}"
            )
        shared = cores is not None and layout.per_node > cores
        if shared:
            notes.append(
                f"note: {run_dir} ran {layout.per_node} ranks a node on {cores} "
                f"core{'s' * (cores != 1)}: its ranks shared "
                "cores (and MPI's waiting ranks spin on theirs), where the plan prices a core per rank: "
                "its prediction does not hold there (the row says so)"
            )
        try:
            made = predict(cal, layout)
        except UsageError as err:
            notes.append(f"passed over: {run_dir}: {err}")
            continue
        rows.append(
            {
                "run": str(run_dir),
                "layout": layout.describe(),
                "ranks": layout.ranks,
                "nodes": layout.nodes,
                "predicted": made.samples_per_s,
                "measured": measured,
                "speed_ratio": made.samples_per_s / measured if measured else None,
                "memory_predicted_mib": made.memory / (1 << 20),
                "memory_measured_mib": peak / (1 << 20),
                "memory_ratio": made.memory / peak if peak else None,
                "holds": f"no: {layout.per_node} ranks, {cores} core{'s' * (cores != 1)}"
                if shared
                else "yes",
            }
        )
    return rows, notes


COLUMNS = [
    ("layout", "layout", "{}"),
    ("ranks", "ranks", "{}"),
    ("nodes", "nodes", "{}"),
    ("predicted", "predicted/s", "{:,.0f}"),
    ("measured", "measured/s", "{:,.0f}"),
    ("speed_ratio", "ratio", "{:.2f}"),
    ("memory_predicted_mib", "MiB predicted", "{:,.0f}"),
    ("memory_measured_mib", "MiB measured", "{:,.0f}"),
    ("memory_ratio", "ratio", "{:.2f}"),
    ("holds", "prediction holds", "{}"),
]
