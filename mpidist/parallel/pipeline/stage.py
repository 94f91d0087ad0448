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

import dataclasses
import time

import numpy as np
from mpi4py import MPI

from ...nn import Sequential
from ...runtime import comm as mpi
from ...runtime import recorder, routes
from ...runtime.ipc_link import IpcLink, probe
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

    How the bytes to and from each neighbouring stage travel is chosen here,
    once, from every stage's facts (:func:`~mpidist.runtime.routes.choose`):
    between GPU ranks of one node device to device by CUDA IPC
    (:class:`~mpidist.runtime.ipc_link.IpcLink`, over two communicators of
    its own made and freed here), else by MPI.

    Args:
        mesh: the run's :class:`~mpidist.parallel.mesh.Mesh`.
        layout: this rank's :class:`StageLayout`.
        figures: the strategy's figures (``idle_s`` is added to).
        track: the strategy's ``track(phase)`` (where the stall monitor sees this rank).
        device: the stage's arrays live on a GPU.
        node: this rank's node (the cluster's index of it).
        memory: the device operations IPC uses (default: CUDA's,
            :class:`~mpidist.runtime.cuda_ipc.CudaMemory`, where the device
            supports it); given, every stage of one node may use IPC.
    """

    def __init__(self, mesh, layout, figures, track, device=False, node=0, memory=None):
        self.layout, self.figures, self.track = layout, figures, track
        self.pipe, self.peers = mesh.comm("stage"), mesh.comm("replica")
        facts = _stage_facts(self.pipe, device, memory is not None, node)
        self._ipc, self._ipc_comms, refused = {}, [], None
        if any(_route(facts, stage, stage + 1) == "ipc" for stage in range(len(facts) - 1)):  # (every stage)
            self._ipc_comms = [self.pipe.Dup(), self.pipe.Dup()]  # headers, acknowledgements
            memory = memory if memory is not None else _cuda_memory()
            mapped = [stage for stage in self._neighbours() if _route(facts, layout.stage, stage) == "ipc"]
            refused = probe(self._ipc_comms[1], mapped, memory)
            if refused is not None:  # (on every stage: the probe's answer is agreed)
                self.free()
                facts = [dataclasses.replace(each, ipc=False) for each in facts]
        #: ``(route, why)`` to each neighbouring stage, by stage
        self.routes = {
            stage: routes.choose("send", routes.Facts.between(facts[layout.stage], facts[stage]))
            for stage in self._neighbours()
        }
        if refused is not None:
            self.routes = {stage: (route, f"{why}: {refused}") for stage, (route, why) in self.routes.items()}
        for stage, (route, _) in self.routes.items():
            if route == "ipc":
                self._ipc[stage] = IpcLink(*self._ipc_comms, stage, memory)

    def _neighbours(self):
        """The stages before and after this one (those there are)."""
        stage = self.layout.stage
        return [other for other in (stage - 1, stage + 1) if 0 <= other < self.layout.stages]

    def describe(self):
        """How this stage's sends travel, for the role table ("" where MPI moves host arrays)."""
        names = sorted({route for route, _ in self.routes.values()})
        return "" if names in ([], ["mpi"]) else "sends " + "/".join(names)

    def owned(self):
        """The communicators made here (a recovery revokes them with the world)."""
        return list(self._ipc_comms)

    def abandon(self):
        """After a lost rank: let go of the IPC links' device memory here, without MPI (their communicators
        are revoked with the world's)."""
        for link in self._ipc.values():
            link.abandon()
        self._ipc = {}

    def free(self):
        """Collective over the pipe: close the IPC links and free their communicators (a second call does
        nothing)."""
        # (a stage closes its link backward first: the pipe's closes then follow each other down the pipe)
        for stage in sorted(self._ipc):
            self._ipc[stage].close()
        self._ipc = {}
        for comm in self._ipc_comms:
            comm.Free()
        self._ipc_comms = []

    def recv(self, buffer, source, tag, flow=None):
        """Receive ``buffer`` from stage ``source``; ``flow``: ``(step, round)`` to draw the sender's arrow
        (--trace)."""
        start = time.perf_counter()
        self.track("exchange")
        with TRACER.span("recv", "pipeline", source=source, tag=tag):
            link = self._ipc.get(source)
            if link is not None:
                link.recv(buffer, tag)
            else:
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
            return self._isend(array, dest, tag)
        with TRACER.span("send", "pipeline", to=dest, tag=tag):
            if TRACER.on:
                TRACER.flow(
                    True, recorder.flow_id(self.layout.replica, *flow, self.layout.stage, tag), _carried(tag)
                )
            return self._isend(array, dest, tag)

    def _isend(self, array, dest, tag):
        link = self._ipc.get(dest)
        return mpi.isend(self.pipe, array, dest, tag) if link is None else link.isend(array, tag)

    def wait(self, requests):
        """Wait for every one of ``requests`` (a round's sends) to complete, as idle time."""
        start = time.perf_counter()
        self.track("exchange")
        MPI.Request.Waitall(requests)
        self.figures["idle_s"] += time.perf_counter() - start


def _route(facts, one, other):
    """The route of a send between stages ``one`` and ``other`` of ``facts``."""
    return routes.choose("send", routes.Facts.between(facts[one], facts[other]))[0]


def _stage_facts(pipe, device, ipc, node):
    """Collective over the pipe: every stage's :class:`~mpidist.runtime.routes.RankFacts`, by stage (``ipc``:
    IPC is possible wherever the device is, as with a stand-in for the device's memory; ``node``: this
    rank's)."""
    mine = routes.RankFacts.of(node, device, ipc, mpi.cuda_aware() if device else False)
    return pipe.allgather(mine)


def _cuda_memory():
    from ...runtime.cuda_ipc import CudaMemory

    return CudaMemory()


def _carried(tag):
    """What a message of ``tag`` carries: even tags go forward, odd ones backward."""
    return "activations" if tag % 2 == 0 else "gradients"
