"""``local-sgd``: each worker steps on its own gradients; the parameters are averaged every K steps.

Local SGD (Stich, "Local SGD converges fast and communicates little", 2019;
Lin et al., "Don't use large mini-batches, use local SGD", 2020) trades
gradient exchanges for model averaging: each worker applies its optimizer to
the mean gradient of its own part of the batch, and every ``--sync-every K``
steps one bucketed ``Allreduce`` averages the parameters. Between averages
the workers exchange only the loss and a finite flag (two numbers). With
``K = 1`` and plain SGD (no momentum) on equal parts it is ``allreduce``
exactly: the mean of ``p - lr * g_w`` is ``p - lr * mean(g_w)`` (tested).

Each worker keeps its own optimizer state; parameters are also averaged
before each evaluation and checkpoint, which holds the average and the
chief's optimizer state.

This module is all there is to the strategy: its flag, its validation and
its data layout are declared here and registered with :func:`register`.
"""

import numpy as np

from ..runtime import comm as mpi
from ..runtime.errors import UsageError
from .base import finite
from .data_parallel import DataParallel, average_over
from .exchange import NoExchange, bucket_slices
from .registry import Option, register


@register
class LocalSgdStrategy(DataParallel):
    """Workers step alone; ``Allreduce`` averages the parameters every ``sync_every`` steps.

    Args:
        sync_every: steps between two averages of the parameters.
    """

    name = "local-sgd"
    options = (Option("sync_every", 4, "local-sgd: steps each worker takes alone between two averages of the "
                                       "parameters"),)

    @classmethod
    def check(cls, settings, world_size):
        if settings.sync_every < 1:
            raise UsageError(f"--sync-every must be at least 1, got {settings.sync_every}")

    @classmethod
    def arguments(cls, settings, setup):
        return {"sync_every": settings.sync_every}

    def __init__(self, *args, sync_every=4, **kwargs):
        super().__init__(*args, **kwargs)
        self.sync_every = int(sync_every)
        self.buckets = bucket_slices(self.model.num_params, self.buffer.itemsize, self.bucket_bytes)
        self.averages = 0
        self.averaged = True    # the parameters are the workers' mean (no step since the last average)

    def make_exchange(self):
        return NoExchange()   # gradients stay each worker's own: the parameters are averaged instead

    def train_step(self, x, y, weight, step):
        model = self.model
        loss = self.backprop(x, y, 1.0, step)       # this worker's own mean gradient
        self.track("exchange")
        # the global batch's loss and whether any worker's gradients broke: the same answer everywhere
        loss_sum, broken = mpi.sum_float64(self.worker_comm, [loss * weight, not finite(model.grads)])
        self.skipped = bool(broken) or not np.isfinite(loss_sum)
        self.clipped = False
        if not self.skipped:   # (no summed gradient: each worker clips its own batch's, as under ps-async)
            self.optimizer.step(model.params, self.clip(model.grads), self.recipe.lr(step))
            self.averaged = False
        if (step + 1) % self.sync_every == 0:
            self.average_params()
        return float(loss_sum)

    def average_params(self):
        """Collective over the workers: every worker's parameters become their mean."""
        comm = self.worker_comm
        if comm is None or comm.Get_size() == 1 or self.averaged:
            return
        for lo, hi in self.buckets:
            average_over(comm, self.model.params[lo:hi])
        self.averages += 1
        self.averaged = True

    def evaluate(self, batches):
        self.average_params()
        return super().evaluate(batches)

    def state(self):
        self.average_params()
        return super().state()

    def stats(self):
        return {"averages": self.averages} if self.cluster is not None and self.cluster.is_chief else {}
