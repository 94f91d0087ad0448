"""The grid of ranks a run's layout makes: named axes, each rank's coordinates, one communicator per axis.

The ranks that train form a grid of ``replicas x stages x parts``
(data-parallel replicas, pipeline stages, tensor parts), numbered with the
part fastest: rank ``r`` is part ``r % T`` of stage ``(r // T) % P`` of
replica ``r // (P T)``.  Consecutive ranks share a tensor group, which keeps
a group (the run's most frequent, latency-bound sums) within a node wherever
``T`` divides a node's ranks; an ``allreduce`` run is the grid with one
stage.  This is torchtitan's ``parallel_dims`` and Megatron's parallel state:
a group of an axis is the ranks whose other coordinates are all equal, and
whatever talks within a group (a tensor group's sums, a pipeline's transfers,
the replicas' gradient exchange) asks the mesh for that axis's communicator
instead of doing rank arithmetic.

:class:`MeshShape` is the arithmetic (pure, tested by tables);
:class:`Mesh` adds the communicators, made once by the strategy that lays
the ranks out and freed by it once.  A new axis (fully sharded data
parallelism's shards) is a name in :data:`AXES` at its place in the order and
its size in :attr:`MeshShape.sizes`: coordinates, ranks and groups follow
from the order.
"""

import dataclasses

from mpi4py import MPI

#: The axes, slowest first: ranks number the last fastest.
AXES = ("replica", "stage", "part")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A grid of ``ranks`` in ``stages`` stages of ``parts`` parts each (the replicas are what is left).

    >>> shape = MeshShape(8, stages=2, parts=2)
    >>> shape.sizes, shape.coordinates(5), shape.rank_of(replica=1, stage=0, part=1)
    ((2, 2, 2), (1, 0, 1), 5)
    """

    ranks: int
    stages: int = 1
    parts: int = 1

    @staticmethod
    def divides(ranks, stages=1, parts=1):
        """Whether a grid of ``stages`` x ``parts`` (at least 1 each) divides ``ranks`` (at least 1): what the
        settings' checks ask before any mesh exists, and what a mesh refuses."""
        return min(ranks, stages, parts) >= 1 and ranks % (stages * parts) == 0

    def __post_init__(self):
        if not self.divides(self.ranks, self.stages, self.parts):
            raise ValueError(
                f"{self.stages} stage(s) x {self.parts} part(s) do not divide {self.ranks} rank(s)"
            )

    @property
    def sizes(self):
        """The size of each axis of :data:`AXES`, in order."""
        return self.ranks // (self.stages * self.parts), self.stages, self.parts

    def size(self, axis):
        """The number of ranks along ``axis``."""
        return self.sizes[AXES.index(axis)]

    def coordinates(self, rank):
        """``(replica, stage, part)`` of ``rank``: its digits in the mixed radix of :attr:`sizes`."""
        digits = []
        for size in reversed(self.sizes[1:]):
            rank, digit = divmod(rank, size)
            digits.append(digit)
        return (rank, *reversed(digits))

    def rank_of(self, *coordinates, **named):
        """The rank at these coordinates (in the order of :data:`AXES`, or by name; 0 where not given)."""
        given = dict(zip(AXES, coordinates), **named)
        rank = 0
        for axis, size in zip(AXES, self.sizes):
            rank = rank * size + given.get(axis, 0)
        return rank

    def group(self, axis, rank):
        """``(colour, key)`` of ``rank`` in ``axis``'s groups: the ranks of one colour differ in that
        coordinate alone, and each one's key is its coordinate on the axis (its rank in the group)."""
        coordinates = list(self.coordinates(rank))
        key = coordinates.pop(AXES.index(axis))
        colour = 0
        for other, coordinate in zip([a for a in AXES if a != axis], coordinates):
            colour = colour * self.size(other) + coordinate
        return colour, key


class Mesh:
    """This rank's place in a :class:`MeshShape` over ``comm``, and a communicator per axis.

    An axis whose group is all of ``comm`` (every other axis of one rank)
    uses ``comm`` itself, and an axis of one rank ``COMM_SELF``: nothing is
    split where nothing needs it, so a plain data-parallel run exchanges over
    the worker communicator as it always has.  Every other axis is split off
    ``comm`` here (collective) and freed by :meth:`free`.

    Args:
        comm: the ranks laid out (the workers, or every rank of a pipeline); None for a process alone (every
            axis's communicator None, as a strategy without a cluster has no worker communicator).
        stages, parts: the sizes of those axes.
        private: axes that get a communicator of their own even where their group is all of ``comm``: a
            pipeline's pipe, whose point-to-point tags must not meet other messages between the same ranks.
    """

    def __init__(self, comm, stages=1, parts=1, private=()):
        self.shape = MeshShape(1 if comm is None else comm.Get_size(), int(stages), int(parts))
        self.rank = 0 if comm is None else comm.Get_rank()
        self.coordinates = self.shape.coordinates(self.rank)
        self._comms, self._split = {}, []
        for axis in AXES:
            self._comms[axis] = self._group(comm, axis, axis in private)

    def _group(self, comm, axis, private):
        if comm is None or (self.shape.size(axis) == self.shape.ranks and not private):
            return comm
        if self.shape.size(axis) == 1:
            return MPI.COMM_SELF
        split = comm.Split(*self.shape.group(axis, self.rank))
        self._split.append(split)
        return split

    def size(self, axis):
        """The number of ranks along ``axis``."""
        return self.shape.size(axis)

    def index(self, axis):
        """This rank's coordinate on ``axis`` (its rank in :meth:`comm` of that axis)."""
        return self.coordinates[AXES.index(axis)]

    def comm(self, axis):
        """The communicator of this rank's group along ``axis`` (ranked by the coordinate on it)."""
        comm = self._comms[axis]
        if comm is _FREED:
            raise RuntimeError(f"this mesh was freed: its {axis} communicator is gone")
        return comm

    def is_last(self, axis):
        """Whether this rank is the last along ``axis``."""
        return self.index(axis) == self.size(axis) - 1

    def owned(self):
        """The communicators split here (a recovery revokes them with the world)."""
        return list(self._split)

    def free(self):
        """Collective over each group: free the communicators split here (once: a second call does
        nothing)."""
        for axis, comm in self._comms.items():
            if any(comm is split for split in self._split):
                comm.Free()  # (mpi4py nulls the handle)
                self._comms[axis] = _FREED
        self._split = []


class ReplicaWorkers:
    """Mixin of a strategy whose workers are its :attr:`mesh` (a :class:`Mesh`): the workers it exchanges
    with are its replica axis (the same part of every tensor group)."""

    @property
    def worker_comm(self):
        return self.mesh.comm("replica")

    @property
    def worker_index(self):
        return self.mesh.index("replica")


#: What an axis's communicator is once :meth:`Mesh.free` freed it.
_FREED = object()
