"""The strategy interface, and the data-parallel step that local and allreduce share.

A strategy owns the model's flat buffers and the optimizer.  The training
loop hands it this worker's part of each global batch; the strategy runs
forward/backward (pure ``nn`` code), exchanges what its scheme exchanges, and
applies the optimizer.  Strategies never parse flags and never print.
"""

import numpy as np

from .. import comm as mpi
from ..xp import to_host


class Strategy:
    """Interface every strategy implements.

    Args:
        model: a :class:`mpidist.nn.Sequential`.
        loss: a loss from :mod:`mpidist.nn.losses`.
        optimizer: an optimizer over the flat parameter buffer.
        cluster: this rank's :class:`mpidist.cluster.Cluster` (None for a bare local run).
        seed: run seed (dropout streams derive from it).
    """

    name = None

    def __init__(self, model, loss, optimizer, cluster=None, seed=0, bucket_bytes=64 << 20):
        self.model, self.loss, self.optimizer, self.cluster, self.seed = model, loss, optimizer, cluster, seed
        self.bucket_bytes = int(bucket_bytes)

    @property
    def worker_comm(self):
        """Communicator over which evaluation counts are summed (None: this process alone)."""
        return None

    @property
    def worker_index(self):
        return 0

    def initialize(self, params=None):
        """Set the starting parameters: ``params`` (host array) if given, else the chief's init."""
        raise NotImplementedError

    def train_step(self, x, y, weight, step):
        """One step on this worker's batch; returns the global batch's mean loss.

        Args:
            x, y: this worker's part of the global batch (device arrays).
            weight: ``len(x) / global batch size``.
            step: global step number (seeds dropout).
        """
        raise NotImplementedError

    def evaluate(self, batches):
        """``(mean loss, accuracy, samples)`` over every worker's ``batches`` of ``(x, y)``."""
        xp = self.model.xp
        totals = np.zeros(3)
        for x, y in batches:
            x, y = xp.asarray(x), xp.asarray(y)
            out = self.model.forward(x, training=False)
            totals += (float(self.loss.forward(out, y)) * len(x), float(self.loss.correct(out, y)), len(x))
        loss_sum, correct, count = mpi.sum_float64(self.worker_comm, totals)
        return loss_sum / max(count, 1), correct / max(count, 1), int(count)

    def state(self):
        """Host copies of what a checkpoint holds: parameters and optimizer state."""
        arrays = {name: to_host(a) for name, a in self.optimizer.state_arrays().items()}
        return to_host(self.model.params), arrays, self.optimizer.steps


class DataParallel(Strategy):
    """Replicated model; gradients computed on each worker's shard, then exchanged.

    Gradients and the weighted batch loss share one buffer
    (``[grads..., loss]``), so a single exchange per step also yields the
    global loss.  Subclasses implement :meth:`exchange`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.model
        self.buffer = model.xp.zeros(model.num_params + 1, dtype=model.dtype)
        model.bind_grads(self.buffer)

    def exchange(self, buffer):
        """Turn each worker's weighted gradients into their sum over workers, in place."""
        raise NotImplementedError

    def train_step(self, x, y, weight, step):
        model = self.model
        model.reseed(self.seed, self.worker_index, step)
        out = model.forward(x, training=True)
        loss = self.loss.forward(out, y)
        model.backward(self.loss.backward(scale=weight))
        self.buffer[-1] = loss * weight
        self.exchange(self.buffer)
        self.optimizer.step(model.params, model.grads)
        return float(self.buffer[-1])
