"""``allreduce``: synchronous data parallelism with fused, bucketed ``Allreduce``.

The chief initialises the parameters and broadcasts them (one ``Bcast`` of
the flat buffer).  Each step every worker back-propagates a loss weighted by
its share of the global batch, so an in-place ``Allreduce(SUM)`` of the flat
gradient buffer *is* the global mean gradient; every worker then applies the
same optimizer update to identical parameters.  The buffer is cut into
contiguous buckets of at most ``bucket_bytes``, each reduced by a non-blocking
``Iallreduce`` started as soon as backward has filled it
(:mod:`mpidist.parallel.data.exchange`): one MPI call per bucket, never one per
tensor, and no copy.  On CPUs the model lives once per node instead, in a
shared-memory window whose ranks each sum and update their part of it, with a
ring between nodes (:mod:`mpidist.parallel.data.node_model`); where it cannot
(BatchNorm's running statistics), on one node the gradient buffers alone go
to a shared window (:mod:`mpidist.parallel.data.shared_memory`).  ``--exchange``
chooses.
"""

import dataclasses

import numpy as np

from ...nn.precision import is_low
from ...runtime.agreement import agreed
from ...runtime.errors import UsageError
from ...runtime.nccl_sum import nccl_group
from ..registry import register
from .compression import CompressedExchange
from .declared import AllreduceDeclared, check_exchange
from .exchange import Exchange
from .fully_sharded import FullyShardedStrategy
from .nccl_exchange import NcclExchange
from .node_model import NodeModelExchange, node_model_possible
from .optimizer_shard import OptimizerShard
from .replicated import DataParallel
from .shared_memory import ONE_WORKER, SharedMemoryExchange, shared_memory_possible


@register
class AllreduceStrategy(AllreduceDeclared, DataParallel):
    """Every worker holds the model; gradients are summed with ``Allreduce``."""

    @classmethod
    def variant(cls, settings, workers):
        # (--shard parameters: no worker holds the model whole, a class of its own)
        return FullyShardedStrategy if settings.shard == "parameters" else cls

    def __init__(self, *args, compress="none", exchange="auto", shard="none", **kwargs):
        check_exchange(exchange, compress)
        self.compress, self.exchange_kind, self.shard_mode = compress, exchange, shard
        #: why the workers' sums are not NCCL's (None: they are, or it was not asked)
        self.nccl_off = None
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
        if self.model.xp is not np and self.nccl_off:  # (a GPU's: why its sums are not NCCL's)
            figures["nccl_off"] = self.nccl_off
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
        if kind == "auto" and comm is not None and comm.Get_size() > 1:
            group, self.nccl_off = nccl_group(comm, self.buffer)  # collective: GPUs of their own, NCCL
            if group is not None:
                return NcclExchange(group, self.buffer, self.bucket_bytes)
        if is_low(self.model.dtype):  # (--precision: each worker's own master copy, summed by MPI)
            return Exchange(self.worker_comm, self.buffer, self.bucket_bytes)
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
