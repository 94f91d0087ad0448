"""``allreduce``: synchronous data parallelism with fused, bucketed ``Allreduce``.

The chief initialises the parameters and broadcasts them (one ``Bcast`` of
the flat buffer).  Each step every worker back-propagates a loss weighted by
its share of the global batch, so an in-place ``Allreduce(SUM)`` of the flat
gradient buffer *is* the global mean gradient; every worker then applies the
same optimizer update to identical parameters.  The buffer is cut into
contiguous buckets of at most ``bucket_bytes``, each reduced by a non-blocking
``Iallreduce`` started as soon as backward has filled it
(:mod:`mpidist.parallel.exchange`): one MPI call per bucket, never one per
tensor, and no copy.  Where every worker runs on one node the buffers live in
one shared-memory window instead, and each worker sums its part of everyone's
in place (:mod:`mpidist.parallel.shared_memory`; ``--exchange``).
"""

import dataclasses

from ..runtime.agreement import agreed
from ..runtime.errors import UsageError
from .compression import CompressedExchange
from .data_parallel import DataParallel
from .exchange import Exchange
from .optimizer_shard import OptimizerShard
from .registry import Option, register
from .shared_memory import ONE_WORKER, SharedMemoryExchange, shared_memory_possible


@register
class AllreduceStrategy(DataParallel):
    """Every worker holds the model; gradients are summed with ``Allreduce``."""

    name = "allreduce"
    elastic_recovery = True
    options = (Option("compress", "none", "allreduce: send gradients as 16-bit floats, with error feedback "
                                          "(half the bytes; see the performance docs)",
                      choices=("none", "fp16", "bf16")),
               Option("exchange", "auto", "allreduce: how gradients are summed: 'shared-memory' (every worker on "
                                          "one node: the buffers in one shared window, summed in place), 'mpi' "
                                          "(Iallreduce per bucket, overlapped with backward), 'auto' (shared "
                                          "memory where possible and --compress is none, else mpi)",
                      choices=("auto", "shared-memory", "mpi")),
               Option("shard", "none", "allreduce: 'optimizer' keeps each worker's optimizer state for its slice "
                                       "of the model alone (ZeRO stage 1: the state per worker / W; each worker "
                                       "updates its slice, then an Allgatherv shares them); 'none': every worker "
                                       "holds and updates all of it",
                      choices=("none", "optimizer")))

    @classmethod
    def auto_rank(cls, settings, world_size):
        return 3   # what auto runs when nothing asks for another

    @classmethod
    def check(cls, settings, world_size):
        _check_exchange(settings.exchange, settings.compress, settings.elastic)
        if settings.shard != "none" and settings.elastic:
            raise UsageError(f"--shard {settings.shard} keeps optimizer state on one worker alone, which a lost "
                             "worker would take with it: not with --elastic")

    @classmethod
    def arguments(cls, settings, setup):
        # elastic: a lost worker must surface as MPI's process-failure error, which only MPI's collectives give
        return {"compress": settings.compress, "exchange": "mpi" if settings.elastic else settings.exchange,
                "shard": settings.shard}

    def __init__(self, *args, compress="none", exchange="auto", shard="none", **kwargs):
        _check_exchange(exchange, compress)
        self.compress, self.exchange_kind, self.shard_mode = compress, exchange, shard
        super().__init__(*args, **kwargs)

    def optimizer_part(self):
        if self.shard_mode == "optimizer" and self.worker_comm is not None and self.worker_comm.Get_size() > 1:
            return OptimizerShard(self.worker_comm, self.model.num_params)   # --shard optimizer: one slice
        return None

    def update(self, grads, step):
        if self.part is None:
            return super().update(grads, step)
        lo, hi = self.part.lo, self.part.hi
        self.optimizer.step(self.model.params[lo:hi], grads[lo:hi], self.recipe.lr(step))
        self.part.share(self.model.params)

    def initialize(self, checkpoint=None):
        if self.part is not None and checkpoint is not None:   # (a checkpoint holds the whole state: load a slice)
            checkpoint = dataclasses.replace(checkpoint, optimizer_state=self.part.slice_of(checkpoint.optimizer_state))
        super().initialize(checkpoint)

    def whole_optimizer_arrays(self):
        if self.part is None:
            return super().whole_optimizer_arrays()
        return self.part.gather(self.optimizer.state_arrays())   # collective over the workers

    def survivor_state(self, cluster, step):
        if self.part is not None:   # (check() refuses --elastic with --shard: a slice is not the whole state)
            raise RuntimeError("--shard optimizer does not run with --elastic")
        return super().survivor_state(cluster, step)

    def stats(self):
        if self.part is None:
            return super().stats()
        held = sum(int(array.nbytes) for array in self.optimizer.state_arrays().values())
        return {**super().stats(), "shard": [self.part.lo, self.part.hi], "optimizer_state_bytes": held}

    def make_exchange(self):
        if self.compress != "none":
            return CompressedExchange(self.worker_comm, self.buffer, self.bucket_bytes, self.compress)
        if self.exchange_kind != "mpi":
            why_not = shared_memory_possible(self.worker_comm, self.buffer)   # collective: the same everywhere
            if why_not is None:
                return SharedMemoryExchange(self.worker_comm, self.buffer)
            with agreed(self.worker_comm):   # (every worker refuses alike: one message, every rank exits 2)
                if self.exchange_kind == "shared-memory" and why_not != ONE_WORKER:
                    raise UsageError(f"--exchange shared-memory: {why_not}; use --exchange mpi or auto")
        return Exchange(self.worker_comm, self.buffer, self.bucket_bytes)


def _check_exchange(exchange, compress, elastic=False):
    """Refuse ``--exchange shared-memory`` where it cannot serve (a UsageError naming the conflict)."""
    if exchange != "shared-memory":
        return
    if compress != "none":
        raise UsageError(f"--exchange shared-memory sums in place and sends nothing, so there is nothing for "
                         f"--compress {compress} to compress: use --exchange mpi (or auto) with --compress")
    if elastic:
        raise UsageError("--exchange shared-memory does not survive a lost worker (MPI's shared-memory windows "
                         "are not fault tolerant): use --exchange mpi or auto with --elastic")
