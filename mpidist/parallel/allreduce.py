"""``allreduce``: synchronous data parallelism with fused, bucketed ``Allreduce``.

The chief initialises the parameters and broadcasts them (one ``Bcast`` of
the flat buffer).  Each step every worker back-propagates a loss weighted by
its share of the global batch, so an in-place ``Allreduce(SUM)`` of the flat
gradient buffer *is* the global mean gradient; every worker then applies the
same optimizer update to identical parameters.  The buffer is cut into
contiguous buckets of at most ``bucket_bytes``, each reduced by a non-blocking
``Iallreduce`` started as soon as backward has filled it
(:mod:`mpidist.parallel.exchange`): one MPI call per bucket, never one per
tensor, and no copy.  On CPUs the model lives once per node instead, in a
shared-memory window whose ranks each sum and update their part of it, with a
ring between nodes (:mod:`mpidist.parallel.node_model`); where it cannot
(BatchNorm's running statistics), on one node the gradient buffers alone go
to a shared window (:mod:`mpidist.parallel.shared_memory`).  ``--exchange``
chooses.
"""

import dataclasses

from ..runtime.agreement import agreed
from ..runtime.errors import UsageError
from .compression import CompressedExchange
from .data_parallel import DataParallel
from .exchange import Exchange
from .mesh import MeshShape
from .node_model import NodeModelExchange, node_model_possible
from .optimizer_shard import OptimizerShard
from .registry import Option, register
from .shared_memory import ONE_WORKER, SharedMemoryExchange, shared_memory_possible
from .tensor import TENSOR, check_split, check_tensor


@register
class AllreduceStrategy(DataParallel):
    """Every worker holds the model; gradients are summed with ``Allreduce``."""

    name = "allreduce"
    elastic_recovery = True
    chief_replaceable = True  # (--elastic refuses --shard: every worker holds the whole state)
    options = (
        Option(
            "compress",
            "none",
            "allreduce: send gradients as 16-bit floats, with error feedback "
            "(half the bytes; see the performance docs)",
            choices=("none", "fp16", "bf16"),
        ),
        Option(
            "exchange",
            "auto",
            "allreduce: how gradients are summed: 'node' (one copy of the model per "
            "node in shared memory, each rank summing and updating 1/L of it, "
            "a ring between nodes), 'shared-memory' (every worker on one node "
            "and its own copy: the gradients in one shared window, summed in "
            "place), 'mpi' (Iallreduce per bucket, overlapped with backward), "
            "'auto' (the first of these that can serve; mpi with --compress)",
            choices=("auto", "node", "shared-memory", "mpi"),
        ),
        Option(
            "shard",
            "none",
            "allreduce: 'optimizer' keeps each worker's optimizer state for its slice "
            "of the model alone (ZeRO stage 1: the state per worker / W; each worker "
            "updates its slice, then an Allgatherv shares them); 'none': every worker "
            "holds and updates all of it",
            choices=("none", "optimizer"),
        ),
        TENSOR,
    )

    @classmethod
    def auto_rank(cls, settings, world_size):
        return 3  # what auto runs when nothing asks for another

    @classmethod
    def check(cls, settings, world_size):
        _check_exchange(settings.exchange, settings.compress, settings.elastic)
        if settings.shard != "none" and settings.elastic:
            raise UsageError(
                f"--shard {settings.shard} keeps optimizer state on one worker alone, which a lost "
                "worker would take with it: not with --elastic"
            )
        check_tensor(settings, world_size)

    @classmethod
    def check_model(cls, settings, model):
        return (
            check_split(model.layers, settings.tensor, f"--model {settings.model}")
            if settings.tensor > 1
            else []
        )

    @classmethod
    def data_layout(cls, settings, cluster):
        """The ``T`` parts of a tensor group read the same shard: the groups are the data-parallel workers."""
        if cluster.worker_index is None:
            return super().data_layout(settings, cluster)
        shape = MeshShape(cluster.num_workers, parts=settings.tensor)
        return shape.size("replica"), shape.coordinates(cluster.worker_index)[0]

    @classmethod
    def layout_text(cls, settings, cluster):
        if settings.tensor == 1:
            return super().layout_text(settings, cluster)
        replicas = MeshShape(cluster.num_workers, parts=settings.tensor).size("replica")
        return f"{replicas} worker(s) x {settings.tensor} tensor parts"

    @classmethod
    def arguments(cls, settings, setup):
        # elastic: a lost worker must surface as MPI's process-failure error, which only MPI's collectives
        # give (a tensor run's gradients are summed by MPI: the node's shared windows hold whole models)
        return {
            "compress": settings.compress,
            "exchange": "mpi" if settings.elastic or settings.tensor > 1 else settings.exchange,
            "shard": settings.shard,
            "tensor": settings.tensor,
        }

    def __init__(self, *args, compress="none", exchange="auto", shard="none", **kwargs):
        _check_exchange(exchange, compress)
        self.compress, self.exchange_kind, self.shard_mode = compress, exchange, shard
        super().__init__(*args, **kwargs)

    def optimizer_part(self):
        part = self.exchange.optimizer_part()  # (one copy per node: this rank's part of it)
        if part is not None:
            return part
        if (
            self.shard_mode == "optimizer"
            and self.worker_comm is not None
            and self.worker_comm.Get_size() > 1
        ):
            return OptimizerShard(self.worker_comm, self.model.num_params)  # --shard optimizer: one slice
        return None

    def update(self, grads, step):
        if self.part is None:
            return super().update(grads, step)
        lo, hi = self.part.lo, self.part.hi
        self.optimizer.step(self.model.params[lo:hi], grads[lo:hi], self.recipe.lr(step))
        self.part.share(self.model.params)

    def initialize(self, checkpoint=None):
        # (a checkpoint holds the whole state: load a slice)
        if self.part is not None and checkpoint is not None:
            checkpoint = dataclasses.replace(
                checkpoint, optimizer_state=self.part.slice_of(checkpoint.optimizer_state)
            )
        super().initialize(checkpoint)

    def whole_optimizer_arrays(self):
        if self.part is None:
            return super().whole_optimizer_arrays()
        return self.part.gather(self.optimizer.state_arrays())  # collective over the workers

    def held_bytes(self):
        state = (
            sum(int(array.nbytes) for array in self.optimizer.state_arrays().values())
            if self.optimizer
            else 0
        )
        # a node's one copy of the parameters counts 1/L on each of its L ranks
        sharing = self.exchange.node.Get_size() if self.exchange.holds_params else 1
        return {
            "params": int(self.model.params.nbytes) // sharing,
            "grads": int(self.buffer.nbytes),
            "optimizer_state": state,
        }

    def stats(self):
        held = self.held_bytes()
        figures = {**super().stats(), "held_bytes": held, **self.exchange.stats()}
        if self.part is None:
            return figures
        return {
            **figures,
            "shard": [self.part.lo, self.part.hi],
            "optimizer_state_bytes": held["optimizer_state"],
        }

    def describe(self, rank):
        part = self.tensor.describe()
        return f"tensor {part}" if part else super().describe(rank)

    def make_exchange(self):
        if self.compress != "none":
            return CompressedExchange(self.worker_comm, self.buffer, self.bucket_bytes, self.compress)
        comm, kind = self.worker_comm, self.exchange_kind
        if kind in ("auto", "node"):
            why_not = node_model_possible(comm, self.buffer, self.model)  # collective: the same everywhere
            if why_not is None:
                return NodeModelExchange(
                    comm, self.buffer, self.model.params, sharded=self.shard_mode == "optimizer"
                )
            _refuse_if_asked(comm, kind, "node", why_not)
        if kind in ("auto", "shared-memory"):
            why_not = shared_memory_possible(comm, self.buffer)
            if why_not is None:
                return SharedMemoryExchange(comm, self.buffer)
            _refuse_if_asked(comm, kind, "shared-memory", why_not)
        return Exchange(self.worker_comm, self.buffer, self.bucket_bytes)


def _refuse_if_asked(comm, asked, kind, why_not):
    """Collective: where ``--exchange`` named ``kind`` and it cannot serve, every worker exits 2 with
    ``why_not``."""
    with agreed(comm):  # (every worker refuses alike: one message, every rank exits 2)
        if asked == kind and why_not != ONE_WORKER:
            raise UsageError(f"--exchange {kind}: {why_not}; use --exchange mpi or auto")


def _check_exchange(exchange, compress, elastic=False):
    """Refuse ``--exchange node`` or ``shared-memory`` where it cannot serve (a UsageError naming the
    conflict)."""
    if exchange not in ("node", "shared-memory"):
        return
    if compress != "none":
        raise UsageError(
            f"--exchange {exchange} sums in shared memory, so there is nothing for "
            f"--compress {compress} to compress: use --exchange mpi (or auto) with --compress"
        )
    if elastic:
        raise UsageError(
            f"--exchange {exchange} does not survive a lost worker (MPI's shared-memory windows "
            "are not fault tolerant): use --exchange mpi or auto with --elastic"
        )
