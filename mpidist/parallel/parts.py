"""A rank's part of the model along the mesh's tensor axis, as the strategies that compose with it see it.

``--tensor T`` splits each large layer across the ``T`` ranks of a tensor
group (Megatron-style); ``allreduce`` and ``pipeline`` compose with it, so
what they ask of it lives here, in the core: the setting and its checks
(:data:`TENSOR`, :func:`check_tensor`, :func:`check_split`), the whole model
as a tensor axis of one part (:class:`WholeModel`), the gather of placed
regions into whole-model arrays (:func:`gather_placed`), and
:func:`split_over`, which hands a model to the split its family registers
(:func:`~mpidist.parallel.registry.register_split`;
:class:`~mpidist.parallel.tensor.part.TensorPart`).  The arithmetic is
:mod:`mpidist.nn.tensor` (which layers split, and how).

Ranks are grouped by consecutive numbers, ``T`` at a time, so that a tensor
group stays within a node wherever ``T`` divides the ranks a node has (its
two sums a layer pair are the run's most frequent, latency-bound
collectives).  The groups then form the data-parallel (``allreduce``) or
pipeline layout as whole ranks would: the ranks of one part number in every
group exchange gradients among themselves.

A part's parameters are slices of the whole model's (its ``placement``):
every rank draws its slices of the whole model's initial parameters alone
(no rank draws or holds the whole), or takes them from a checkpoint; the
chief gathers the slices back into the whole model's layout for a
checkpoint, which therefore resumes on any layout.
"""

import numpy as np

from ..nn.placement import COLUMNS, Placement
from ..nn.precision import squared_sum
from ..nn.tensor import operators, split_layers
from ..runtime import comm as mpi
from ..runtime.errors import UsageError
from .mesh import MeshShape
from .registry import SPLITS, Option
from .verdict import decide

#: The setting, declared by each strategy it composes with.
TENSOR = Option(
    "tensor",
    1,
    "allreduce, pipeline: ranks each large layer is split across (tensor parallelism: Dense "
    "pairs by columns then rows, attention by heads, embeddings by vocabulary), consecutive "
    "ranks forming a group; a run is data x pipeline x tensor",
    why="the parts of a tensor group sum activations at every split layer, so they take each step "
    "together on one batch and hold the optimizer state of their slices: ps-sync and ps-async keep "
    "parameters and state on ps ranks, and local-sgd's workers step apart",
)


def check_tensor(settings, world_size, stages=1):
    """Refuse a ``--tensor`` the ranks cannot be laid out for, or that a chosen setting cannot run with."""
    tensor = settings.tensor
    if tensor < 1:
        raise UsageError(f"--tensor must be at least 1, got {tensor}")
    if tensor == 1:
        return
    if not MeshShape.divides(world_size, stages, tensor):
        layout = f"--stages {stages} x --tensor {tensor}" if stages > 1 else f"--tensor {tensor}"
        raise UsageError(
            f"{layout} does not divide the {world_size} ranks (ranks = data-parallel groups x "
            f"{'stages x ' if stages > 1 else ''}tensor parts)"
        )
    refused = [
        (settings.elastic, "--elastic (a lost rank takes its part of every split layer)"),
        (settings.shard == "optimizer", "--shard optimizer (--shard parameters does)"),
        (settings.compress != "none", f"--compress {settings.compress}"),
        (
            # (--shard parameters gathers each part's units once per node: its --exchange node is that)
            settings.exchange == "shared-memory"
            or (settings.exchange == "node" and settings.shard != "parameters"),
            f"--exchange {settings.exchange} (a tensor run sums gradients with MPI)",
        ),
        (settings.replication == "in-graph", "--replication in-graph"),
    ]
    for refused_it, what in refused:
        if refused_it:
            raise UsageError(f"--tensor {tensor} does not combine with {what}")


def check_split(layers, parts, where="--model"):
    """Refuse (a UsageError) a model whose ``layers`` (built) cannot be split in ``parts`` (local, no MPI);
    returns notes for the chief: where nothing splits (every part holds and computes those layers whole)."""
    try:
        split = [split_layers(layers, part, parts) for part in range(parts)]
    except ValueError as err:
        raise UsageError(f"--tensor {parts}: {where}: {err}") from None
    if operators(split[0]):
        return []
    return [
        f"note: --tensor {parts}: no layer of {where} splits (a Dense pair, attention, an embedding, a layer "
        f"with tensor_split): each of its {parts} parts holds and computes it whole"
    ]


def gather_placed(comm, placement, arrays, root, sends=True):
    """Collective over ``comm``: the regions each rank writes of its ``arrays`` (name -> the rank's flat host
    buffer, ordered as its :class:`~mpidist.nn.placement.Placement`), placed in whole-model arrays on ``root``
    (None elsewhere).  ``sends`` False: this rank gives nothing (a replica that is not the first).

    The regions travel as int64 tables (:meth:`~mpidist.nn.placement.Placement.describe`), the values as one
    ``Gatherv`` per array: no pickle, and no index array of the buffer's size on any rank.
    """
    rows = placement.describe() if sends else np.zeros((0, COLUMNS), dtype=np.int64)
    sizes = np.zeros((comm.Get_size(), 2), dtype=np.int64)  # (each rank's table entries and values)
    mpi.allgather(comm, np.array([rows.size, int(rows[:, 1].sum())], dtype=np.int64), sizes)
    starts = np.concatenate([np.zeros((1, 2), dtype=np.int64), np.cumsum(sizes, axis=0)[:-1]])
    entries, values = (int(total) for total in sizes.sum(axis=0))
    if values != placement.whole.num_params:  # (every rank knows: all raise alike)
        raise RuntimeError(
            f"the ranks write {values:,} elements of a model of {placement.whole.num_params:,} "
            "parameters: each must be written once (a tensor_split that gives a whole parameter "
            "to a part other than 0 alone?)"
        )
    here = comm.Get_rank() == root
    table = np.empty(entries, dtype=np.int64) if here else None
    mpi.gatherv(comm, rows.reshape(-1), table, sizes[:, 0], starts[:, 0], root)
    whole = {}
    for name in sorted(arrays):  # (the same order on every rank)
        array = arrays[name]
        part = np.ascontiguousarray(placement.written(array) if sends else array[:0])
        received = np.empty(values, dtype=part.dtype) if here else None
        mpi.gatherv(comm, part, received, sizes[:, 1], starts[:, 1], root)
        if here:
            whole[name] = np.zeros(placement.whole.num_params, dtype=part.dtype)
            Placement.fill(placement.whole, table.reshape(-1, COLUMNS), received, whole[name])
    return whole if here else None


class WholeModel:
    """What :class:`~mpidist.parallel.tensor.part.TensorPart` answers, for a rank that holds its model (or
    its stage) whole: a tensor axis of one part, whose group is this rank alone."""

    parts, part, placement, shared = 1, 0, None, ()

    def __init__(self, model):
        self.model = model

    def describe(self):
        return ""

    def squares(self, grads, whole=None, shared=None):
        return squared_sum(grads) if whole is None else whole

    def verdict(self, grads, squares, loss, clip_norm, scale=1.0):
        return decide(self.squares(grads, squares), loss, clip_norm, scale)

    def within(self, whole, first_entry):
        return Placement.of_entries(whole, first_entry, first_entry + len(self.model.entries))


def split_over(model, mesh, writes, buffers=True):
    """This rank's part of ``model`` over the ``mesh``'s tensor axis: the split its family registered for the
    ``part`` axis (:class:`~mpidist.parallel.tensor.part.TensorPart`), or :class:`WholeModel` where the axis
    has one part."""
    if mesh.size("part") == 1:
        return WholeModel(model)
    if "part" not in SPLITS:  # (the package's roll-call imports the tensor family, which registers it)
        raise RuntimeError("no split of the mesh's part axis is registered: import mpidist.parallel first")
    return SPLITS["part"](model, mesh, writes, buffers)
