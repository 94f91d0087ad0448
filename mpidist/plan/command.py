"""What ``python -m mpidist plan`` does: calibrate (collective), predict and advise, or check runs."""

import dataclasses

from ..bench.output import check_output, format_table, write_results
from ..runtime.errors import UsageError
from ..runtime.memory import human, parse_bytes
from ..runtime.text import printable
from . import advice, calibration
from .check import COLUMNS as CHECK_COLUMNS
from .check import check_runs
from .links import parse_link
from .step import held_per_parameter

HELD_COLUMNS = [
    ("shard", "--shard", "{}"),
    ("workers", "W", "{}"),
    ("zero", "ZeRO's count B", "{:.2f}"),
    ("gathered", "gathered units B", "{:.2f}"),
    ("held", "held B/param", "{:.2f}"),
]

MAX_NODES = 1 << 20


def calibrate(world, settings, path, seconds):
    """``plan --calibrate``: measure on every rank, write ``path`` on rank 0; returns the calibration
    there."""
    from .measure import calibrate as measure

    made = measure(world, settings, seconds)
    if made is not None:
        calibration.save(made, path)
        between = made.network.describe() if made.network else "not measured (one node)"
        print(
            f"mpidist plan: calibrated {made.model} on {made.data} ({made.params:,} parameters): "
            f"within a node {made.node.describe() if made.node else 'not measured (one rank a node)'}; "
            f"between nodes {between}; written to {path}"
        )
        if made.ranks_per_node > made.cores:
            print(
                f"mpidist plan: warning: calibrated with {made.ranks_per_node} ranks a node on {made.cores} "
                "cores: the exchange within a node was measured with ranks sharing cores, slower than a core "
                "a rank gives; calibrate with at most as many ranks a node as cores"
            )
    return made


def parse_nodes(text):
    """``"1,8,64"`` -> ``[1, 8, 64]`` (ascending, each at least 1)."""
    try:
        counts = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1 or counts[-1] > MAX_NODES:
        raise UsageError(f"--nodes {text!r}: give node counts from 1 to {MAX_NODES:,}, e.g. 1,8,64,512")
    return counts


def plan(path, nodes, per_node, batch_per_rank, link, memory, output):
    """Predict every layout at each node count; print the table and the advice; write ``output``."""
    cal = calibration.load(path)
    if link is not None:
        cal = dataclasses.replace(cal, network=parse_link(link))
    per_node = per_node or cal.ranks_per_node
    batch_per_rank = batch_per_rank or cal.batch_per_rank
    budget = parse_bytes(memory, "--memory-per-node") if memory else cal.node_memory_bytes
    check_output(output, inputs=[path])
    counts = parse_nodes(nodes)
    rows, best, knee = advice.advise(cal, counts, per_node, batch_per_rank, budget)
    print(
        f"mpidist plan: {printable(cal.model, 100)} ({cal.params:,} parameters, {cal.optimizer}), "
        f"{batch_per_rank} samples per rank, {per_node} rank(s) per node, {human(budget)} per node; "
        f"between nodes {cal.network.describe() if cal.network else 'no link (one node only)'}"
    )
    table = [
        {
            **dataclasses.asdict(row),
            "memory_per_rank": row.memory_per_rank / (1 << 20),
            "fits": "yes" if row.fits else "no",
        }
        for row in rows
    ]
    print(format_table(table, advice.COLUMNS))
    for count, row in best.items():
        print(
            f"mpidist plan: on {count} node(s): {row.layout}, {row.samples_per_s:,.0f} samples/s "
            f"({row.efficiency:.0%} of linear)"
        )
    for line in caveats(cal, best, per_node):
        print(f"mpidist plan: {line}")
    print(
        "mpidist plan: "
        + (
            f"adding nodes pays up to {knee} (efficiency at least {advice.KNEE:.0%} there)"
            if knee
            else f"no node count keeps {advice.KNEE:.0%} efficiency"
        )
    )
    strategies = advice.per_strategy(rows)
    for strategy, (fastest, paying) in strategies.items():
        each = "; ".join(
            f"{count}: {row.layout.removeprefix(strategy).strip() or 'its defaults'} ({row.efficiency:.0%})"
            for count, row in fastest.items()
        )
        stale = (
            " (samples/s alone: the staleness of its updates, which may take more steps to the same "
            "accuracy, is not priced)"
            if strategy == "ps-async"
            else ""
        )
        print(
            f"mpidist plan: {strategy}{stale}: {each or 'fits nowhere'}"
            + (f"; pays up to {paying} node(s)" if paying else f"; never {advice.KNEE:.0%} efficient")
        )
    held = held_per_parameter(cal, per_node=per_node)
    print(
        f"\nmpidist plan: bytes a worker holds a parameter ({cal.optimizer}, {cal.dtype}): the ZeRO paper's "
        "count, and --shard parameters' two gathered units (units of 64 MiB; their parameters read once "
        f"per node of {per_node} rank(s) with --exchange auto)"
    )
    print(format_table(held, HELD_COLUMNS))
    buckets = advice.buckets(cal, counts, per_node, batch_per_rank)
    # (where the calibration saw nothing hidden: what a network card moving the bytes would leave)
    if buckets:
        hidden = cal.overlap > 0
        said = (
            f" (backward hid {cal.overlap:.0%} of what buckets can hide, as calibrated): "
            if hidden
            else ": backward hid none of the exchange in the calibration (any size does); were all it can "
            "hide hidden (a network card moving the bytes): "
        )
        print(
            "mpidist plan: --bucket-mb for allreduce --exchange mpi"
            + said
            + "; ".join(
                f"{count}: {size:g} ({(left if hidden else best) * 1e3:.2f} of {one * 1e3:.2f} ms left)"
                for count, (size, left, best, one) in buckets.items()
            )
        )
    write_results(
        output,
        {
            "calibration": str(path),
            "ranks_per_node": per_node,
            "batch_per_rank": batch_per_rank,
            "memory_per_node": budget,
            "rows": [dataclasses.asdict(row) for row in rows],
            "best": _layouts(best),
            "knee": knee,
            "bucket_mb": {str(count): size for count, (size, *_) in buckets.items()},
            "held_per_parameter": held,
            "by_strategy": {
                strategy: {"best": _layouts(fastest), "knee": paying}
                for strategy, (fastest, paying) in strategies.items()
            },
        },
    )
    print(f"mpidist plan: results in {output}")
    return rows, best, knee


def caveats(cal, best, per_node):
    """What the plan's figures leave out, where it matters to ``best`` (node count -> row) at ``per_node``
    ranks a node: what ``% of linear`` above 100% means, and ranks that would share the calibration's
    cores."""
    said = []
    if any(row.efficiency > 1.0 for row in best.values()):
        said.append(
            "note: linear is the node count times the best one-node layout's samples/s; above 100%, a layout "
            "does better per node than that: its work a rank shrinks as ranks are added (--shard optimizer "
            "divides the optimizer over every worker), or its ps ranks take a smaller share of more nodes"
        )
    if per_node > cal.cores:
        said.append(
            f"warning: {per_node} ranks a node on the {cal.cores} cores the calibration measured: the plan "
            "prices a core per rank, and ranks that share cores (MPI's waiting ranks spin on theirs) run "
            "slower than that by more than the share: its figures do not hold there"
        )
    return said


def _layouts(best):
    """``{"8": "allreduce ...", ...}``: the layout of each node count's row, keyed as JSON keys are."""
    return {str(count): row.layout for count, row in best.items()}


def check(path, run_dirs, output):
    """``plan --check``: prediction beside measurement for each run."""
    cal = calibration.load(path)
    check_output(output, inputs=[path, *run_dirs])
    rows, notes = check_runs(cal, run_dirs)
    for note in notes:
        print(f"mpidist plan: {note}")
    if not rows:
        raise UsageError("plan --check: none of the runs given can be checked (see above)")
    print(format_table(rows, CHECK_COLUMNS))
    write_results(output, {"calibration": str(path), "checked": rows, "notes": notes})
    print(f"mpidist plan: results in {output}")
    return rows
