"""``--tensor T``: each large layer split across the ``T`` ranks of a tensor group (Megatron-style).

The arithmetic is :mod:`mpidist.nn.tensor` (which layers split, and how);
this module places the ranks and carries the sums.  Ranks are grouped by
consecutive numbers, ``T`` at a time, so that a tensor group stays within a
node wherever ``T`` divides the ranks a node has (its two sums a layer pair
are the run's most frequent, latency-bound collectives).  The groups then
form the data-parallel (``allreduce``) or pipeline layout as whole ranks
would: the ranks of one part number in every group exchange gradients
among themselves.

A part's parameters are slices of the whole model's flat buffer (``where``):
every rank takes its slices of the whole model's initial parameters or of a
checkpoint, and the chief gathers the slices back into the whole model's
layout for a checkpoint, which therefore resumes on any layout.
"""

import numpy as np
from mpi4py import MPI

from ..nn.sequential import walk
from ..nn.tensor import TensorCopy, TensorSum, operators, replicated, split_layers, split_model
from ..runtime import comm as mpi
from ..runtime import recorder
from ..runtime.errors import UsageError
from ..runtime.xp import to_host
from .registry import Option

TRACER = recorder.tracer()

#: The setting, declared by each strategy it composes with.
TENSOR = Option("tensor", 1, "allreduce, pipeline: ranks each large layer is split across (tensor parallelism: Dense "
                             "pairs by columns then rows, attention by heads, embeddings by vocabulary), consecutive "
                             "ranks forming a group; a run is data x pipeline x tensor",
                why="the parts of a tensor group sum activations at every split layer, so they take each step "
                    "together on one batch and hold the optimizer state of their slices: ps-sync and ps-async keep "
                    "parameters and state on ps ranks, and local-sgd's workers step apart")


def check_tensor(settings, world_size, stages=1):
    """Refuse a ``--tensor`` the ranks cannot be laid out for, or that a chosen setting cannot run with."""
    tensor = settings.tensor
    if tensor < 1:
        raise UsageError(f"--tensor must be at least 1, got {tensor}")
    if tensor == 1:
        return
    if world_size % (tensor * stages):
        layout = f"--stages {stages} x --tensor {tensor}" if stages > 1 else f"--tensor {tensor}"
        raise UsageError(f"{layout} does not divide the {world_size} ranks (ranks = data-parallel groups x "
                         f"{'stages x ' if stages > 1 else ''}tensor parts)")
    refused = [(settings.elastic, "--elastic (a lost rank takes its part of every split layer)"),
               (getattr(settings, "shard", "none") != "none", f"--shard {getattr(settings, 'shard', '')}"),
               (getattr(settings, "compress", "none") != "none", f"--compress {getattr(settings, 'compress', '')}"),
               (getattr(settings, "exchange", "auto") in ("node", "shared-memory"),
                f"--exchange {getattr(settings, 'exchange', '')} (a tensor run sums gradients with MPI)"),
               (settings.replication == "in-graph", "--replication in-graph")]
    for refused_it, what in refused:
        if refused_it:
            raise UsageError(f"--tensor {tensor} does not combine with {what}")


def check_split(layers, parts, where="--model"):
    """Refuse (a UsageError) a model whose ``layers`` (built) cannot be split in ``parts`` (local, no MPI); returns
    notes for the chief: where nothing splits (every part holds and computes those layers whole)."""
    try:
        split = [split_layers(layers, part, parts) for part in range(parts)]
    except ValueError as err:
        raise UsageError(f"--tensor {parts}: {where}: {err}") from None
    if any(isinstance(node, (TensorCopy, TensorSum)) for _, node in walk(split[0])):
        return []
    return [f"note: --tensor {parts}: no layer of {where} splits (a Dense pair, attention, an embedding, a layer "
            f"with tensor_split): each of its {parts} parts holds and computes it whole"]


class TensorPart:
    """This rank's part of a model split over its tensor group: the part's model, communicators and map.

    Args:
        whole: the whole model (a :class:`~mpidist.nn.Sequential`).
        world: the ranks that train (split collectively here).
        parts: ``T``.
        group: this rank's tensor group (ranks ``group * T .. group * T + T - 1`` of the layout).
        part: this rank's part, ``0 .. T-1``.
        data: whether to split off the communicator of the same part of every group (the data-parallel
            workers of ``allreduce``; a pipeline has its own, a stage's part in every replica).
    """

    def __init__(self, whole, world, parts, group, part, data=True):
        self.parts, self.part = int(parts), int(part)
        self.comm = world.Split(group, key=part)            # the tensor group, by part
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        # (a launcher that deals ranks out to nodes in turn puts a group's parts on different nodes: said in the
        # role table, for every sum of activations then crosses the network)
        self.across_nodes = local.Get_size() < self.parts
        local.Free()
        self.data = world.Split(part, key=group) if data else None   # the same part of every group, by group
        self.whole, self.size = whole, whole.num_params
        self.model, self.where = split_model(whole, part, parts)
        self.shared = replicated(self.model)                # every part holds these alike: counted once
        for operator in operators(self.model):
            operator.reduce = self.sum
        self.gathered_where = None   # part 0's: every part's map, once gathered
        self.where_gathered = False

    def describe(self):
        """Role-table text: this rank's part, and whether its group spans nodes."""
        return f"part {self.part}/{self.parts}" + (" (group across nodes)" if self.across_nodes else "")

    def sum(self, array):
        """In place: ``array`` summed over the tensor group (one ``Allreduce``)."""
        with TRACER.span("tensor-sum", "exchange", size=int(array.size)):
            mpi.allreduce_sum(self.comm, array)

    def initial(self, seed):
        """The whole model's initial parameters from ``seed`` (host), as one process would draw them."""
        self.whole.init_params(seed)
        return to_host(self.whole.params)

    def take(self, whole):
        """This part's slice of a whole-model flat array (host), in this part's order."""
        return np.asarray(whole)[self.where]

    def agree(self, grads, skipped, norm):
        """Collective over the tensor group: ``(skipped anywhere, the whole model's squared gradient norm or None)``.

        A NaN in any part skips the step on every part; the norm (with
        ``norm`` set: ``--clip-norm``) counts the parts' split parameters once
        each and the shared ones once.
        """
        values = np.zeros(2)
        values[0] = float(skipped)
        if norm:
            host = to_host(grads)
            squares = float(np.dot(host, host))
            if self.part != 0:   # (the shared parameters: counted on part 0 alone)
                squares -= sum(float(np.dot(host[lo:hi], host[lo:hi])) for lo, hi in self.shared)
            values[1] = squares
        mpi.allreduce_sum(self.comm, values)
        return bool(values[0]), (float(values[1]) if norm else None)

    def gather(self, arrays, size):
        """Collective over the tensor group: the parts' ``arrays`` (name -> this part's flat host array) as
        whole-model arrays of ``size`` elements on part 0 (None elsewhere)."""
        comm, root = self.comm, 0
        counts = np.zeros(self.parts, dtype=np.int64)
        mpi.allgather(comm, np.array([len(self.where)], dtype=np.int64), counts)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if not self.where_gathered:   # (the map never changes: gathered once, a flag every part keeps alike)
            where = np.empty(int(counts.sum()), dtype=np.int64) if self.part == root else None
            self.gathered_where = mpi.gatherv(comm, self.where, where, counts, displs, root)
            self.where_gathered = True
        whole = {}
        for name in sorted(arrays):   # (the same order on every part)
            part = np.ascontiguousarray(arrays[name])
            received = np.empty(int(counts.sum()), dtype=part.dtype) if self.part == root else None
            mpi.gatherv(comm, part, received, counts, displs, root)
            if self.part == root:
                whole[name] = np.zeros(size, dtype=part.dtype)
                whole[name][self.gathered_where] = received
        return whole if self.part == root else None

    def free(self):
        """Free the two communicators (once)."""
        for comm in (self.comm, self.data):
            if comm is not None:
                comm.Free()
        self.comm = self.data = None
