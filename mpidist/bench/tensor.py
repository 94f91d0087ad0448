"""A transformer block split over the ranks of tensor groups (``--tensor T``) against the same block unsplit.

Every rank trains the same global batch at ``T = 1`` (data parallel over all
ranks) and at ``T = 2`` (groups of two ranks, each holding half of the
block's heads and of its MLP, the groups data parallel): the rows alternate
step by step.  What ``T = 2`` divides is the memory of training (the
parameters, gradients and optimizer state a rank holds); what it costs is
the sum of activations over the group, twice per block in forward and twice
in backward, counted here in bytes a rank sums per step.
"""

import numpy as np

from .. import nn
from ..nn.tensor import operators
from ..runtime.cluster import build_cluster
from .rows import _allreduce
from .timing import synced_alternating

LENGTH, WIDTH, HEADS, CLASSES = 32, 128, 4, 10  # a sequence of 32 tokens of 128 features, 4 heads
# (10 classes: the loss rows._allreduce gives every bench model)
SEQUENCES_PER_RANK = 32  # the global batch: this times the ranks


def transformer_block():
    """One pre-norm block (attention and a GELU MLP of 4 x WIDTH), mean-pooled to a classifier."""
    return nn.Sequential(
        [nn.TransformerBlock(HEADS), nn.SequencePool(), nn.Dense(CLASSES, init="glorot")],
        (LENGTH, WIDTH),
        xp=np,
        dtype=np.float32,
    )


def _stepper(strategy, x, y, weight):
    """A training step of ``strategy`` on ``(x, y)``, numbered on."""
    numbers = iter(range(1 << 30))
    return lambda: strategy.train_step(x, y, weight, next(numbers))


def _summed_bytes(strategy, step):
    """The bytes one ``step()`` of ``strategy`` sums over its tensor group (0 at ``T = 1``): the sums counted
    through a stand-in for the group's ``Allreduce``, put back after."""
    if strategy.mesh.size("part") == 1:
        return 0
    moved, total = [], strategy.tensor.sum

    def counted(array):
        moved.append(int(array.nbytes))
        total(array)

    for operator in operators(strategy.model):
        operator.reduce = counted
    step()
    for operator in operators(strategy.model):
        operator.reduce = total
    return sum(moved)


def tensor_rows(world, seconds, counts=(1, 2)):
    """Rows for each ``T`` of ``counts`` that divides the ranks: samples/s, its ratio to ``T = 1``, the bytes
    a rank holds and the bytes its tensor sums move per step."""
    ranks = world.Get_size()
    counts = [count for count in counts if ranks % count == 0]
    cluster = build_cluster(world)
    batch = SEQUENCES_PER_RANK * ranks
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, LENGTH, WIDTH), dtype=np.float32)
    y = rng.integers(0, CLASSES, batch)
    strategies, steps, moved = {}, {}, {}
    for count in counts:
        # (MPI's Allreduce for both: a copy of the model per rank, as on GPUs, so the bytes compare per rank)
        strategy = _allreduce(transformer_block(), cluster, "adam", exchange="mpi", tensor=count)
        groups = ranks // count
        lo, hi = strategy.worker_index * batch // groups, (strategy.worker_index + 1) * batch // groups
        step = _stepper(strategy, x[lo:hi], y[lo:hi], (hi - lo) / batch)
        step()  # warm-up, not counted
        moved[count] = _summed_bytes(strategy, step)
        strategies[count], steps[count] = strategy, step
    per_step = synced_alternating(world, steps, seconds)
    rows = []
    for count, strategy in strategies.items():
        held = world.gather(strategy.held_bytes(), root=0)
        if world.Get_rank() == 0:
            rows.append(
                {
                    "model": f"transformer block {LENGTH}x{WIDTH}, {HEADS} heads",
                    "tensor": count,
                    "groups": ranks // count,
                    "samples_per_s": batch / per_step[count],
                    "params_bytes": max(h["params"] for h in held),
                    "optimizer_state_bytes": max(h["optimizer_state"] for h in held),
                    "summed_bytes_per_step": moved[count],
                }
            )
        strategy.free()
    cluster.free()
    if rows:
        first = rows[0]["samples_per_s"]
        for row in rows:
            row["vs_t1"] = row["samples_per_s"] / first
    return rows


TENSOR_COLUMNS = [
    ("model", "model", "{}"),
    ("tensor", "T", "{}"),
    ("groups", "groups", "{}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("vs_t1", "vs T=1", "{:.2f}x"),
    ("params_bytes", "params B/rank", "{:,}"),
    ("optimizer_state_bytes", "optimizer B/rank", "{:,}"),
    ("summed_bytes_per_step", "tensor-summed B/step", "{:,}"),
]
