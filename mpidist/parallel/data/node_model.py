"""One copy of the model per node: the parameters in the node's shared window, each rank owning 1/L of them.

On a node of ``L`` worker ranks the parameters live once, in an MPI-3
shared-memory window (``Win.Allocate_shared``) that every rank of the node
maps; each rank still back-propagates into a gradient buffer of its own, in
the same window, where the node's other ranks can read it.  The flat buffer
is cut into ``L`` parts, one per local rank.  A step:

1. as backward fills a rank's buffer from the top, the rank announces how
   far it has got (a fence and one store in the window);
2. each rank sums its part over the node's ``L`` gradient buffers, in place
   in its own buffer, piece by piece as every rank's backward passes each
   piece (a rank that finished first sums while the others compute the
   layers below), then exchanges that part with the ranks owning it on
   the other nodes (:class:`~mpidist.parallel.data.ring.Ring`: ``L`` concurrent
   inter-node exchanges of ``1/L`` of the buffer each, no leader carrying
   everything), and writes the part's squared norm where everyone sees it;
3. every part is summed (a barrier): each rank adds the ``L`` squared norms
   (the same numbers in the same order everywhere: the same skip and clip
   decision), then applies the optimizer to its part of the parameters alone,
   with optimizer state the size of that part;
4. every part is updated (a barrier) before anyone's next forward reads them.

No rank copies back the sums of the others (the shared-memory exchange of
:mod:`mpidist.parallel.data.shared_memory` does), each runs ``1/L`` of the
optimizer, and the node holds one copy of the parameters and of the optimizer
state instead of ``L``.  With ``--shard optimizer`` the ring stops after its
reduce-scatter: each rank updates the chunk of its part it summed (``1/W`` of
the model, optimizer state ``1/W``) and the ring's allgather then carries
the updated parameters instead of the gradients -- the same bytes.

Not where a rank may be lost (``--elastic``, MPI with fault tolerance):
shared windows do not report a lost process; not for arrays on GPUs; not for
models whose forward pass writes parameters (BatchNorm's running statistics,
which each rank would overwrite in the one copy); not where nodes hold
different numbers of workers (their parts would not line up), nor one each
(nothing to share: MPI's bucketed ``Iallreduce`` serves).  The
:func:`node_model_possible` check says which, and ``--exchange auto`` then
takes the next exchange.
"""

import os

import numpy as np
from mpi4py import MPI

from ...runtime import comm as mpi
from ...runtime import recorder
from ..shards import LINE, chunk_bounds, line_bytes
from .exchange import NoExchange
from .optimizer_shard import OptimizerShard
from .ring import Ring
from .shared_memory import ONE_WORKER, host_memory_reason

_TRACER = recorder.tracer()
PIECE = 1 << 15  # elements a rank sums at a time, as the node's backward passes them (128 KiB in float32)


def node_model_possible(comm, buffer, model):
    """Collective over ``comm``: ``None`` if the model can live once per node, else why not (the same
    everywhere)."""
    why_not, local, local_size = nodes_reason(comm)
    if why_not is not None:
        return why_not
    if model.running_entries():  # (the same model everywhere: the same answer)
        return (
            "the model keeps running statistics (BatchNorm) that each worker's forward pass writes into its "
            "parameters"
        )
    # each node checks its own memory (L gradient buffers and one model); rank 0 tells everyone the first
    # refusal
    mine = host_memory_reason(buffer, copies=local_size + 1) if local == 0 else None
    reasons = comm.gather(mine, root=0)  # (start-up only: a few short strings)
    return comm.bcast(next((why for why in reasons if why), None) if comm.Get_rank() == 0 else None, root=0)


def nodes_reason(comm):
    """Collective over ``comm``: ``(why not, local rank, ranks on this node)``, why not ``None`` where every
    node holds the same number of ``comm``'s ranks, more than one (the same answer everywhere)."""
    if comm is None or comm.Get_size() < 2:
        return ONE_WORKER, 0, 1
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    sizes = np.array([local_size, -local_size], dtype=np.int64)
    mpi.allreduce_max(comm, sizes)
    if sizes[0] != -sizes[1]:
        unequal = f"the nodes hold different numbers of workers (from {-sizes[1]} to {sizes[0]})"
        return unequal, local, local_size
    # (a copy per node is a copy per rank: MPI's own calls serve)
    if sizes[0] == 1:
        return "each node holds one worker, so there is nothing for a node's ranks to share", local, 1
    return None, local, local_size


class NodePart(OptimizerShard):
    """The slice of the model this rank's optimizer updates, and how the slices are joined (and gathered).

    Without ``--shard`` the slice is the rank's part of the node's copy, and
    a checkpoint gathers the parts over the node; with ``--shard optimizer``
    it is the rank's chunk of that part, and a checkpoint gathers the chunks
    over every worker.
    """

    def __init__(self, exchange):
        self.exchange = exchange
        sharded = self.sharded = exchange.sharded
        lo, hi = exchange.ring.chunk if sharded else exchange.part
        self.lo, self.hi = lo, min(hi, exchange.count)  # (the loss rides after the last parameter)
        self.comm = exchange.workers if sharded else exchange.node
        # whose slice lies where, for the checkpoint's gather: every rank's (lo, size) of this communicator
        spans = np.empty((self.comm.Get_size(), 2), dtype=np.int64)
        mpi.allgather(self.comm, np.array([self.lo, self.size], dtype=np.int64), spans)
        self.displs, self.counts = spans[:, 0].tolist(), spans[:, 1].tolist()

    def gather(self, arrays, root=0):
        """Collective over the node (sharded: the workers): the whole optimizer state on the chief, else None.

        Unsharded, every node holds the same state: the chief's node alone gathers it.
        """
        if not self.sharded and not self.exchange.holds_chief:
            return None
        return super().gather(arrays, root)

    def share(self, params):
        """After the optimizer, sharded over several nodes: the updated chunks go round the ring."""
        if self.sharded:
            with _TRACER.span("share the updated part", "exchange", recorder.BUCKETS):
                self.exchange.ring.allgather(params)


class NodeWindow:
    """The node's shared window: the one copy of the parameters (on local rank 0) and each rank's gradient
    buffer.

    Args:
        node: the node's workers (one shared-memory domain).
        count: parameters in the model.
        buffer: this rank's gradient buffer (its size, dtype and contents move into the window).
    """

    def __init__(self, node, count, buffer):
        self.node, self.local, dtype = node, node.Get_rank(), buffer.dtype
        params_bytes, grads_bytes = line_bytes(count * dtype.itemsize), line_bytes(buffer.nbytes)
        self.win = MPI.Win.Allocate_shared(
            (params_bytes if self.local == 0 else 0) + grads_bytes + LINE, 1, comm=node
        )
        # every rank's gradient buffer, its part's squared norm, and how far its backward has got
        self.buffers, self.squares, self.progress = [], [], []
        for rank in range(node.Get_size()):
            memory, _ = self.win.Shared_query(rank)
            at = params_bytes if rank == 0 else 0
            if rank == 0:
                self.params = np.frombuffer(memory, dtype=dtype, count=count)
            self.buffers.append(np.frombuffer(memory, dtype=dtype, count=buffer.size, offset=at))
            self.squares.append(np.frombuffer(memory, dtype=np.float64, count=1, offset=at + grads_bytes))
            self.progress.append(np.frombuffer(memory, dtype=np.int64, count=1, offset=at + grads_bytes + 8))
        self.buffers[self.local][...] = buffer
        self.progress[self.local][0] = 0
        self.win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch for the window's life: fences are Win.Sync
        self.everyone_here()

    def announce(self, mark):
        """Tell the node this rank's progress: ``mark`` (a fence first, so what it wrote before is seen with
        it)."""
        self.win.Sync()
        self.progress[self.local][0] = mark

    def wait_for(self, mark):
        """Return once every rank of the node has announced at least ``mark`` (a fence after, for what they
        wrote).

        Polls the node's progress; a waiting rank yields its core between
        polls, so ranks that share cores (more ranks than cores) let the rank
        they wait for run.
        """
        while True:
            self.win.Sync()
            if min(int(progress[0]) for progress in self.progress) >= mark:
                self.win.Sync()  # (the acquire: no read of their buffers moves before the marks were seen)
                return
            os.sched_yield()

    def everyone_here(self):
        """A barrier of the node with memory fences: what each rank wrote before it, each sees after it."""
        self.win.Sync()
        self.node.Barrier()
        self.win.Sync()

    def free(self):
        """Collective over the node: release the window and the node's communicator; once."""
        if self.win is None:
            return
        self.buffers = self.squares = self.progress = self.params = None
        self.win.Unlock_all()
        self.win.Free()
        self.win = None
        self.node.Free()


class NodeModelExchange(NoExchange):
    """The node's one copy of the parameters, each rank's gradient buffer, and the sum over every worker.

    Args:
        comm: the workers' communicator (see :func:`node_model_possible`).
        buffer: this rank's gradient buffer (gradients, then the weighted loss): its size and dtype.
        params: the model's parameters (their values move into the window on local rank 0).
        sharded: ``--shard optimizer``: the ring stops after its reduce-scatter (:class:`NodePart`).
    """

    holds_buffer = True
    #: The model's parameters live in :attr:`params`, the window's one copy, which the strategy binds them to.
    holds_params = True

    def __init__(self, comm, buffer, params, sharded=False):
        super().__init__()
        self.workers, self.sharded, self.count = comm, sharded, params.size
        self.window = NodeWindow(
            comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()), params.size, buffer
        )
        # the ranks that own the same part on every node, in node order (the ring between nodes)
        self.cross = comm.Split(self.local, key=comm.Get_rank())
        self.buffer = self.window.buffers[self.local]
        # (cut down to cache lines: the last part, which holds the loss, is never empty)
        bounds = chunk_bounds(0, buffer.size, buffer.itemsize, self.node.Get_size())
        self.part = bounds[self.local], bounds[self.local + 1]
        # whether worker 0 (the chief, local rank 0 of its node) is on this node: only its node gathers
        # checkpoints
        self.holds_chief = bool(self.node.bcast(comm.Get_rank() == 0, root=0))
        self.ring = Ring(self.cross, *self.part, buffer.dtype)
        self.steps = 0
        self.bytes_per_step = int(buffer.nbytes)

    @property
    def node(self):
        return self.window.node

    @property
    def local(self):
        return self.window.local

    @property
    def params(self):
        return self.window.params

    @property
    def nodes(self):
        return self.cross.Get_size()

    def share_initial(self):
        """Collective: the chief's parameters (already in its node's copy) into every node's copy."""
        if self.local == 0:
            mpi.bcast(self.cross, self.params, root=0)
        self.window.everyone_here()

    def begin(self):
        super().begin()
        self.steps += 1

    def _mark(self, lo):
        """The progress mark of "``buffer[lo:]`` is final" in this step: it grows with the step and as ``lo``
        falls, so a mark of an earlier step never passes for one of this step."""
        size = self.buffer.size
        return self.steps * (size + 1) + (size - lo)

    def ready(self, lo):
        """``buffer[lo:]`` is final: the node may sum it (one fence and one store)."""
        self.window.announce(self._mark(lo))

    def finish(self):
        self.window.announce(self._mark(0))
        lo, hi = self.part
        with _TRACER.span("sum own part", "exchange", recorder.BUCKETS, part=self.local):
            # piece by piece from the top, as soon as every rank's backward has passed it: a rank that
            # finished first sums while the others still compute the layers below
            for top in range(hi, lo, -PIECE):
                bottom = max(lo, top - PIECE)
                self.window.wait_for(self._mark(bottom))
                mine = self.buffer[bottom:top]
                for rank, theirs in enumerate(self.window.buffers):
                    if rank != self.local:
                        mine += theirs[bottom:top]
        if self.nodes > 1:
            with _TRACER.span(
                "exchange own part between nodes", "exchange", recorder.BUCKETS, part=self.local
            ):
                self.ring.reduce_scatter(self.buffer)
                if not self.sharded:
                    self.ring.allgather(self.buffer)
        self._note_part()
        with _TRACER.span("wait for the workers", "wait", recorder.BUCKETS):
            self.window.everyone_here()  # every part is summed
        # the same numbers added in the same order on every rank: the same decisions everywhere
        self.summed_squares = sum(float(square[0]) for square in self.window.squares)
        self.buffer[-1] = self.window.buffers[-1][-1]  # the loss, summed in the last part

    def _note_part(self):
        """This rank's summed part's squared norm (the loss left out) where the node sees it; the loss,
        summed.

        Sharded over several nodes, each node summed one chunk of the part:
        their squares, and the loss from the chunk that holds it, are summed
        over the ring (one small Allreduce) so every node knows them whole.
        """
        sharded = self.sharded and self.nodes > 1
        lo, hi = self.ring.chunk if sharded else self.part
        grads = self.buffer[lo : min(hi, self.count)]
        figures = np.array([float(grads.dot(grads)), 0.0])
        if sharded:
            if hi == self.buffer.size:  # this chunk holds the loss, summed
                figures[1] = self.buffer[-1]
            mpi.allreduce_sum(self.cross, figures)
            if self.part[1] == self.buffer.size:
                self.buffer[-1] = figures[1]
        self.window.squares[self.local][0] = figures[0]

    def optimizer_part(self):
        """Collective: this rank's :class:`NodePart` of the node's one copy (the slice it sums and
        updates)."""
        return NodePart(self)

    def stats(self):
        """Measured by the ring: what this rank sent to other nodes per step."""
        return {"internode_bytes_per_step": self.internode_bytes_per_step()}

    def after_update(self):
        """Collective over the node: every rank has updated its part before anyone reads the parameters."""
        with _TRACER.span("wait for the workers", "wait", recorder.BUCKETS):
            self.window.everyone_here()

    def internode_bytes_per_step(self):
        """Bytes this rank sent to other nodes per step, as counted by its ring."""
        return self.ring.sent / self.steps if self.steps else 0.0

    def free(self):
        """Collective: release the window and the communicators (the strategy rebinds to copies first);
        once."""
        if self.buffer is None:
            return
        self.buffer = None
        self.window.free()
        self.cross.Free()
