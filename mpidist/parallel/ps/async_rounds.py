"""The rules of ``ps-async``, without MPI: the staleness bound, a ps's serving loop, lost workers.

:mod:`mpidist.parallel.ps.asynchronous` reads the windows (clocks, arrival counts,
the first ps's control words) and carries out what these functions decide:

* a worker goes on while it is at most ``S`` steps ahead of the slowest
  worker (:func:`ahead_of_slowest`, :func:`within_bound`, kept by
  :class:`WorkerPace`); a finished or lost worker's clock says ``NEVER`` and
  holds nobody back;
* a ps, each time round its loop, snapshots when the first ps asked, leaves
  once drained and the first ps says serving is over
  (:func:`follower_action`), and otherwise takes what arrived, idles (backing
  off, :func:`next_pause`) or drains the last arrivals once every worker has
  signed off (:func:`inbox_action`);
* the first ps alone decides mid-run checkpoints, by the chief's clock
  (:func:`watches_checkpoints`, :meth:`Serving.run_step`);
* what arrived is applied unless it is all zeros (:func:`carries_gradient`)
  or not finite (within ``--nan-patience``), at the learning rate of the mean
  step of its gradients (:func:`mean_step`);
* a lost worker is retired; a lost ps or chief, where a ps is left and the
  run writes checkpoints, makes every survivor recover (back to the newest
  checkpoint); else it ends the job (:func:`sort_lost`).
"""

import enum
import typing

import numpy as np

from ...runtime.cluster import PS, WORKER

NEVER = np.iinfo(np.int64).max  # a finished worker's clock: it never holds anyone back
POLL_SECONDS = 0.0002  # SSP wait between clock reads; first ps sleep when idle
POLL_MAX_SECONDS = 0.005  # an idle ps backs off to this: it only delays updates, never a worker
LOOK_EVERY = 500  # clock reads of a held worker between looks for the lost (0.1 s)


# -- workers: stale synchronous parallel ------------------------------------------
def ahead_of_slowest(completed, clocks):
    """How many steps a worker that completed ``completed`` is ahead of the slowest of ``clocks``.

    Negative when every other clock is further on, or finished (``NEVER``).
    """
    return int(completed) - int(min(clocks))


def within_bound(ahead, bound):
    """Whether a worker ``ahead`` steps ahead of the slowest may go on (``bound`` None: no bound)."""
    return bound is None or ahead <= bound


def look_now(polls):
    """Whether a worker held by the bound for ``polls`` clock reads looks for the lost (a dead ps frees
    nobody)."""
    return polls % LOOK_EVERY == 0


def own_squared_norm(squares, weight):
    """The squared norm a worker clips its own gradient by: its batch's, undoing the share ``weight`` it was
    scaled by.

    ps-async never holds a summed gradient: each worker clips the one it sends.
    """
    return float(squares) / (weight * weight)


class WorkerPace:
    """A worker's staleness bookkeeping: steps it completed, the bound, the ps versions its parameters hold.

    Args:
        bound: ``S``, most steps ahead of the slowest worker; None for no bound.
    """

    def __init__(self, bound):
        self.bound = bound
        self.completed = 0  # steps of this strategy object (the bound counts these)
        self.versions_held = None  # the ps versions the worker's parameters hold, once read

    def check(self, clocks):
        """``(may go on, how far ahead of the slowest)`` against the workers' ``clocks``."""
        ahead = ahead_of_slowest(self.completed, clocks)
        return within_bound(ahead, self.bound), ahead

    def step_done(self):
        self.completed += 1


# -- ps: the serving loop ----------------------------------------------------------
class Act(enum.Enum):
    """What a ps does next time round its serving loop."""

    SNAPSHOT = "snapshot"  # send its shard to the first ps for the checkpoint it asked for
    LEAVE = "leave"  # serving is over
    TAKE = "take"  # take the inbox and apply it
    IDLE = "idle"  # nothing arrived: sleep a little longer each time
    DRAIN = "drain"  # every worker signed off: take the last arrivals (the first ps then ends serving)


def follower_action(asked, snapshots, drained, over):
    """A ps other than the first: SNAPSHOT when the first asked for more than it took, LEAVE once drained and
    over.

    None: go on to the inbox.  The first ps alone decides when serving is
    over, so no ps leaves while a checkpoint could still ask for its shard.
    """
    if asked > snapshots:
        return Act.SNAPSHOT
    if drained and over:
        return Act.LEAVE
    return None


def inbox_action(pending, drained, done, workers):
    """TAKE when arrivals are counted; IDLE while workers train on, or once drained; else DRAIN.

    Args:
        pending: arrivals counted and not yet taken.
        drained: this ps has taken the last arrivals already.
        done: workers that signed off (read only when ``pending`` is 0 and not
            ``drained``; None otherwise).
        workers: how many there are.
    """
    if pending:
        return Act.TAKE
    if drained or done < workers:
        return Act.IDLE
    return Act.DRAIN  # every worker signed off after its last count: what is left is the last


def next_pause(pause):
    """An idle ps sleeps twice as long each time, up to ``POLL_MAX_SECONDS``.

    Polling steals cycles from workers on shared cores, and a later poll only
    delays an update: workers never wait for the ps.
    """
    return min(2 * pause, POLL_MAX_SECONDS)


def watches_checkpoints(first, periodic, drained):
    """Whether a ps reads the chief's clock for a mid-run checkpoint: the first ps, while workers train on."""
    return first and periodic and not drained


def mean_step(arrivals, step_sum, previous):
    """The step whose learning rate applies to ``arrivals`` gradients whose steps sum to ``step_sum``.

    Their mean; ``previous`` when nothing was counted (a count can outlive its
    data, or come after it: the step is as near as it gets).
    """
    return step_sum / arrivals if arrivals else previous


def carries_gradient(gradient):
    """Whether a ps applies what it took: not when it is all zeros.

    A count can outlive its data (taken with an earlier count's), and even a
    zero gradient moves Adam's parameters.  (NaN or Inf gradients are then
    skipped by the ps's :class:`~mpidist.parallel.base.SkipCounter`, within ``--nan-patience``.)
    """
    return bool(gradient[:256].any()) or bool(gradient.any())  # a short prefix almost always answers


class Serving:
    """A ps's bookkeeping while it serves: the run's step at the start, snapshots taken, the gradients' step.

    Args:
        start_step: the chief's step when this run began (a resumed run's checkpoint step).
    """

    def __init__(self, start_step=0):
        self.start_step = int(start_step)
        self.snapshots = 0  # mid-run checkpoints taken
        self.gradient_step = float(self.start_step)  # the mean step of the gradients taken last

    def run_step(self, chief_clock):
        """The run's step at the chief's ``chief_clock`` steps; None once the chief signed off."""
        return None if chief_clock == NEVER else self.start_step + int(chief_clock)

    def took(self, arrivals, step_sum):
        """Note what a take brought (its count and the sum of its steps)."""
        self.gradient_step = mean_step(arrivals, step_sum, self.gradient_step)

    @property
    def learning_step(self):
        """The step whose learning rate the next update takes."""
        return int(round(self.gradient_step))


# -- --elastic: lost ranks ---------------------------------------------------------
class Lost(typing.NamedTuple):
    """What the ranks lost since the last look mean."""

    fatal: tuple  # world ranks whose state is held nowhere else: a ps (its shard) or the chief
    # (world rank, worker index) of lost workers: their clocks are retired, they hold nobody back
    retired: tuple
    # fatal ones, a ps left, and checkpoints: every rank recovers (back to a checkpoint)
    recover: bool = False


def sort_lost(lost, roles, chief_rank, earlier=(), rollback=False):
    """Sort the world ranks ``lost`` by ``roles`` (each rank's, ``PS`` or ``WORKER``).

    Args:
        earlier: ranks lost before (retired workers): a ps among them is not left to take a lost shard.
        rollback: whether the run writes checkpoints that every rank can go back to (``--checkpoint-dir``).
    """
    fatal = tuple(rank for rank in lost if roles[rank] == PS or rank == chief_rank)
    retired = tuple((rank, roles[:rank].count(WORKER)) for rank in lost if rank not in fatal)
    gone = set(lost) | set(earlier)
    ps_left = any(role == PS and rank not in gone for rank, role in enumerate(roles))
    return Lost(fatal, retired, bool(fatal) and rollback and ps_left)
