"""``ps-async``: parameter servers updated one-sidedly; workers wait for nobody but the staleness bound.

Each ps exposes, in MPI windows (:mod:`mpidist.runtime.rma`), its parameter shard, a
gradient inbox of the same size, and ``[version, arrivals]``; the first ps also
holds the workers' clocks.  A worker's step:

1. wait while it is more than ``S`` steps ahead of the slowest worker
   (stale synchronous parallel; ``--staleness``, 2 by default, -1 for never);
2. read every ps's shard (atomic per element) and its version;
3. compute its gradient, weighted by its share of the global batch;
4. ``Accumulate`` the gradient into every ps's inbox; count the arrival and
   read the version in one atomic step; tick its clock.

A ps loops: take the inbox (swap with zeros: atomic, so nothing that arrives
meanwhile is lost), apply the optimizer to its shard if anything arrived,
publish the shard and bump its version; else sleep briefly.  Workers never
wait for the ps, and the ps never blocks.  The choices of both loops are pure
rules of :mod:`~mpidist.parallel.ps.async_rounds`, tested there by literal tables;
here the windows are read and the choices carried out.

With ``--elastic`` (an MPI with ULFM), every rank also polls for dead
processes (as it steps, while the bound holds it, as it serves); the first
ps retires a dead worker's clock, so the others never wait for it.  A dead
ps or chief, where a ps is left and there are checkpoints, is a
:class:`~mpidist.runtime.ulfm.ProcessLost` wherever it is seen: the
survivors recover together (see :mod:`mpidist.loop.elastic`); otherwise it
ends the job.  A :class:`~mpidist.runtime.ulfm.StuckGuard`
gets a rank out of an operation that a dead one holds up.

Figures: ``staleness`` is SSP's, in steps: how far this worker was ahead of
the slowest when it read the parameters (``--staleness S`` bounds it by S);
``updates_missed`` is how many ps updates landed between its read and its
push (the version difference, maximum over ps ranks).
"""

import time

import numpy as np

from ...nn.precision import squared_sum
from ...runtime import comm as mpi
from ...runtime.cluster import PS
from ...runtime.errors import UsageError
from ...runtime.xp import is_device_array, to_host
from ..base import SkipCounter, start_counting
from ..registry import Option, register
from ..verdict import decide
from .async_exchange import AsyncExchange
from .async_rounds import POLL_SECONDS, Serving, WorkerPace, look_now, own_squared_norm
from .async_server import AsyncServer
from .lost_ranks import LostRanks, LostRanksLetGo
from .sharded import ShardedStrategy


@register
class PsAsyncStrategy(ShardedStrategy):
    """Asynchronous parameter servers over one-sided MPI.

    Args:
        staleness: bound ``S`` of stale synchronous parallel, or None for none.
    """

    name = "ps-async"
    recovery_type = LostRanksLetGo
    running_statistics = False  # workers' steps are not aligned: nothing to average them at
    elastic_recovery = True
    # (a lost ps or chief: checked by LostRanks as the ranks see it die, and by the recovery)
    ps_rollback = True
    options = ShardedStrategy.options + (
        Option(
            "staleness",
            2,
            "ps-async: most steps a worker may run ahead of the slowest (-1 = no bound: fully asynchronous)",
        ),
    )

    @classmethod
    def clipped_steps(cls, counted):
        return sum(counted)  # each worker clips its own gradients: their clipped pushes add up

    @classmethod
    def copies(cls, settings, cluster, arrays):
        # every rank's host copies of the parameters and a gradient; a ps's windows and inbox, what it swaps
        # out of them and sends to a checkpoint: 10.3 whole models measured on one ps (7.1 on each of two)
        return 12 if cluster.role == PS else 2

    @classmethod
    def check(cls, settings, world_size):
        super().check(settings, world_size)
        if settings.staleness < -1:
            raise UsageError(f"--staleness must be -1 (no bound) or 0 or more, got {settings.staleness}")

    @classmethod
    def arguments(cls, settings, setup):
        return {
            "staleness": None if settings.staleness < 0 else settings.staleness,
            "nan_patience": settings.nan_patience,
            "elastic": settings.elastic,
            "rollback": bool(settings.checkpoint_dir),
            "hold_every": settings.checkpoint_every
            if settings.checkpoint_wait and settings.checkpoint_dir
            else 0,
        }

    evaluation = "chief"
    lockstep = False

    def __init__(
        self, *args, staleness=None, nan_patience=10, elastic=False, rollback=False, hold_every=0, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.hold_every = int(hold_every)  # --checkpoint-wait: the chief holds at each due step (see _hold)
        self.nan_guard = SkipCounter(nan_patience, figures=self.figures)
        model, cluster = self.model, self.cluster
        n = model.num_params
        self.shard(n)
        # RMA reads and writes host memory: on the host the model's buffers are used directly
        self.host_params = np.zeros(n, dtype=model.dtype)
        self.host_grads = np.zeros(n, dtype=model.dtype)
        if not is_device_array(model.params):
            model.bind_params(self.host_params)
            model.bind_grads(self.host_grads)
        self.shard_values = np.zeros(self.hi - self.lo, dtype=model.dtype)
        self.optimizer = self.optimizers.make(self.hi - self.lo, self.lo)
        # --elastic: every rank polls for deaths; the first ps drops dead workers from the staleness bound
        self.lost = LostRanks(cluster, self.figures, elastic, rollback)
        self.exchange = AsyncExchange(
            cluster.world, self.ps_ranks, self.bounds, cluster.num_workers, model.dtype, self.lost.guard
        )
        self.pace = WorkerPace(staleness)  # (workers)
        self.serving = Serving()  # (ps; its start step is set by initialize)
        start_counting(
            self.figures,
            staleness=[],
            updates_missed=[],
            wait_s=0.0,
            updates=0,
            gradients=0,
            dropped_workers=[],
            steps=0,
        )
        self._stop_sent = False

    @property
    def serves(self):
        """True on ps ranks: they run :meth:`serve` instead of training steps."""
        return not self.is_worker

    @property
    def staleness(self):
        """The bound ``S`` (None: none)."""
        return self.pace.bound

    def request_stop(self, signal_number):
        if not self._stop_sent:
            self.exchange.request_stop(signal_number, self.cluster.rank)
            self._stop_sent = True

    @property
    def stop_requested(self):
        """A stop asked for by any rank, as this worker's latest clock read saw it (every step reads)."""
        return bool(self.exchange.stop[0])

    def initialize(self, checkpoint=None):
        self.serving = Serving(0 if checkpoint is None else int(checkpoint.step))
        self.broadcast_initial(self.host_params, checkpoint)
        if not self.is_worker:
            self.shard_values[...] = self.host_params[self.lo : self.hi]
            self.exchange.publish(self.shard_values, self.cluster.rank)
        self.cluster.world.Barrier()  # every shard published before any worker reads

    def look_for_the_lost(self):
        """``--elastic``: act on deaths since the last look (see :class:`LostRanks`)."""
        self.lost.look(self.serving, self.exchange)

    def _hold(self, reached):
        """``--checkpoint-wait``, the chief at step ``reached`` where one is due: wait until the first ps has
        taken it (announced it to the other ps ranks), so that every checkpoint is taken at its step.

        The chief's clock is the run's step, and nothing else waits for a ps:
        while one wrote (20-70 ms against steps of 5 ms here) the clock passed
        the next multiples, and their checkpoints became one, a varying number.
        """
        # (announced since the start)
        due = reached // self.hold_every - self.serving.start_step // self.hold_every
        polls = 0
        while self.exchange.control()[0] < due:
            polls += 1
            if look_now(polls):  # (a ps that died announces nothing)
                self.look_for_the_lost()
            time.sleep(POLL_SECONDS)

    def _wait_for_slowest(self):
        """Stale synchronous parallel: returns how far ahead of the slowest worker this one is."""
        start = time.perf_counter()
        self.track("staleness-bound")
        polls = 0
        while True:
            polls += 1
            if look_now(polls):  # held for long: a ps may have died and nobody frees us
                self.look_for_the_lost()
            go, ahead = self.pace.check(self.exchange.clocks())
            if go:
                self.figures["wait_s"] += time.perf_counter() - start
                return max(ahead, 0)
            time.sleep(POLL_SECONDS)

    def train_step(self, x, y, weight, step):
        model = self.model
        self.look_for_the_lost()
        staleness = self._wait_for_slowest()
        self.track("exchange")
        read = self.exchange.pull(self.host_params, known=self.pace.versions_held)
        self.pace.versions_held = read
        if is_device_array(model.params):
            model.params[...] = model.xp.asarray(self.host_params)
        loss = self.backprop(x, y, weight, step)
        verdict = None
        if self.recipe.clip_norm:  # no summed gradient exists here: each worker clips its own batch's
            own = own_squared_norm(float(model.grads.dot(model.grads)), weight)
            verdict = self.judge(decide(own, loss, self.recipe.clip_norm), skips=False)  # (the ps skips)
            verdict.scaled(model.grads)
        grads = self.host_grads
        if is_device_array(model.grads):
            grads[...] = to_host(model.grads)
        # a worker's NaN stays its own: summed into a ps's inbox with the others' gradients, it took theirs
        # with it (the ps skips what it cannot apply); --nan-patience in a row ends the run
        if verdict is None:  # (clipping judged the gradient already: its verdict says whether it is finite)
            verdict = decide(squared_sum(grads), loss, 0.0)  # (widened: a 16-bit dot overflows)
        finite = not verdict.skip
        missed = 0
        if self.nan_guard.update_allowed(finite, f"worker {self.worker_index}'s loss or gradients were"):
            self.track("exchange")
            missed = int((self.exchange.push(grads, step) - read).max())
        self.exchange.tick(self.worker_index)
        if self.hold_every and self.cluster.is_chief and (step + 1) % self.hold_every == 0:
            self._hold(step + 1)
        self.pace.step_done()
        self.figures["steps"] += 1
        self.figures["staleness"].append(staleness)
        self.figures["updates_missed"].append(missed)
        return float(loss)

    def serve(self, control=None):
        """ps loop: apply what arrives until every worker has finished and the inbox is empty
        (:class:`~mpidist.parallel.ps.async_server.AsyncServer`)."""
        AsyncServer(self).serve(control)

    def finish(self):
        """Collective: workers sign off, ps ranks drain, everyone gets the final parameters."""
        if self.is_worker:
            self.exchange.retire(self.worker_index)
        self.cluster.world.Barrier()  # every ps has left serve(): nothing more will change
        if self.is_worker:
            self.exchange.pull(self.host_params)
            if is_device_array(self.model.params):
                self.model.params[...] = self.model.xp.asarray(self.host_params)
        # a ps cannot see one-sided reads: count the workers' pulls (each step's, and this last one)
        (pulls,) = mpi.sum_float64(self.cluster.world, [self.pace.completed + 1 if self.is_worker else 0])
        self.figures["pulls"] = int(pulls)

    def state(self):
        """Collective: final parameters from the chief, optimizer shards gathered from the ps."""
        return self.gather_state(self.host_params)

    def shard_params(self):
        return self.shard_values

    def stats(self):
        f = self.figures
        if not self.is_worker:
            shard_bytes = self.shard_values.nbytes
            return {
                "updates": f["updates"],
                "gradients": f["gradients"],
                "shard": [self.lo, self.hi],
                "skipped": self.nan_guard.total,
                **({"dropped_workers": f["dropped_workers"]} if self.lost.watched else {}),
                "bytes_in": f["gradients"] * shard_bytes,
                "bytes_out": f.get("pulls", 0) * shard_bytes,
            }
        return {
            "steps": f["steps"],
            "skipped": self.nan_guard.total,  # (its NaN or Inf gradients, kept from the ps)
            "wait_s": f["wait_s"],
            **({"clipped": f["clipped"]} if "clipped" in f else {}),
            "staleness_mean": float(np.mean(f["staleness"])) if f["staleness"] else 0.0,
            "staleness_max": int(max(f["staleness"], default=0)),
            "updates_missed_mean": float(np.mean(f["updates_missed"])) if f["updates_missed"] else 0.0,
            "updates_missed_max": int(max(f["updates_missed"], default=0)),
        }

    def free(self, keep=True):
        self.exchange.free()
        self.lost.free()  # the guard's thread; the watches' duplicates of the world
