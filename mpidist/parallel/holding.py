"""What one rank holds of the model under the run's layout, known before any strategy exists.

The start-up memory check (``loop/setup.py``) prices this rank's share, not
the whole model on every rank: a pipeline stage's ranks hold their stage's
parameters (with ``--tensor T``, about 1/T of them each), a tensor part
about 1/T of the model, a worker under ``--shard optimizer`` 1/W of the
optimizer state, one under ``--shard parameters`` 1/W of everything and two
gathered units.  A split model is never assembled on one rank (its
checkpoints are sharded, written and read by the ranks that hold it, and the
run's result is its last checkpoint).  Layouts that keep a whole copy per rank
are priced as before: the whole model, and the chief's copy of it, on every
rank.
"""

import dataclasses
import math

import numpy as np

from ..nn.tensor import split_model
from .data.unit_routes import sharing_reason
from .data.units import ShardedUnits, gathered_elements, node_sharing, units_of, window_bytes
from .mesh import MeshShape
from .pipeline.balance import balance_by_parameters, layer_costs, parse_balance
from .pipeline.stage import StageLayout


@dataclasses.dataclass(frozen=True)
class Held:
    """Elements this rank holds: of parameters, of each optimizer state array, of whole-model arrays it
    assembles, and of gradients (None: as many as parameters); ``part`` says which part of the model it holds
    ("" for all of it), ``assembles`` what its ``gathered`` elements are."""

    params: int
    optimizer: int
    gathered: int
    part: str = ""
    grads: int = None
    assembles: str = "assembling the whole model's state for checkpoints"


def held(settings, cluster, model, optimizer_arrays, prefetch=True):
    """This rank's :class:`Held` of ``model`` (a map of shapes) under ``settings`` on ``cluster``.

    ``optimizer_arrays``: the optimizer's state arrays per parameter (Adam's
    two moments, SGD's velocity); ``prefetch``: under ``--shard parameters``,
    whether two units are in flight (:func:`fully_sharded_held`).
    """
    whole, tensor = model.num_params, max(int(settings.tensor), 1)
    if settings.strategy == "pipeline":
        balance = parse_balance(settings, model) or balance_by_parameters(layer_costs(model), settings.stages)
        layout = StageLayout(model, balance, cluster.rank, cluster.size, tensor)
        params = layout.param_hi - layout.param_lo
        if tensor > 1:  # (a part splits some layers and holds the others whole: counted, not divided)
            params = split_model(layout.stage_model(model), layout.part, tensor, buffers=False)[0].num_params
        part = f"stage {layout.stage} of {layout.stages}" + (
            f", part {layout.part} of {tensor}" if tensor > 1 else ""
        )
        return stage_held(params, part)
    if settings.strategy == "allreduce" and settings.shard == "parameters":
        return fully_sharded_held(settings, cluster, model, prefetch)
    if tensor > 1:
        part = MeshShape(cluster.size, parts=tensor).coordinates(cluster.rank)[2]  # (every rank a worker)
        params = split_model(model, part, tensor, buffers=False)[0].num_params  # (its layers held whole too)
        return Held(params, params, 0, f"tensor part {part} of {tensor}")
    if not (settings.strategy == "allreduce" and settings.shard == "optimizer"):
        return Held(whole, whole, whole)
    # the chief assembles the workers' slices of the optimizer state for a checkpoint
    return Held(
        whole,
        math.ceil(whole / max(cluster.num_workers, 1)),
        whole * (1 + (optimizer_arrays if cluster.is_chief else 0)),
        "a 1/W slice of the optimizer state",
    )


def fully_sharded_held(settings, cluster, model, prefetch=True):
    """A worker's :class:`Held` under ``--shard parameters``: its shard of every unit (parameters, gradients
    and optimizer state alike), and its slots of gathered units (two of each, one without ``prefetch``; the
    parameters' shared by the node's workers where they gather once per node).  With ``--tensor T``, a
    part's units are about ``1/T`` of the whole model's, sharded over the replicas."""
    tensor = max(int(settings.tensor), 1)
    replicas = max(cluster.num_workers // tensor, 1)
    units = units_of(
        model.offsets, model.num_params, settings.bucket_mb * (1 << 20) * tensor, model.dtype.itemsize
    )
    keep = not settings.reshard_after_forward
    sharing = shared_by(settings, cluster, units, keep, prefetch, model.dtype.itemsize)
    # (its index among the replicas, part fastest as the mesh orders them; once per node on several nodes,
    # the blocks go local index first: the first, the longest, bounds them all)
    index = (cluster.worker_index or 0) // tensor if sharing in (1, replicas) else 0
    shard = math.ceil(ShardedUnits(units, replicas, index).size / tensor)
    gathered = math.ceil(gathered_elements(units, keep, replicas, prefetch, sharing) / tensor)
    in_flight = "two unit(s)" if prefetch else "one unit(s)"
    assembles = (
        "every unit gathered from forward to backward, with its gradients"
        if keep
        else f"{in_flight} of parameters and as many of gradients gathered in flight"
    )
    return Held(shard, shard, gathered, f"1/{replicas} of every unit", grads=shard, assembles=assembles)


def shared_by(settings, cluster, units, keep, prefetch, itemsize):
    """The workers of this rank's node that read one copy of each gathered unit under ``--shard parameters``
    (:func:`~.data.units.node_sharing`), where the route can serve as far as this rank can tell (on CPUs,
    nodes alike, its shared windows' room: :func:`~.data.unit_routes.sharing_reason`); else 1."""
    tensor = max(int(settings.tensor), 1)
    sharing = node_sharing(settings.exchange, cluster.local_size, tensor)
    if sharing == 1 or settings.device == "gpu" or not cluster.nodes_alike:
        return 1
    replicas = max(cluster.num_workers // tensor, 1)
    windows = window_bytes(units, keep, replicas, prefetch, sharing, itemsize)
    return 1 if sharing_reason(np, windows) else sharing


def zero_bytes_per_param(shard, workers, state_arrays=2, itemsize=4):
    """Bytes a parameter per worker as the ZeRO paper counts them, gathered units left out: the parameter,
    its gradient and ``state_arrays`` of optimizer state, replicated (``shard`` "none"), the state sharded
    ("optimizer", stage 1) or all of it ("parameters", stage 3).  Float32 Adam: 16, ``8 + 8/W``, ``16/W``.

    >>> [zero_bytes_per_param(shard, 4) for shard in ("none", "optimizer", "parameters")]
    [16.0, 10.0, 4.0]
    """
    whole, state = 2 * itemsize, state_arrays * itemsize
    if shard == "optimizer":
        return whole + state / workers
    if shard == "parameters":
        return (whole + state) / workers
    return float(whole + state)


def held_bytes(held_elements, optimizer_arrays, itemsize):
    """Bytes of ``held_elements`` (a :class:`Held`): parameters and gradients, optimizer state, gathered
    arrays."""
    h = held_elements
    grads = h.params if h.grads is None else h.grads
    return itemsize * (h.params + grads + optimizer_arrays * h.optimizer + h.gathered)


def stage_held(params, part=""):
    """A pipeline stage's :class:`Held` of ``params`` parameters: its gradients twice (a micro-batch's, and
    the step's sum they are added into)."""
    return Held(params, params, 0, part, grads=2 * params)


def fitting_stages(model, optimizer_arrays, itemsize, limit):
    """``(stages, bytes of the largest)``: the fewest pipeline stages (balanced by parameters) whose largest
    stage's training state fits in ``limit`` bytes, or None where even one layer a stage does not fit."""
    costs = layer_costs(model)
    for stages in range(2, len(model.layers) + 1):
        offsets = StageLayout(model, balance_by_parameters(costs, stages), 0, stages).param_offsets
        largest = max(hi - lo for lo, hi in zip(offsets[:-1], offsets[1:]))
        need = held_bytes(stage_held(largest), optimizer_arrays, itemsize)
        if need <= limit:
            return stages, need
    return None
