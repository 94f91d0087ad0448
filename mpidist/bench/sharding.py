"""What a worker holds and sends under each ``allreduce`` layout, beside the ZeRO paper's accounting.

One row per layout, trained with Adam in float32 (the paper's case: a
parameter costs 4 bytes, its gradient 4 and Adam's two moments 8, so 16
bytes a parameter replicated): every worker holds it all (``--exchange
mpi``), ``--shard optimizer`` (ZeRO stage 1: the moments 8/W), ``--shard
parameters`` (stage 3: all of it 16/W, and the units gathered at a time, on
every rank as ``--exchange mpi`` gathers them).
The held bytes are each strategy's own report (the largest over the
ranks); the bytes sent per step are counted as a ring algorithm sends them
(a sum of ``B`` bytes over ``W`` ranks sends ``2 B (W - 1) / W``; a gather
or a reduce-scatter half that), the same rule for every row.
"""

import numpy as np
from mpi4py import MPI

from .. import nn
from ..parallel import FullyShardedStrategy
from ..parallel.holding import zero_bytes_per_param
from .rows import _allreduce, _model, _problem, adam


def _sent_per_step(strategy, layout, workers):
    """Bytes this worker sends a step, as a ring would (see the module's docstring)."""
    ring = (workers - 1) / workers
    grads = strategy.model.num_params * 4
    if layout == "parameters":
        return None  # (counted as it runs: FullyShardedStrategy's stats)
    return 2 * ring * grads + (ring * grads if layout == "optimizer" else 0)


def shard_rows(world, cluster, name, batch):
    """A row for each layout of model ``name``: bytes held a parameter (each kind, the largest rank's), the
    ZeRO accounting, and bytes sent a step (rank 0 gets the rows)."""
    workers = world.Get_size()
    _, x, y = _problem(name, batch, world.Get_rank())
    rows = []
    for layout in ("none", "optimizer", "parameters"):
        model = _model(name)  # (each layout trains a model of its own)
        if layout == "parameters":
            # (a copy a rank, as every row: held and sent alike by the ring's rule)
            strategy = FullyShardedStrategy(model, nn.loss_for(10, np), adam, cluster, seed=0, exchange="mpi")
            strategy.initialize()
        else:
            strategy = _allreduce(model, cluster, "adam", exchange="mpi", shard=layout)
        strategy.train_step(x, y, 1.0 / workers, 0)  # (Adam's moments made; the slots used once)
        before = strategy.stats().get("bytes_sent", 0)
        strategy.train_step(x, y, 1.0 / workers, 1)
        sent = strategy.stats().get("bytes_sent", 0) - before
        held = world.gather(strategy.held_bytes(), root=0)
        counted = _sent_per_step(strategy, layout, workers)
        sent = world.allreduce(sent if counted is None else counted, op=MPI.MAX)
        count = model.num_params
        strategy.free()
        if world.Get_rank() != 0:
            continue
        largest = max(held, key=lambda h: sum(h.values()))
        rows.append(
            {
                "model": name,
                "layout": {"none": "replicated", "optimizer": "shard optimizer"}.get(
                    layout, "shard parameters"
                ),
                "workers": workers,
                "params": count,
                **{f"{kind}_per_param": largest.get(kind, 0) / count for kind in KINDS},
                "held_per_param": sum(largest.values()) / count,
                "zero_per_param": zero_bytes_per_param(layout, workers),
                "sent_per_step": sent,
            }
        )
    return rows


KINDS = ("params", "grads", "optimizer_state", "gathered_units")

SHARD_COLUMNS = [
    ("model", "model", "{}"),
    ("layout", "layout", "{}"),
    ("workers", "W", "{}"),
    ("params_per_param", "params B", "{:.2f}"),
    ("grads_per_param", "grads B", "{:.2f}"),
    ("optimizer_state_per_param", "Adam B", "{:.2f}"),
    ("gathered_units_per_param", "gathered B", "{:.2f}"),
    ("held_per_param", "held B/param", "{:.2f}"),
    ("zero_per_param", "ZeRO's count", "{:.2f}"),  # (gathered units left out)
    ("sent_per_step", "sent B/step", "{:,.0f}"),
]
