"""How ``--shard parameters``' units travel: gathered into slots of each rank's own, or once per node.

A :class:`RankRoute` gathers a unit on every worker into parameter slots of
its own (one ``Allgather`` over every worker) and sums its gradients by one
``Reduce_scatter_block`` over every worker: ``L`` copies of each gathered
unit on a node of ``L`` workers.

A :class:`NodeRoute` holds one copy per node (DeepSpeed ZeRO++'s
hierarchical partitioning, PyTorch's hybrid sharding, for the parameters):
the parameter slots live in a window the node's ranks map together
(``Win.Allocate_shared``).  Worker ``c`` of the ``N`` that share local index
``l`` (one per node, the *cross* communicator) owns block ``l * N + c`` of
every unit, so the blocks local rank ``l`` of every node owns are one
contiguous slice, and gathering a unit is ``L`` concurrent ``Allgather`` s
between nodes, each of ``1/L`` of the unit, each filling its slice of the
node's slot in place; a node barrier then lets every rank read the unit.
Gradients stay each rank's own (each backward makes a whole unit's), in
gradient slots in a second window, and are summed hierarchically, as the
node model sums them: local rank ``l`` adds slice ``l`` of the node's ``L``
slots in place (no copy in or out of MPI's cells: a sixth to a tenth of the
time of MPICH's ``Reduce_scatter_block`` within a node, for mlp-wide's 2.7 MB
on 2 emulated nodes of 2 ranks), and a
``Reduce_scatter_block`` between the nodes leaves worker ``c`` its block of
it.

A shared slot must not be written while a rank of the node may still read
what it holds, nor read before every rank has written its part: the route
calls :meth:`NodeRoute.settle` (a node barrier between memory fences) after
a gather completes, before a node's sum reads the gradient slots, and before
a slot is written where a rank may have read it since the last barrier
(:meth:`NodeRoute.before_gathering`, :meth:`NodeRoute.before_backward`).
Every rank of a node makes the same calls in the same order, so the barriers
pair up; and every collective starts at the same point of the pass on every
rank, so the calls on one communicator keep one order.

Not where MPI runs with fault tolerance on, nor for arrays on GPUs, nor
where nodes hold different numbers of workers or one each, nor where
/dev/shm lacks room or an address-space limit is set (:func:`unit_route`;
``--exchange auto`` then takes the rank route).
"""

import numpy as np
from mpi4py import MPI

from ...runtime import aligned
from ...runtime import comm as mpi
from ...runtime.agreement import agreed
from ...runtime.errors import UsageError
from ..shards import LINE, line_bytes
from .node_model import nodes_reason
from .shared_memory import ONE_WORKER, shared_windows_reason

#: a sum complete when it was started (one node's: nothing in flight), as a started one is waited for
DONE = mpi.Pending(MPI.REQUEST_NULL, None)


def unit_route(comm, asked, xp, windows):
    """Collective over ``comm`` (the workers that share the shards): the route ``asked`` (``--exchange``) of
    ``comm``'s units, whose arrays are ``xp``'s (numpy or cupy) and whose node's shared windows would take
    ``windows(L)`` bytes for ``L`` workers a node (:func:`~mpidist.parallel.data.units.window_bytes`).
    ``node`` where it cannot serve: every worker exits 2 saying why."""
    if asked == "mpi":
        return RankRoute(comm)
    why_not, _, local_size = nodes_reason(comm)
    if why_not is None:  # (every rank asks of itself, and every rank learns the first refusal)
        reasons = comm.allgather(sharing_reason(xp, windows(local_size)))  # (start-up only: short strings)
        why_not = next((why for why in reasons if why), None)
    with agreed(comm):  # (every worker refuses alike: one message, every rank exits 2)
        if asked == "node" and why_not not in (None, ONE_WORKER):
            raise UsageError(f"--exchange node: {why_not}; use --exchange mpi or auto")
    return RankRoute(comm) if why_not else NodeRoute(comm)


def sharing_reason(xp, windows):
    """``None`` if this rank can share its node's windows of ``windows`` bytes, else why not (local): not
    for arrays on GPUs, nor where :func:`~.shared_memory.shared_windows_reason` refuses."""
    if xp is not np:
        return "the parameters are on GPUs"
    return shared_windows_reason(windows)


class RankRoute:
    """Every worker's block of a unit gathered into slots of each rank's own, over ``comm``."""

    #: the ranks that read one copy of a gathered unit
    sharing = 1

    def __init__(self, comm):
        self.comm, self.ranks, self.index = comm, comm.Get_size(), comm.Get_rank()
        self.grads = None
        self.sent = 0  # bytes this rank has sent (counted as rings': every other block passed on once)
        self.params_read = True  # (nobody else reads this rank's slots: never waited for)

    def slots(self, sizes, dtype, xp):
        """The parameter slots, of ``sizes`` elements."""
        return [aligned.zeros(xp, size, dtype) for size in sizes]

    def grad_slots(self, sizes, dtype, xp):
        """The gradient slots, of ``sizes`` elements; once."""
        self.grads = self.slots(sizes, dtype, xp)
        return self.grads

    def gather(self, slot, block):
        """Start gathering every rank's ``block`` elements of a unit into ``slot``, this rank's already in
        its place; returns a :class:`~mpidist.runtime.comm.Pending`."""
        self.sent += (self.ranks - 1) * block * slot.itemsize
        return mpi.iallgather_inplace(self.comm, slot[: block * self.ranks])

    def settle(self):
        """Nothing to settle: nobody else reads this rank's slots."""

    def before_gathering(self):
        """Nothing to wait for before writing a slot: nobody else reads it."""

    before_backward = before_gathering

    def sum(self, slot, target):
        """Start summing gradient slot ``slot`` over every worker, this rank's block (``target``'s size) into
        ``target``; returns a :class:`~mpidist.runtime.comm.Pending`."""
        block = target.size
        self.sent += (self.ranks - 1) * block * target.itemsize
        return mpi.ireduce_scatter_block_sum(self.comm, self.grads[slot][: block * self.ranks], target)

    def free(self):
        """Nothing to free: the communicator is the strategy's."""


class NodeRoute:
    """One copy of each gathered unit per node: the parameter slots in the node's shared window, the gradient
    slots in a window the node's ranks read each other's in.

    Args:
        comm: the workers that share the shards, ``L`` on each of ``N`` nodes (see :func:`unit_route`).
    """

    def __init__(self, comm):
        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        self.local, self.sharing = self.node.Get_rank(), self.node.Get_size()
        # the workers that own the same slice of every unit, one a node (their gathers fill it)
        self.cross = comm.Split(self.local, key=comm.Get_rank())
        self.nodes, self.ranks = self.cross.Get_size(), comm.Get_size()
        #: this rank's block of every unit (local-index-major: a local rank's blocks on every node are one
        #: slice)
        self.index = self.local * self.nodes + self.cross.Get_rank()
        self.windows, self.theirs = [], None
        self.sent = 0  # bytes this rank has sent to other nodes (counted as rings'; within its node, none)
        #: whether this rank may have read the parameter slots since the node last settled (set as a layer
        #: is about to run), and the node's gradient slots (as it sums them): every rank of the node makes
        #: the same reads at the same points, so each says it of them all
        self.params_read, self.grads_read = True, False

    def slots(self, sizes, dtype, xp):
        """The parameter slots, of ``sizes`` elements: the node's one copy (collective over the node;
        once)."""
        return self._window(sizes, dtype, every=False)[0]

    def grad_slots(self, sizes, dtype, xp):
        """This rank's gradient slots, of ``sizes`` elements, where the node's others read them (collective
        over the node; once)."""
        self.theirs = self._window(sizes, dtype, every=True)
        return list(self.theirs[self.local])

    def _window(self, sizes, dtype, every):
        """Arrays of ``sizes`` elements in a new shared window: each rank's (``every``), or local rank 0's,
        which every rank maps."""
        ats = [0]
        for size in sizes:
            ats.append(ats[-1] + line_bytes(size * dtype.itemsize))
        mine = ats[-1] + LINE if every or self.local == 0 else 0
        win = MPI.Win.Allocate_shared(mine, 1, comm=self.node)
        win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life: fences are Win.Sync
        self.windows.append(win)
        owners = range(self.sharing) if every else [0]
        return [
            [np.frombuffer(win.Shared_query(owner)[0], dtype, size, at) for size, at in zip(sizes, ats)]
            for owner in owners
        ]

    def gather(self, slot, block):
        """Start gathering this rank's slice of a unit from the ``N`` workers that own its blocks (between
        nodes) into the node's ``slot``, this rank's block already in its place."""
        span = block * self.nodes
        self.sent += (self.nodes - 1) * block * slot.itemsize
        return mpi.iallgather_inplace(self.cross, slot[self.local * span : (self.local + 1) * span])

    def settle(self):
        """A barrier of the node between memory fences: what each rank wrote before, each sees after; what
        each read before, nobody overwrites until after."""
        for win in self.windows:
            win.Sync()
        mpi.yielding_barrier(self.node)
        for win in self.windows:
            win.Sync()
        self.params_read = self.grads_read = False

    def before_gathering(self):
        """Before this rank writes a parameter slot: every rank of the node past the units it read there
        since the last barrier."""
        if self.params_read:
            self.settle()

    def before_backward(self):
        """Before this rank's backward writes a gradient slot: every rank of the node past its sums that read
        it since the last barrier."""
        if self.grads_read:
            self.settle()

    def sum(self, slot, target):
        """Sum this rank's slice of gradient slot ``slot`` over the node's ranks (once every rank has written
        its slot), then start its sum over the nodes, this rank's block into ``target``.

        The node's sum lands in this rank's own slot, in its slice, which no other rank reads: in place,
        no buffer beside it (where there is one node, in ``target``)."""
        block = target.size
        span = block * self.nodes
        lo = self.local * span
        self.settle()  # (what every rank's backward wrote, seen here: the node's ranks read, nobody sends)
        into = target if self.nodes == 1 else self.theirs[self.local][slot][lo : lo + span]
        first, second, *more = (theirs[slot][lo : lo + span] for theirs in self.theirs)
        np.add(first, second, out=into)
        for theirs in more:
            into += theirs
        self.grads_read = True
        if self.nodes == 1:
            return DONE
        self.sent += (self.nodes - 1) * block * target.itemsize
        return mpi.ireduce_scatter_block_sum(self.cross, into, target)

    def free(self):
        """Collective over the node: release the windows and the communicators; once."""
        for win in self.windows:
            win.Unlock_all()
            win.Free()
        self.windows, self.theirs = [], None
        if self.node is not None:
            self.node.Free()
            self.cross.Free()
            self.node = self.cross = None
