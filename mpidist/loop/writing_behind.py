"""Checkpoints written behind training: a whole one copied into kept host arrays and written by a thread
(:meth:`WritingBehind.write_behind`), a sharded one's parts synced behind and completed at a step boundary,
and what completed collected in the training thread, where a write that failed raises its error.
"""

import time

import numpy as np

from ..parallel.saved_state import WholeState
from ..store import bulk
from .writer import BehindWrite


class WritingBehind:
    """Writing checkpoints behind training (mixed into :class:`~mpidist.loop.checkpointer.Checkpointer`, whose
    ``files``, ``behind``, :meth:`run_time` and record of what was written it uses)."""

    @property
    def busy(self):
        """Whether the writer behind training is not free (on the chief; never elsewhere): a write in flight,
        or the rest after one that keeps writing within :data:`~mpidist.loop.writer.WRITER_SHARE` of the
        chief's time."""
        last = self.behind.last
        return last is not None and (last.is_alive() or time.monotonic() < last.free_at())

    @property
    def writing(self):
        """Whether this rank's part of a sharded checkpoint behind training is still being synced."""
        return self.behind.parts is not None and self.behind.parts.writing

    def at_boundary(self, step, flags):
        """Lockstep, at every step boundary, with what the ranks agreed (``flags``, posted at the boundary
        before): a sharded checkpoint whose parts every rank had synced is completed (collective; a boundary
        one step after its start carries flags from before it began), and the chief collects a write behind
        that finished.  Returns what was completed, as :meth:`take`."""
        parts, done = self.behind.parts, []
        if parts is not None and not flags["writing"] and step >= parts.where[0] + 2:
            done = self.complete_parts()
            self.behind.started_at = step  # (the index is written now: no checkpoint starts at this step)
        return done + self.collect()

    def finish_writes(self):
        """Collective after the last step: what is written behind training is completed and collected."""
        return self.complete_parts() + self.collect(wait=True)

    def complete_parts(self):
        """Collective where a sharded checkpoint is under way (:meth:`write_sharded`): complete it; as
        :meth:`take`."""
        write, self.behind.parts = self.behind.parts, None
        result = write.complete() if write is not None else None
        # (the chief's index, written behind training: collect() takes it)
        if isinstance(result, BehindWrite):
            self.behind.flight = self.behind.last = result
        elif result is not None:
            self._written(result, write.where[0])
            return [(result, *write.where[:2])]
        return []

    def write_behind(self, state, step, epoch, epoch_step, workers, best=None):
        """Copy ``state`` (as :meth:`write` takes it) into host memory and write it in a background thread.

        The copy goes into arrays kept from one checkpoint to the next.  One
        write is in flight at most: one still running is waited for first
        (``--checkpoint-wait``: training waits where writing takes longer than
        the steps between two; else :meth:`starts_at` never starts one while
        the last is written).  Returns what that earlier write completed (see
        :meth:`collect`).
        """
        done = self.collect(wait=True)
        self.files.take_fingerprint()
        copying = time.thread_time()
        staging = self.behind.staging
        staged = WholeState(
            staging.copy("params", state.params),
            {name: staging.copy(f"optimizer/{name}", array) for name, array in state.optimizer.items()},
            state.steps,
            {
                name: staging.copy(f"workers/{name}", array)
                for name, array in (state.per_worker or {}).items()
            },
        )
        elapsed = self.run_time()
        self.behind.flight = self.behind.last = BehindWrite(
            lambda: self.files.save(staged, step, epoch, epoch_step, workers, best, elapsed),
            (step, epoch),
            time.thread_time() - copying,
        )
        return done

    def collect(self, wait=False):
        """``[(path, step, epoch)]`` of the write behind that completed since the last call (waiting for it
        with ``wait``); a write that failed raises its error here, in the training thread."""
        behind = self.behind.flight
        if behind is None or (behind.is_alive() and not wait):
            return []
        self.behind.flight = None
        path = behind.result()
        self._written(path, behind.step)
        return [(path, *behind.where)]


class Behind:
    """What writing behind training keeps: the write in flight (and the last one started), the arrays it
    copies the state into, a checkpoint that came due while the writer was busy (``owed``), the step the last
    write behind started at, and a sharded checkpoint whose parts are being synced."""

    def __init__(self):
        self.flight = self.last = None
        self.staging, self.owed, self.started_at = Staging(), False, None
        self.parts = None  # a sharded checkpoint under way (:class:`~mpidist.loop.sharded_save.ShardedWrite`)


class Staging:
    """Host arrays a checkpoint is copied into, kept for the next one: a write behind allocates once."""

    def __init__(self):
        self.arrays = {}

    def copy(self, key, array):
        """A copy of ``array`` in the arrays kept under ``key`` (made again where its shape or dtype
        changed)."""
        array = np.asarray(array)
        kept = self.arrays.get(key)
        if kept is None or kept.shape != array.shape or kept.dtype != array.dtype:
            # (written around the cache)
            kept = self.arrays[key] = bulk.aligned_empty(array.shape, array.dtype)
        np.copyto(kept, array)
        return kept
