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

Every one of these rules is a pure function of :mod:`~mpidist.parallel.ps.backup_rounds`,
tested there by literal tables; this module gathers their inputs over MPI and
carries out what they decide.
"""

import numpy as np

from ...runtime import comm as mpi
from ...runtime.cluster import PS
from ...runtime.errors import UsageError
from ...runtime.xp import is_device_array, to_host
from ..base import SkipCounter, start_counting
from ..recipe import total_steps
from ..verdict import agree
from .backup_rounds import Note, Rounds, round_update
from .sharded import ShardedStrategy

TAG_NOTE, TAG_GRAD, TAG_PARAMS = 11, 12, 13


class NoteInbox:
    """The coordinator's notes: one receive posted per worker, from that worker by name.

    Notes come from whichever worker is ready first, yet never through a
    receive from any source (see :func:`mpidist.runtime.comm.recv`: MPICH's
    network module left one unmatched, and the coordinator hung whenever the
    workers spanned nodes).  A worker sends its next note only after the
    reply to its last, so one receive per worker is enough: posted at the
    start and again before each reply that does not tell the worker to stop,
    so none is left posted when the run ends.

    Args:
        world: the communicator the notes travel on.
        worker_ranks: each worker's rank in it.
    """

    def __init__(self, world, worker_ranks):
        self.world, self.worker_ranks = world, list(worker_ranks)
        self.words = np.zeros((len(self.worker_ranks), 3), dtype=np.int64)
        self.requests = [None] * len(self.worker_ranks)
        self.first = 0  # where the next look begins: no worker is always looked at first
        self.expect(range(len(self.worker_ranks)))

    def expect(self, workers):
        """Post the receive of each of these workers' next note."""
        for worker in workers:
            self.requests[worker] = mpi.irecv(
                self.world, self.words[worker], self.worker_ranks[worker], TAG_NOTE
            )

    def notes(self):
        """The notes as they complete (from any worker); ends when no receive is posted."""
        while True:
            worker = mpi.wait_any(self.requests, self.first)
            if worker is None:
                return
            self.first = (worker + 1) % len(self.requests)
            yield Note.decode(self.words[worker])


class BackupWorkersStrategy(ShardedStrategy):
    """ps-sync where each step aggregates the first ``aggregate`` gradients.

    Args:
        aggregate: ``R``, gradients per step (1 <= R <= workers).
        total_steps: steps to run; the ps ranks stop everyone after it.
    """

    name = "ps-sync"
    running_statistics = False  # workers' steps are not aligned: nothing to average them at

    @classmethod
    def title(cls, settings):
        return f"{cls.name} with --aggregate"

    @classmethod
    def copies(cls, settings, cluster, arrays):
        # a ps keeps each worker's gradient until its round takes or drops it, and its round's sums: 18.4
        # whole models measured on one ps of three workers
        return 4 * cluster.num_workers + 8 if cluster.role == PS else 0

    @classmethod
    def arguments(cls, settings, setup):
        return {
            "aggregate": settings.aggregate,
            "total_steps": total_steps(settings, setup),
            "nan_patience": settings.nan_patience,
        }

    # workers are not in step with each other: an evaluation collective over them
    # would make the fast ones wait for the slow one (and stall the round)
    evaluation = "chief"
    lockstep = False

    def __init__(self, *args, aggregate, total_steps, nan_patience=10, **kwargs):
        super().__init__(*args, **kwargs)
        model, cluster = self.model, self.cluster
        # every ps takes the same decision: the coordinator (first ps) alone speaks for them
        self.nan_guard = SkipCounter(
            nan_patience, speaks=cluster.rank == cluster.roles.index(PS), figures=self.figures
        )
        n = model.num_params
        if not 1 <= int(aggregate) <= cluster.num_workers:
            raise ValueError(f"aggregate {aggregate} must be between 1 and {cluster.num_workers} workers")
        if int(total_steps) >= 1 << 24:  # versions travel in the model's float buffers
            # (found here, after the set-up's agreement, alike on every rank: one of them says so, see
            # mpidist.runtime.agreement.OneVoice)
            raise UsageError(
                f"--aggregate {aggregate}: backup workers count steps in float32, exactly up to "
                f"{(1 << 24) - 1:,}, and this run takes {int(total_steps):,}: give --steps or "
                "--epochs for fewer"
            )
        self.rounds = Rounds(total_steps, aggregate, cluster.num_workers)
        self.shard(n)
        self.worker_ranks = [rank for rank, role in enumerate(cluster.roles) if role != PS]
        self.host_params = np.zeros(n, dtype=model.dtype)
        self.host_grads = np.zeros(n, dtype=model.dtype)
        if not is_device_array(model.params):
            model.bind_params(self.host_params)
            model.bind_grads(self.host_grads)
        self.optimizer = self.optimizers.make(self.hi - self.lo, self.lo)
        # messages: worker -> ps [gradient shard, weight, weighted loss];
        # ps -> worker [param shard, last version of the run, version, loss]
        self.outbox = [np.zeros(hi - lo + 2, dtype=model.dtype) for lo, hi in self.bounds]
        self.replies = [np.zeros(hi - lo + 3, dtype=model.dtype) for lo, hi in self.bounds]
        self.finished = False
        start_counting(self.figures, updates=0, accepted=0, dropped=0)

    @property
    def serves(self):
        return not self.is_worker

    @property
    def aggregate(self):
        """``R``, gradients per step."""
        return self.rounds.aggregate

    @property
    def version(self):
        """The global version: on a ps, steps taken; on a worker, the one its last reply brought."""
        return self.rounds.version

    @property
    def stop_requested(self):
        return self.rounds.stop_requested

    def request_stop(self, signal_number):
        self.rounds.signal = signal_number

    def produced_step(self, step):
        """The global version: the ps ranks count the steps, whichever workers took them."""
        return self.rounds.version

    def initialize(self, checkpoint=None):
        self.broadcast_initial(self.host_params, checkpoint)
        if checkpoint is not None:
            self.rounds.version = int(checkpoint.step)

    # -- worker ----------------------------------------------------------------
    def train_step(self, x, y, weight, step):
        world, model = self.cluster.world, self.model
        loss = float(self.backprop(x, y, weight, step))
        grads = self.host_grads
        if is_device_array(model.grads):
            grads[...] = to_host(model.grads)
        self.track("exchange")
        note = self.rounds.note(self.worker_index).encode()
        sends = [mpi.isend(world, note, self.ps_ranks[0], TAG_NOTE)[0]]
        for message, ps, (lo, hi) in zip(self.outbox, self.ps_ranks, self.bounds):
            message[: hi - lo] = grads[lo:hi]
            message[-2:] = (weight, loss * weight)
            sends.append(mpi.isend(world, message, ps, TAG_GRAD)[0])
        for reply, ps, (lo, hi) in zip(self.replies, self.ps_ranks, self.bounds):
            mpi.recv(world, reply, ps, TAG_PARAMS)
            self.host_params[lo:hi] = reply[: hi - lo]
        mpi.wait_all(sends)
        if is_device_array(model.params):
            model.params[...] = model.xp.asarray(self.host_params)
        self.finished = self.rounds.learn(self.replies[0][-3], self.replies[0][-2])
        return float(self.replies[0][-1])

    # -- ps ----------------------------------------------------------------------
    def serve(self, control=None):
        """Rounds until the last step is taken and every worker has been told to stop.

        Each round's decisions are :mod:`~mpidist.parallel.ps.backup_rounds`'; here
        they are carried out.  ``control`` (see :class:`mpidist.loop.training.ServerControl`):
        a signal this ps received ends the run early; mid-run checkpoints are
        written when it says.
        """
        rounds, ps_comm = self.rounds, self.cluster.role_comm
        coordinator = ps_comm.Get_rank() == 0
        self.track("serve")
        workers = self.cluster.num_workers
        size = self.hi - self.lo
        incoming = np.zeros(size + 2, dtype=self.model.dtype)
        total = np.zeros(size, dtype=self.model.dtype)
        reply = np.zeros(size + 3, dtype=self.model.dtype)
        inbox = NoteInbox(self.cluster.world, self.worker_ranks) if coordinator else None
        notes = inbox.notes() if coordinator else None
        loss = 0.0
        while not rounds.over:
            statuses = rounds.tally(notes).statuses if coordinator else (0,) * workers
            decision = mpi.allreduce_max(
                ps_comm, rounds.decision(statuses, control.signalled() if control else 0)
            )
            round_ = rounds.open(decision)
            if round_.checkpoint:
                state = self.gather_on_first_ps(self.shard_view())
                if state is not None:
                    control.write(rounds.version, state)
            weights, weighted_loss = self._receive(round_, incoming, total)
            moved = weights > 0
            if moved:
                total /= weights  # the mean gradient of the accepted batches
                loss = self._update(total, weighted_loss / weights, loss)
            closing = rounds.close(round_, moved, coordinator, control is not None and control.periodic)
            if closing.ask_checkpoint:
                rounds.checkpoint_due = bool(control.checkpoint_due(closing.version))
            reply[:size] = self.shard_view()
            reply[-3:] = (rounds.limit, rounds.version, loss)
            if coordinator:  # (before the reply: a worker's next note finds its receive posted)
                inbox.expect(worker for worker in round_.heard if not rounds.stopped[worker])
            for worker in round_.heard:
                mpi.send(self.cluster.world, reply, self.worker_ranks[worker], TAG_PARAMS)

    def _receive(self, round_, incoming, total):
        """The round's gradients: the accepted ones summed into ``total``; returns ``(weights, weighted
        loss)``."""
        total[...] = 0
        weights = weighted_loss = 0.0
        for worker in round_.heard:
            mpi.recv(self.cluster.world, incoming, self.worker_ranks[worker], TAG_GRAD)
            if round_.accepts(worker):
                total += incoming[:-2]
                weights += float(incoming[-2])
                weighted_loss += float(incoming[-1])
                self.figures["accepted"] += 1
            else:
                self.figures["dropped"] += 1  # stale: counted and discarded, never applied
        return weights, weighted_loss

    def _update(self, total, loss, previous_loss):
        """Apply the mean accepted gradient ``total`` (every shard skips alike); returns the loss the reply
        carries."""
        # the norm over every shard, one small Allreduce where there are several (0 x a broken loss is NaN)
        group = self.cluster.role_comm if len(self.ps_ranks) > 1 else None
        verdict, _ = agree(group, float(total.dot(total)), loss, self.recipe.clip_norm)
        update = round_update(
            True,
            not verdict.skip,
            self.nan_guard,
            loss,
            previous_loss,
            f"the accepted gradients of step {self.rounds.version + 1} were",
        )
        if update.apply:
            self.judge(verdict)
            gradient = verdict.scaled(total)
            self.optimizer.step(self.shard_view(), gradient, self.recipe.lr(self.rounds.version))
            self.figures["updates"] += 1
        return update.loss

    def shard_view(self):
        return self.host_params[self.lo : self.hi]

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
        return {
            **({"clipped": self.figures["clipped"]} if "clipped" in self.figures else {}),
            "updates": self.figures["updates"],
            "accepted": self.figures["accepted"],
            "skipped": self.nan_guard.total,
            "dropped": self.figures["dropped"],
            "aggregate": self.aggregate,
            "shard": [self.lo, self.hi],
        }
