"""A pipeline stage's place: the layers and parameters it holds, and its links to the other ranks.

With ``N = D x P x T`` ranks there are ``D`` replicas of a ``P``-stage
pipeline, each stage ``T`` tensor parts: the grid of a
:class:`~mpidist.parallel.mesh.MeshShape` (rank ``r`` is part ``r % T`` of
stage ``(r // T) % P`` of replica ``r // (P T)``).  :class:`StageLayout`
says which layers and parameters a stage holds (no MPI); :class:`StageLinks`
moves activations and gradients along the pipe over the mesh's ``stage``
axis -- its replica's stages, of its own part (whole activations: every part
of a stage holds them after its parts' sum).
"""

import time

import numpy as np
from mpi4py import MPI

from ...nn import Sequential
from ...runtime import comm as mpi
from ...runtime import recorder
from ..mesh import MeshShape

TRACER = recorder.tracer()


class StageLayout:
    """Which stage of which replica a rank is, and which of the whole model's layers and parameters it holds.

    Args:
        model: the whole model (a :class:`~mpidist.nn.Sequential`).
        balance: layers per stage, in order (its length is ``P``).
        rank, world_size: this rank and the number of ranks (``D x P x T``).
        tensor: ``T``, the parts of each stage.
    """

    def __init__(self, model, balance, rank, world_size, tensor=1):
        self.balance = [int(size) for size in balance]
        #: the grid the ranks make (:class:`~mpidist.parallel.mesh.MeshShape`)
        self.shape = MeshShape(world_size, len(self.balance), int(tensor))
        self.replica, self.stage, self.part = self.shape.coordinates(rank)
        starts = np.concatenate([[0], np.cumsum(self.balance)]).astype(int)
        self.first_layer, self.end_layer = int(starts[self.stage]), int(starts[self.stage + 1])
        #: where each stage's parameters start in the whole model's flat buffer, and the end
        self.param_offsets = [sum(model.layer_params(i) for i in range(int(start))) for start in starts]
        self.in_shape = model.shapes[self.first_layer]
        self.out_shape = (
            model.shapes[self.end_layer] if self.end_layer < len(model.layers) else model.output_shape
        )

    @property
    def replicas(self):
        """``D``, replicas of the pipeline."""
        return self.shape.size("replica")

    @property
    def stages(self):
        """``P``, stages per replica."""
        return self.shape.size("stage")

    @property
    def parts(self):
        """``T``, tensor parts per stage."""
        return self.shape.size("part")

    @property
    def is_first(self):
        return self.stage == 0

    @property
    def is_last(self):
        return self.stage == self.stages - 1

    def rank_of(self, replica, stage, part=0):
        """The world rank of ``part`` of ``stage`` of ``replica``."""
        return self.shape.rank_of(replica, stage, part)

    def replica_of(self, rank):
        """The replica ``rank`` is in."""
        return self.shape.coordinates(rank)[0]

    @property
    def param_lo(self):
        """This stage's first parameter in the whole model's flat buffer."""
        return self.param_offsets[self.stage]

    @property
    def param_hi(self):
        """One past this stage's last parameter."""
        return self.param_offsets[self.stage + 1]

    def stage_model(self, model):
        """This stage's layers of ``model`` as a model of their own (sharing the layer objects)."""
        # (made on first use: a tensor part holds its own)
        return Sequential(
            model.layers[self.first_layer : self.end_layer],
            self.in_shape,
            xp=model.xp,
            dtype=model.dtype,
            buffers=False,
        )


class StageLinks:
    """A stage's transfers along its pipe, and the two groups it talks over (the mesh's, which frees them).

    ``pipe`` holds this replica's stages (ranked by stage); ``peers`` holds
    this stage in every replica (ranked by replica).  Time spent waiting for
    a neighbour counts as ``idle_s`` in ``figures``.

    Args:
        mesh: the run's :class:`~mpidist.parallel.mesh.Mesh`.
        layout: this rank's :class:`StageLayout`.
        figures: the strategy's figures (``idle_s`` is added to).
        track: the strategy's ``track(phase)`` (where the stall monitor sees this rank).
    """

    def __init__(self, mesh, layout, figures, track):
        self.layout, self.figures, self.track = layout, figures, track
        self.pipe, self.peers = mesh.comm("stage"), mesh.comm("replica")

    def recv(self, buffer, source, tag, flow=None):
        """Receive ``buffer`` from stage ``source``; ``flow``: ``(step, round)`` to draw the sender's arrow
        (--trace)."""
        start = time.perf_counter()
        self.track("exchange")
        with TRACER.span("recv", "pipeline", source=source, tag=tag):
            mpi.recv(self.pipe, buffer, source, tag)
            if flow is not None and TRACER.on:
                TRACER.flow(False, recorder.flow_id(self.layout.replica, *flow, source, tag), _carried(tag))
        self.track("compute")
        self.figures["idle_s"] += time.perf_counter() - start
        return buffer

    def isend(self, array, dest, tag, flow=None):
        """Start sending ``array`` to stage ``dest``: ``(request, buffer)``, the buffer kept until the request
        is done.

        ``flow``: ``(step, round)``: a traced send, an arrow starting here to
        the receive of the same (step, round, stage, tag); None: untraced.
        """
        if flow is None:
            return mpi.isend(self.pipe, array, dest, tag)
        with TRACER.span("send", "pipeline", to=dest, tag=tag):
            if TRACER.on:
                TRACER.flow(
                    True, recorder.flow_id(self.layout.replica, *flow, self.layout.stage, tag), _carried(tag)
                )
            return mpi.isend(self.pipe, array, dest, tag)

    def wait(self, requests):
        """Wait for every one of ``requests`` (a round's sends) to complete, as idle time."""
        start = time.perf_counter()
        self.track("exchange")
        MPI.Request.Waitall(requests)
        self.figures["idle_s"] += time.perf_counter() - start


def _carried(tag):
    """What a message of ``tag`` carries: even tags go forward, odd ones backward."""
    return "activations" if tag % 2 == 0 else "gradients"
