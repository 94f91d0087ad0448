"""Who does what: each rank's role and communicators, from one ``Comm.Split``.

Roles are decided once, from the world communicator, by the pure function
:func:`assign_roles`; ranks then split the world by role.  Worker 0 of the
worker communicator is the chief: it initialises parameters, writes metrics
and checkpoints.  The node-local communicator (``Split_type`` shared memory)
gives each rank its local index, which picks its GPU.
"""

import collections
import dataclasses
import os
import socket

import numpy as np
from mpi4py import MPI

from . import comm as mpi

WORKER, PS = "worker", "ps"


def assign_roles(node_of_rank, num_ps):
    """Roles for every rank, given the node index of each rank.

    ps ranks are spread across nodes: one per node before a second on any
    node, taking the last ranks of each node (schedulers fill nodes from rank
    0, so worker 0 -- the chief -- stays on the first node).

    >>> assign_roles([0, 0, 1, 1], 2)
    ['worker', 'ps', 'worker', 'ps']
    """
    size = len(node_of_rank)
    if not 0 <= num_ps < size:
        raise ValueError(f"{num_ps} ps ranks leave no worker among {size} ranks")
    by_node = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    queues = [list(reversed(ranks)) for _, ranks in sorted(by_node.items())]
    roles, chosen = [WORKER] * size, 0
    while chosen < num_ps:
        for queue in queues:
            if queue and chosen < num_ps:
                roles[queue.pop(0)] = PS
                chosen += 1
    return roles


@dataclasses.dataclass
class Cluster:
    """This rank's place in the job."""

    world: MPI.Comm
    roles: list  # role of every world rank
    role_comm: MPI.Comm  # ranks sharing this rank's role (the worker communicator for workers)
    node: MPI.Comm  # ranks on this node
    node_index: int
    num_nodes: int
    host: str
    origin: list = None  # each rank's rank at launch (they differ once an elastic run lost ranks)
    launch_roles: list = None  # every rank's role at launch, the lost ones' too
    node_of_rank: list = None  # every rank's node index (build_cluster's node layout)

    def __post_init__(self):
        if self.origin is None:
            self.origin = list(range(self.world.Get_size()))
        if self.launch_roles is None:
            self.launch_roles = list(self.roles)

    def survivors(self, world, lost):
        """Collective over ``world`` (the survivors of ``lost``, ranks of this cluster): their cluster, same
        roles."""
        kept = [rank for rank in range(self.size) if rank not in lost]
        return build_cluster(
            world,
            roles=[self.roles[rank] for rank in kept],
            origin=[self.origin[rank] for rank in kept],
            launch_roles=self.launch_roles,
        )

    @property
    def rank(self):
        return self.world.Get_rank()

    @property
    def size(self):
        return self.world.Get_size()

    @property
    def role(self):
        return self.roles[self.rank]

    @property
    def workers(self):
        """The worker communicator (None on non-workers)."""
        return self.role_comm if self.role == WORKER else None

    @property
    def num_workers(self):
        return self.roles.count(WORKER)

    @property
    def worker_index(self):
        return self.role_comm.Get_rank() if self.role == WORKER else None

    @property
    def chief_rank(self):
        """World rank of worker 0."""
        return self.roles.index(WORKER)

    @property
    def is_chief(self):
        return self.rank == self.chief_rank

    @property
    def local_rank(self):
        return self.node.Get_rank()

    @property
    def local_size(self):
        return self.node.Get_size()

    @property
    def nodes_alike(self):
        """Whether every node holds as many of the job's ranks."""
        counts = collections.Counter(self.node_of_rank).values()
        return min(counts) == max(counts)

    def table(self, device, data="", holds=""):
        """Collective: the chief gets the role table as text, others None.

        ``holds``: this rank's part of the model (a ps shard, a pipeline stage, a tensor part); ``data``: how
        it holds its data (in memory or streamed, and why).  Each column is left out where no rank has one.
        """
        # the pid lets a user map a launcher's "PID 4711 killed by signal 9" back to a rank
        # the node is MPI's (the ranks that share memory), which a host name alone may not tell apart
        # (a ps: among the ps)
        index = self.worker_index if self.role == WORKER else self.role_comm.Get_rank()
        row = (
            self.rank,
            self.host,
            self.node_index,
            os.getpid(),
            self.local_rank,
            self.role,
            index,
            device,
            holds,
            data,
        )
        rows = self.world.gather(row, root=self.chief_rank)  # start-up only, small strings
        if rows is None:
            return None
        header = ("rank", "host", "node", "pid", "local", "role", "index", "device", "holds", "data")
        kept = [column for column in range(len(header)) if column < 8 or any(r[column] for r in rows)]
        rows, header = [[r[c] for c in kept] for r in rows], [header[c] for c in kept]
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*header)] + [fmt.format(*map(str, r)) for r in rows]
        return "\n".join(lines)

    def free(self):
        """Free the communicators this cluster split off the world (once: a second call does nothing)."""
        for comm in (self.role_comm, self.node):
            if comm != MPI.COMM_NULL:
                comm.Free()  # (mpi4py nulls the handle)


def node_layout(world):
    """``(node communicator, node index, number of nodes, node index of every rank)``."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    is_leader = node.Get_rank() == 0
    leaders = world.Split(0 if is_leader else MPI.UNDEFINED, key=world.Get_rank())
    index = np.zeros(1, dtype=np.int32)
    if is_leader:
        index[0] = leaders.Get_rank()
        leaders.Free()
    mpi.bcast(node, index, root=0)
    every = np.empty(world.Get_size(), dtype=np.int32)
    mpi.allgather(world, index, every)
    return node, int(index[0]), int(every.max()) + 1, every.tolist()


def build_cluster(world=None, num_ps=0, roles=None, origin=None, launch_roles=None):
    """Collective over ``world``: decide roles (or take ``roles``) and split communicators.

    ``origin`` and ``launch_roles``: for a world of survivors (:meth:`Cluster.survivors`).
    """
    world = MPI.COMM_WORLD if world is None else world
    node, node_index, num_nodes, node_of_rank = node_layout(world)
    roles = assign_roles(node_of_rank, num_ps) if roles is None else list(roles)
    role_comm = world.Split(0 if roles[world.Get_rank()] == WORKER else 1, key=world.Get_rank())
    return Cluster(
        world=world,
        roles=roles,
        role_comm=role_comm,
        node=node,
        node_index=node_index,
        num_nodes=num_nodes,
        host=socket.gethostname(),
        origin=origin,
        launch_roles=launch_roles,
        node_of_rank=node_of_rank,
    )
