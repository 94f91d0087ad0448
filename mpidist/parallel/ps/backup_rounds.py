"""The rules of backup workers' rounds (``ps-sync --aggregate R``), without MPI.

A round of :mod:`mpidist.parallel.ps.backup` goes through three decisions, each a
pure function of plain values, which the MPI loop gathers and carries out:

1. :func:`tally_notes` (the coordinator, the first ps): which workers' notes
   the round takes -- the first ``R`` naming the current version are
   ``ACCEPTED``, older ones ``STALE``; after the last step each note is
   answered on its own, so every worker learns that the run is over.
2. :func:`open_round` (every ps, from the coordinator's statuses and every
   ps's stop signal and checkpoint flag, combined by maximum): the workers
   heard, the run's last version (a stop moves it to the next version), and
   whether the state is written before the round changes anything.
3. :func:`round_update` and :func:`close_round` (every ps, alike): whether the
   accepted gradients are applied (NaN or Inf ones are skipped, within
   ``--nan-patience``), what loss the reply carries, the version after the
   round, which workers the reply tells to stop, and whether the coordinator
   asks for a checkpoint at the new version.

:class:`Rounds` strings them together for one ps (or, with :meth:`Rounds.learn`,
holds a worker's view: the version and last version its replies brought).
"""

import dataclasses
import math
import typing

import numpy as np

ACCEPTED, STALE = 1, 2  # a worker's status in a round (0: no note from it this round)


class Note(typing.NamedTuple):
    """What a worker tells the coordinator before its gradient: who, on which version, and its stop signal."""

    worker: int
    read: int
    signal: int = 0

    def encode(self):
        """The note as it travels: three int64."""
        return np.array([self.worker, self.read, self.signal], dtype=np.int64)

    @classmethod
    def decode(cls, words):
        return cls(int(words[0]), int(words[1]), int(words[2]))


@dataclasses.dataclass(frozen=True)
class Tally:
    """The coordinator's notes of one round so far.

    Attributes:
        statuses: per worker, 0 (no note yet), ``ACCEPTED`` or ``STALE``.
        signal: the largest stop signal the notes carried (0: none).
    """

    statuses: tuple
    signal: int = 0

    @classmethod
    def empty(cls, workers):
        return cls((0,) * workers)

    @property
    def accepted(self):
        return self.statuses.count(ACCEPTED)


def admit(tally, note, version, limit):
    """``tally`` with ``note``: accepted when it names ``version`` and a step remains before ``limit``, else
    stale."""
    if not 0 <= note.worker < len(tally.statuses):
        raise ValueError(f"a note from worker {note.worker}, but there are {len(tally.statuses)} workers")
    status = ACCEPTED if version < limit and note.read == version else STALE
    statuses = tally.statuses[: note.worker] + (status,) + tally.statuses[note.worker + 1 :]
    return Tally(statuses, max(tally.signal, note.signal))


def closed(tally, version, limit, aggregate):
    """Whether the round takes no more notes: ``aggregate`` accepted, or (after the last step) one note
    heard."""
    return tally.accepted == aggregate or (version >= limit and any(tally.statuses))


def tally_notes(notes, workers, version, limit, aggregate):
    """The coordinator's tally of a round: notes taken from the iterator ``notes`` until the round closes.

    Notes after the closing one are left in ``notes`` (their workers' gradients
    belong to a later round).
    """
    tally = Tally.empty(workers)
    for note in notes:
        tally = admit(tally, note, version, limit)
        if closed(tally, version, limit, aggregate):
            return tally
    raise ValueError(
        f"the notes ran out before round {version} closed ({tally.accepted} of {aggregate} "
        f"accepted, statuses {tally.statuses})"
    )


@dataclasses.dataclass(frozen=True)
class Round:
    """What every ps does in one round, decided before any gradient is received.

    Attributes:
        statuses: per worker, 0, ``ACCEPTED`` or ``STALE`` (the coordinator's tally).
        limit: the run's last version from this round on.
        checkpoint: write the state, at the version the round starts from, first.
    """

    statuses: tuple
    limit: int
    checkpoint: bool = False

    @property
    def heard(self):
        """The workers whose gradient this round receives (and who get its reply)."""
        return tuple(worker for worker, status in enumerate(self.statuses) if status)

    def accepts(self, worker):
        return self.statuses[worker] == ACCEPTED


def encode_round(statuses, signal, checkpoint):
    """A ps's part of the round's decision: ``[status per worker, stop signal, checkpoint now]``.

    The parts of every ps are combined by maximum: only the coordinator's
    statuses are nonzero, and any ps's stop signal or checkpoint flag counts.
    """
    return np.array([*statuses, signal, int(bool(checkpoint))], dtype=np.int64)


def open_round(decision, version, limit):
    """The :class:`Round` of the combined ``decision``: a stop signal makes the next version the last."""
    *statuses, signal, checkpoint = (int(word) for word in decision)
    return Round(tuple(statuses), min(limit, version + 1) if signal else limit, bool(checkpoint))


class RoundUpdate(typing.NamedTuple):
    """Whether a round's accepted gradients are applied, and the loss its reply carries."""

    apply: bool
    loss: float


def round_update(moved, ok, guard, loss, previous_loss, what):
    """The update of a round.

    Args:
        moved: whether any accepted gradient (with weight) arrived: the version moves on.
        ok: whether the accepted gradients and loss are finite on every ps.
        guard: the :class:`~mpidist.parallel.base.SkipCounter` of ``--nan-patience``
            (raises :class:`~mpidist.runtime.errors.RunError` past it).
        loss: the round's mean loss; previous_loss: the last round's, which a
            round without gradients repeats.
        what: the gradients in words, for the patience's message.
    """
    if not moved:
        return RoundUpdate(False, previous_loss)
    if guard.update_allowed(ok, what):
        return RoundUpdate(True, loss)
    return RoundUpdate(False, math.nan)  # skipped alike on every shard; the version still moves on


@dataclasses.dataclass(frozen=True)
class Closing:
    """How a round ends on every ps.

    Attributes:
        version: the version after the round (one more when gradients were taken,
            applied or skipped: workers never run out of batches).
        stopped: the workers this round's reply tells that the run is over.
        ask_checkpoint: the coordinator asks whether a checkpoint is due at ``version``.
    """

    version: int
    stopped: tuple
    ask_checkpoint: bool = False


def close_round(round_, version, moved, coordinator=False, periodic=False):
    """The :class:`Closing` of ``round_`` begun at ``version`` (``moved``: gradients were taken)."""
    after = version + 1 if moved else version
    stopped = round_.heard if after >= round_.limit else ()
    return Closing(after, stopped, coordinator and periodic and moved and after < round_.limit)


class Rounds:
    """One rank's state of the protocol: the version, the run's last version, stops, workers told to stop.

    Args:
        total_steps: the last version, unless a stop moves it forward.
        aggregate: ``R``, gradients per step.
        workers: how many workers take part.
    """

    def __init__(self, total_steps, aggregate, workers):
        self.total_steps, self.aggregate = int(total_steps), int(aggregate)
        self.version, self.limit = 0, self.total_steps
        self.signal = 0  # a stop this rank asks for, or (coordinator) a note brought
        self.stopped = [False] * workers  # (ps) workers told that the run is over
        self.checkpoint_due = False  # (coordinator) write a checkpoint before the next round

    @property
    def stop_requested(self):
        return self.limit < self.total_steps

    @property
    def over(self):
        """(ps) Every worker has been told to stop: no message is left unmatched."""
        return all(self.stopped)

    def note(self, worker):
        """(worker) The note of this worker's next gradient."""
        return Note(worker, self.version, self.signal)

    def learn(self, limit, version):
        """(worker) A reply's last version and version; whether the run is over for this worker."""
        self.limit, self.version = int(limit), int(version)
        return self.version >= self.limit

    def tally(self, notes):
        """(coordinator) This round's tally from the iterator ``notes``; keeps any stop signal they
        brought."""
        tally = tally_notes(notes, len(self.stopped), self.version, self.limit, self.aggregate)
        self.signal = max(self.signal, tally.signal)
        return tally

    def decision(self, statuses, signalled=0):
        """This ps's part of the round's decision (``signalled``: a signal this ps received itself)."""
        return encode_round(statuses, max(self.signal, signalled), self.checkpoint_due)

    def open(self, decision):
        """Every ps: the :class:`Round` of the combined decision; the limit moves, the checkpoint flag is
        spent."""
        round_ = open_round(decision, self.version, self.limit)
        self.limit, self.checkpoint_due = round_.limit, False
        return round_

    def close(self, round_, moved, coordinator=False, periodic=False):
        """Every ps: the :class:`Closing` of ``round_``; the version moves on, the told workers are marked."""
        closing = close_round(round_, self.version, moved, coordinator, periodic)
        self.version = closing.version
        for worker in closing.stopped:
            self.stopped[worker] = True
        return closing
