"""Every layout worth trying at each node count, predicted; the fastest that fits, and where adding nodes
stops paying.

The batch grows with the ranks (``--batch-per-rank`` samples a rank, as
scaling figures are usually quoted): a layout's scaling efficiency is its
samples/s over the node count times the best one-node samples/s.
"""

import dataclasses

from ..runtime.errors import UsageError
from .buckets import MIB, best_bucket, exposed, hideable
from .layout import Layout
from .step import predict

#: below this scaling efficiency, more nodes are not worth what they cost
KNEE = 0.5


def predictions(cal, nodes, per_node, batch_per_rank):
    """The :class:`~mpidist.plan.layout.Prediction` of each layout :func:`advise` compares on ``nodes``
    nodes of ``per_node`` ranks."""
    ranks = nodes * per_node
    batch = batch_per_rank * ranks
    if ranks == 1:
        return [predict(cal, Layout("local", 1, 1, batch))]
    made = [
        Layout("allreduce", nodes, per_node, batch),
        Layout("allreduce", nodes, per_node, batch, exchange="mpi"),
        Layout("allreduce", nodes, per_node, batch, exchange="mpi", shard="optimizer"),
        Layout("allreduce", nodes, per_node, batch, shard="parameters"),
    ]
    if any(layer.splits for layer in cal.layers) and ranks % 2 == 0 and per_node % 2 == 0:
        made.append(Layout("allreduce", nodes, per_node, batch, tensor=2))
    for ps in sorted({1, nodes}):
        if ps < ranks:
            made += [Layout(strategy, nodes, per_node, batch, ps=ps) for strategy in ("ps-sync", "ps-async")]
    made = [predict(cal, _best_buckets(cal, layout)) for layout in made]
    for stages in (2, 4):
        if ranks % stages == 0 and stages <= len(cal.layers):
            candidates = [
                predict(cal, Layout("pipeline", nodes, per_node, batch, stages=stages, micro_batches=micro))
                for micro in (4, 8, 16)
                if batch // (ranks // stages) >= micro
            ]
            if candidates:  # (the fastest micro-batch count)
                made.append(min(candidates, key=lambda prediction: prediction.step))
    return made


def _best_buckets(cal, layout):
    """``layout`` with the bucket size that hides the most behind backward, where the calibration says
    backward hides any and a size other than the default hides more."""
    if not layout.buckets or cal.overlap <= 0:
        return layout
    size, left = best_bucket(cal, layout)
    if left < exposed(cal, layout, layout.bucket_mb * MIB) * (1 - 1e-9):
        return dataclasses.replace(layout, bucket_mb=size)
    return layout


@dataclasses.dataclass(frozen=True)
class Row:
    """One layout at one node count: its prediction, its efficiency, and whether it fits memory."""

    nodes: int
    strategy: str
    layout: str
    samples_per_s: float
    step_ms: float
    efficiency: float
    memory_per_rank: int
    memory_per_node: int
    fits: bool
    parts: dict


def advise(cal, node_counts, per_node, batch_per_rank, memory_per_node):
    """``(rows, best, knee)``: every layout at every node count; the fastest that fits at each count (node
    count -> row); the largest count whose best efficiency is at least :data:`KNEE` (None: not even one)."""
    if per_node < 1 or batch_per_rank < 1:
        raise UsageError("--ranks-per-node and --batch-per-rank must be at least 1")
    # (the efficiency's reference, and the 1-node rows)
    at_one = predictions(cal, 1, per_node, batch_per_rank)
    one_node = max((made.samples_per_s for made in at_one), default=0.0)
    rows = []
    for nodes in node_counts:
        for made in at_one if nodes == 1 else predictions(cal, nodes, per_node, batch_per_rank):
            layout = made.layout
            rows.append(
                Row(
                    nodes,
                    layout.strategy,
                    layout.describe(),
                    made.samples_per_s,
                    made.step * 1e3,
                    made.samples_per_s / (nodes * one_node) if one_node else 0.0,
                    made.memory,
                    made.node_memory,
                    made.node_memory <= memory_per_node,
                    {
                        name: getattr(made, name) * 1e3
                        for name in ("compute", "exchange", "optimizer", "bubble", "wait", "loop")
                    },
                )
            )
    best = fastest(rows)
    return rows, best, knee(best)


def fastest(rows):
    """``{nodes: row}``: the fastest of ``rows`` that fits at each node count."""
    best = {}
    for row in rows:
        if row.fits and (row.nodes not in best or row.samples_per_s > best[row.nodes].samples_per_s):
            best[row.nodes] = row
    return best


def knee(best):
    """The largest node count of ``best`` (node count -> row) whose efficiency is at least :data:`KNEE`."""
    paying = [nodes for nodes, row in best.items() if row.efficiency >= KNEE]
    return max(paying) if paying else None


def per_strategy(rows):
    """``{strategy: (best, knee)}``: each strategy's fastest layout that fits at each node count, and the
    largest count where it keeps :data:`KNEE` of linear scaling from the best one-node layout of any strategy
    (what to run if the strategy is chosen for other reasons: ps-async's tolerance of stragglers, a pipeline
    for a model too large for one rank)."""
    strategies = dict.fromkeys(row.strategy for row in rows)
    made = {strategy: fastest([row for row in rows if row.strategy == strategy]) for strategy in strategies}
    return {strategy: (best, knee(best)) for strategy, best in made.items()}


COLUMNS = [
    ("nodes", "nodes", "{}"),
    ("layout", "layout", "{}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("step_ms", "step ms", "{:.2f}"),
    ("efficiency", "efficiency", "{:.2f}"),
    ("memory_per_rank", "MiB/rank", "{:,.0f}"),
    ("fits", "fits", "{}"),
]


def buckets(cal, node_counts, per_node, batch_per_rank):
    """``{nodes: (MiB, seconds left at the calibrated overlap, seconds left were all of it hidden, seconds
    left by one bucket of everything)}`` for ``allreduce --exchange mpi`` at each node count of more than one
    rank."""
    made = {}
    for nodes in node_counts:
        if nodes * per_node > 1:
            layout = Layout("allreduce", nodes, per_node, batch_per_rank * nodes * per_node, exchange="mpi")
            size, best = best_bucket(cal, layout)
            hidden, one = hideable(cal, layout, size * MIB)  # (one: one bucket of everything, all of it left)
            made[nodes] = size, one - cal.overlap * hidden, best, one
    return made
