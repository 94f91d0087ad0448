"""This rank's part of a model split over its tensor group (``--tensor T``): the part's model and map, and
the group's sums.  Registered as the split of the mesh's ``part`` axis
(:func:`~mpidist.parallel.parts.split_over` hands models to it)."""

import numpy as np
from mpi4py import MPI

from ...nn.precision import squared_sum
from ...nn.tensor import operators, replicated, split_model
from ...runtime import comm as mpi
from ...runtime import recorder
from ..parts import gather_placed
from ..registry import register_split
from ..verdict import agree

TRACER = recorder.tracer()


@register_split("part")
class TensorPart:
    """This rank's part of a model split over its tensor group: the part's model and map, and the group's
    sums.

    Args:
        whole: the whole model (a :class:`~mpidist.nn.Sequential`).
        mesh: the run's :class:`~mpidist.parallel.mesh.Mesh` (its ``part`` axis is the tensor group).
        writes: whether this part writes its regions of the whole model (the first data-parallel replica's
            parts; a pipeline stage's are written by every replica, of which its gather takes the first's).
        buffers: make the part's flat buffers (False: the strategy binds its layers elsewhere).
    """

    def __init__(self, whole, mesh, writes, buffers=True):
        self.parts, self.part = mesh.size("part"), mesh.index("part")
        self.comm = mesh.comm("part")  # (the mesh's: it frees it)
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        # (a launcher that deals ranks out to nodes in turn puts a group's parts on different nodes: said in
        # the role table, for every sum of activations then crosses the network)
        self.across_nodes = local.Get_size() < self.parts
        local.Free()
        #: this part's regions of the whole model's parameters
        self.model, self.placement = split_model(whole, self.part, self.parts, writes=writes, buffers=buffers)
        whole.shapes_only = True  # (its replicated layers are bound to the part's buffers now)
        self.shared = replicated(self.model)  # every part holds these alike: counted once
        for operator in operators(self.model):
            operator.reduce = self.sum

    def describe(self):
        """Role-table text: this rank's part, and whether its group spans nodes."""
        return f"part {self.part}/{self.parts}" + (" (group across nodes)" if self.across_nodes else "")

    def sum(self, array):
        """In place: ``array`` summed over the tensor group (one ``Allreduce``)."""
        with TRACER.span("tensor-sum", "exchange", size=int(array.size)):
            mpi.allreduce_sum(self.comm, array)

    def initial(self, seed, out=None):
        """This part's initial parameters from ``seed`` (host, in this part's order, into ``out`` where
        given): its slices of the whole model's, drawn alone
        (:meth:`~mpidist.nn.placement.Placement.initial`)."""
        out = np.empty(self.placement.size, dtype=self.model.dtype) if out is None else out
        return self.placement.initial(seed, out)

    def squares(self, grads, whole=None, shared=None):
        """This part's share of the whole model's squared gradient norm (on the arrays' device): its split
        parameters, and the shared ones on part 0 alone (every part holds them alike).  ``whole``: the squared
        norm of ``grads``, where it was taken already (the exchange's); ``shared``: where the shared ones lie
        in ``grads``, where it is not the part's buffer (a worker's shards of it)."""
        squares = squared_sum(grads) if whole is None else whole
        if self.part != 0:
            ranges = self.shared if shared is None else shared
            squares -= sum(squared_sum(grads[lo:hi]) for lo, hi in ranges)
        return squares

    def verdict(self, grads, squares, loss, clip_norm, scale=1.0):
        """Collective over the tensor group: the step's :class:`~mpidist.parallel.verdict.Verdict` from this
        part's summed ``grads`` (``squares``: their squared norm, where taken already) and the ``loss``."""
        return agree(self.comm, self.squares(grads, squares), loss, clip_norm, scale=scale)[0]

    def within(self, whole, first_entry):
        """This part's regions as regions of ``whole``, whose entries from ``first_entry`` on are the model
        this part was split from (a pipeline stage's)."""
        return self.placement.within(whole, first_entry)

    def gather(self, arrays):
        """Collective over the tensor group: the parts' ``arrays`` (name -> this part's flat host array) as
        whole-model arrays on part 0 (None elsewhere)."""
        return gather_placed(self.comm, self.placement, arrays, 0)
