"""``ps-sync --aggregate R``: synchronous parameter servers with backup workers.

Distributed TensorFlow's ``replicas_to_aggregate``: each step uses the first
``R`` of the ``W`` workers' gradients and drops the rest, so a slow worker
never slows the step rate.  A collective cannot do this (everyone would have
to take part), so it runs point-to-point, buffer-based, in rounds:

1. Each worker sends the coordinator (the first ps) a note ``[worker,
   version it computed on]`` and sends every ps its gradient shard with its
   batch weight and weighted loss; then it waits for parameters.
2. The coordinator takes notes until ``R`` name the current version; notes
   naming an older version are stale.  It broadcasts the round's decision
   (accepted / stale per worker) to the ps ranks, so every shard is updated
   from the *same* workers.
3. Each ps receives those workers' shards, sums the accepted ones (divided by
   their summed weights: the mean gradient of the accepted batches), applies
   the optimizer, and sends the new parameters and version to every worker it
   heard from.  Stale gradients are counted and discarded, never applied.

A worker's version rises with every reply, so it never needs more batches
than there are steps.  After the last step the ps ranks keep answering until
every worker has been told to stop: no message is left unmatched.

Stopping early (a signal on any rank) moves that last step forward: a
worker's note carries the signal to the coordinator, a ps adds its own to the
round's decision, and every ps then ends the run at the next version.  The
replies carry this limit, so each worker learns it with its parameters.

Mid-run checkpoints are taken between rounds: the coordinator decides after
an update, the next round's decision tells every ps, and before that round
changes anything the ps ranks gather their shards on the first ps, which
writes them -- a state exactly at one version.
"""

import math

import numpy as np
from mpi4py import MPI

from ..runtime import comm as mpi
from ..runtime.cluster import PS
from ..runtime.xp import is_device_array, to_host
from .base import SkipCounter, finite
from .recipe import total_steps
from .shards import ShardedStrategy

TAG_NOTE, TAG_GRAD, TAG_PARAMS = 11, 12, 13
ACCEPTED, STALE = 1, 2


class BackupWorkersStrategy(ShardedStrategy):
    """ps-sync where each step aggregates the first ``aggregate`` gradients.

    Args:
        aggregate: ``R``, gradients per step (1 <= R <= workers).
        total_steps: steps to run; the ps ranks stop everyone after it.
    """

    name = "ps-sync"
    running_statistics = False   # workers' steps are not aligned: nothing to average them at

    @classmethod
    def arguments(cls, settings, setup):
        return {"aggregate": settings.aggregate, "total_steps": total_steps(settings, setup),
                "nan_patience": settings.nan_patience}
    # workers are not in step with each other: an evaluation collective over them
    # would make the fast ones wait for the slow one (and stall the round)
    evaluation = "chief"
    lockstep = False

    def __init__(self, *args, aggregate, total_steps, nan_patience=10, **kwargs):
        super().__init__(*args, **kwargs)
        model, cluster = self.model, self.cluster
        # every ps takes the same decision: the coordinator (first ps) alone speaks for them
        self.nan_guard = SkipCounter(nan_patience, speaks=cluster.rank == cluster.roles.index(PS),
                                     figures=self.figures)
        n = model.num_params
        self.aggregate, self.total_steps = int(aggregate), int(total_steps)
        if not 1 <= self.aggregate <= cluster.num_workers:
            raise ValueError(f"aggregate {aggregate} must be between 1 and {cluster.num_workers} workers")
        if self.total_steps >= 1 << 24:   # versions travel in the model's float buffers
            raise ValueError(f"{total_steps} steps is more than backup-worker mode counts exactly")
        self.shard(n)
        self.worker_ranks = [rank for rank, role in enumerate(cluster.roles) if role != PS]
        self.host_params = np.zeros(n, dtype=model.dtype)
        self.host_grads = np.zeros(n, dtype=model.dtype)
        if not is_device_array(model.params):
            model.bind_params(self.host_params)
            model.bind_grads(self.host_grads)
        self.optimizer = self.make_optimizer(self.hi - self.lo, self.lo)
        # messages: worker -> ps [gradient shard, weight, weighted loss];
        # ps -> worker [param shard, last version of the run, version, loss]
        self.outbox = [np.zeros(hi - lo + 2, dtype=model.dtype) for lo, hi in self.bounds]
        self.replies = [np.zeros(hi - lo + 3, dtype=model.dtype) for lo, hi in self.bounds]
        self.version, self.finished = 0, False
        self.limit = self.total_steps   # the last version: lowered when a stop is asked for
        self.signal = 0                 # a stop this rank asks for (its note carries it)
        self.count(updates=0, accepted=0, dropped=0)

    @property
    def serves(self):
        return not self.is_worker

    @property
    def stop_requested(self):
        return self.limit < self.total_steps

    def request_stop(self, signal_number):
        self.signal = signal_number

    def produced_step(self, step):
        """The global version: the ps ranks count the steps, whichever workers took them."""
        return self.version

    def initialize(self, checkpoint=None):
        self.broadcast_initial(self.host_params, checkpoint)
        if checkpoint is not None:
            self.version = int(checkpoint.step)

    # -- worker ----------------------------------------------------------------
    def train_step(self, x, y, weight, step):
        world, model = self.cluster.world, self.model
        loss = float(self.backprop(x, y, weight, step))
        grads = self.host_grads
        if is_device_array(model.grads):
            grads[...] = to_host(model.grads)
        self.track("exchange")
        note = np.array([self.worker_index, self.version, self.signal], dtype=np.int64)
        sends = [world.Isend(note, self.ps_ranks[0], TAG_NOTE)]
        for message, ps, (lo, hi) in zip(self.outbox, self.ps_ranks, self.bounds):
            message[:hi - lo] = grads[lo:hi]
            message[-2:] = (weight, loss * weight)
            sends.append(mpi.isend(world, message, ps, TAG_GRAD)[0])
        for reply, ps, (lo, hi) in zip(self.replies, self.ps_ranks, self.bounds):
            mpi.recv(world, reply, ps, TAG_PARAMS)
            self.host_params[lo:hi] = reply[:hi - lo]
        MPI.Request.Waitall(sends)
        if is_device_array(model.params):
            model.params[...] = model.xp.asarray(self.host_params)
        self.limit, self.version = int(self.replies[0][-3]), int(self.replies[0][-2])
        self.finished = self.version >= self.limit
        return float(self.replies[0][-1])

    # -- ps ----------------------------------------------------------------------
    def _decide(self, version):
        """Coordinator: who is in this round (per worker: 0, ACCEPTED or STALE)."""
        world, workers = self.cluster.world, self.cluster.num_workers
        status = np.zeros(workers, dtype=np.int64)
        note = np.zeros(3, dtype=np.int64)
        accepted = 0
        while True:
            world.Recv(note, MPI.ANY_SOURCE, TAG_NOTE)
            worker, read = int(note[0]), int(note[1])
            self.signal = max(self.signal, int(note[2]))
            if version < self.limit and read == version:
                status[worker] = ACCEPTED
                accepted += 1
            else:
                status[worker] = STALE
            if version >= self.limit or accepted == self.aggregate:
                return status

    def serve(self, control=None):
        """Rounds until the last step is taken and every worker has been told to stop.

        ``control`` (see :class:`mpidist.loop.training.ServerControl`): a signal this ps
        received ends the run early; mid-run checkpoints are written when it says.
        """
        coordinator = self.cluster.role_comm.Get_rank() == 0
        self.track("serve")
        world, ps_comm = self.cluster.world, self.cluster.role_comm
        workers = self.cluster.num_workers
        size = self.hi - self.lo
        incoming = np.zeros(size + 2, dtype=self.model.dtype)
        total = np.zeros(size, dtype=self.model.dtype)
        reply = np.zeros(size + 3, dtype=self.model.dtype)
        stopped = np.zeros(workers, dtype=bool)
        loss = 0.0
        decision = np.zeros(workers + 2, dtype=np.int64)   # [status per worker, stop signal, checkpoint now]
        checkpoint_due = 0
        while not stopped.all():
            decision[:workers] = self._decide(self.version) if coordinator else 0
            decision[-2] = max(self.signal, control.signalled() if control else 0)
            decision[-1] = checkpoint_due
            ps_comm.Allreduce(MPI.IN_PLACE, decision, op=MPI.MAX)   # only the coordinator's statuses are nonzero
            status = decision[:workers]
            if decision[-2]:
                self.limit = min(self.limit, self.version + 1)
            if decision[-1]:
                state = self.gather_on_first_ps(self.shard_view())
                if state is not None:
                    control.write(self.version, state)
            checkpoint_due = 0
            total[...] = 0
            weights = weighted_loss = 0.0
            for worker in np.flatnonzero(status):
                mpi.recv(world, incoming, self.worker_ranks[worker], TAG_GRAD)
                if status[worker] == ACCEPTED:
                    total += incoming[:size]
                    weights += float(incoming[-2])
                    weighted_loss += float(incoming[-1])
                    self.figures["accepted"] += 1
                else:
                    self.figures["dropped"] += 1
            if weights > 0:
                total /= weights        # the mean gradient of the accepted batches
                loss = weighted_loss / weights
                # every shard skips alike; the version still moves on, so workers never run out of batches
                if self.recipe.clip_norm:   # the norm over every shard, one Allreduce (0 x a broken loss is NaN)
                    squares = mpi.sum_float64(ps_comm, [float(total.dot(total)) + 0.0 * loss])[0]
                    ok = math.isfinite(squares)
                else:
                    ok = self.ps_agree(finite(total) and math.isfinite(loss))
                if self.nan_guard.update_allowed(ok, f"the accepted gradients of step {self.version + 1} were"):
                    if self.recipe.clip_norm:
                        self.clip(total, squares)
                    self.optimizer.step(self.shard_view(), total, self.recipe.lr(self.version))
                    self.figures["updates"] += 1
                else:
                    loss = math.nan
                self.version += 1
                if coordinator and control is not None and control.periodic and self.version < self.limit:
                    checkpoint_due = int(control.checkpoint_due(self.version))
            reply[:size] = self.shard_view()
            reply[-3:] = (self.limit, self.version, loss)
            for worker in np.flatnonzero(status):
                mpi.send(world, reply, self.worker_ranks[worker], TAG_PARAMS)
                if self.version >= self.limit:
                    stopped[worker] = True

    def shard_view(self):
        return self.host_params[self.lo:self.hi]

    def finish(self):
        """Collective: the chief gets every ps's final shard."""
        counts, displs = self.layout()
        mpi.allgatherv_inplace(self.cluster.world, self.host_params, counts, displs)
        if is_device_array(self.model.params):
            self.model.params[...] = self.model.xp.asarray(self.host_params)

    def state(self):
        return self.gather_state(self.host_params)

    def stats(self):
        if self.is_worker:
            return {}
        return {**({"clipped": self.figures["clipped"]} if "clipped" in self.figures else {}),
                "updates": self.figures["updates"], "accepted": self.figures["accepted"],
                "skipped": self.nan_guard.total,
                "dropped": self.figures["dropped"], "aggregate": self.aggregate, "shard": [self.lo, self.hi]}
