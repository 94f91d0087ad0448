"""A run's checkpoints: when one is due, taking it (whole or sharded, behind training), and what was written.

One rule decides when a checkpoint is due, for the training loop (lockstep
strategies, where the chief's clock is agreed on at a step boundary) and for
the first ps of ``ps-async`` and backup workers (which decides for its
workers): a step that passes a multiple of ``--checkpoint-every``, or
``--checkpoint-seconds`` since the last one.  The rule is pure (the clock is
passed in) and tested without MPI.  What each checkpoint stores beside the
state, a whole one's writing and pruning are the run lineage's files'
(:mod:`mpidist.loop.checkpoint_files`).
"""

import time
from pathlib import Path

import numpy as np

from ..runtime.errors import RunError
from ..store import bulk, checkpoint_save, parts_debris
from . import sharded_save
from ..parallel.saved_state import WholeState
from .checkpoint_files import CheckpointFiles
from .writer import BehindWrite


class CheckpointSchedule:
    """When a checkpoint is due.

    Args:
        every: steps between checkpoints (0: none by step count).
        seconds: seconds between checkpoints (0: none by time).
        step: the step the run starts at.
        now: the clock's reading at that start.
    """

    def __init__(self, every, seconds, step, now):
        self.every, self.seconds = int(every), float(seconds)
        self.last_step, self.last_time = int(step), float(now)

    @property
    def periodic(self):
        """Whether checkpoints come during the run at all (not only at its end)."""
        return bool(self.every or self.seconds)

    def crossed(self, step):
        """Whether ``step`` passed a multiple of ``every`` since the last step asked about."""
        passed = bool(self.every) and step // self.every > self.last_step // self.every
        self.last_step = max(self.last_step, step)
        return passed

    def timed(self, now):
        """Whether ``seconds`` passed since the last checkpoint that was due; restarts the wait if so."""
        if not self.seconds or now - self.last_time < self.seconds:
            return False
        self.last_time = now
        return True

    def due(self, step, now):
        """Either rule, as one ps decides for workers that are not in lockstep."""
        crossed, timed = self.crossed(step), self.timed(now)
        if crossed:
            self.last_time = now
        return crossed or timed


class Checkpointer:
    """Writes a run's checkpoints into ``--checkpoint-dir`` and keeps the newest ``--keep`` of its lineage.

    Args:
        config: the run's :class:`~mpidist.settings.config.Settings`.
        step: the step the run starts at (a resumed run's).
        lineage: the run lineage its files belong to (see :mod:`mpidist.store.lineage`); ``parent``: the one
            it branched from.
        clock: seconds, monotonic (a test passes its own).
        elapsed: seconds the run had trained before this start (a resumed run's): each checkpoint
            stores the run's time so far, so a resumed run's metrics go on counting from it.
        dataset: the :class:`~mpidist.data.DatasetInfo` trained on, whose fingerprint each checkpoint
            stores (taken at the first write, on the rank that writes); None: none stored.
    """

    def __init__(
        self,
        config,
        step,
        lineage="",
        parent="",
        clock=time.perf_counter,
        elapsed=0.0,
        dataset=None,
        parameters=(),
    ):
        self.config, self.clock = config, clock
        # (the lineage's files: what each checkpoint stores beside the state, a whole one's writing, pruning;
        # ``parameters``, the model's names, shapes and offsets, which a whole one names its views by)
        self.files = CheckpointFiles(config, lineage, parent or "", dataset, parameters)
        self.origin = clock() - elapsed
        self.schedule = CheckpointSchedule(config.checkpoint_every, config.checkpoint_seconds, step, clock())
        self.written = []  # paths this process wrote, oldest first
        self.last_step = None
        self.taken_at = None  # the step the run's state was last checkpointed at, on every rank (once a step)
        self.best = None  # --keep-best: the file that keeps the best checkpoint, once there is one
        self.behind = Behind()  # writing behind training (lockstep strategies)

    def run_time(self, now=None):
        """Seconds the run has trained, resumed parts included (what the metrics' ``time`` and checkpoints
        say)."""
        return (self.clock() if now is None else now) - self.origin

    @property
    def enabled(self):
        return bool(self.config.checkpoint_dir)

    @property
    def last(self):
        """The newest checkpoint this process wrote, or None."""
        return self.written[-1] if self.written else None

    def kept(self):
        """The checkpoints this process wrote that pruning kept, oldest first."""
        return [path for path in self.written if path.exists()]

    def keep_best(self, step, resumed=None):
        """Keep the checkpoint of ``step`` (written last, or else ``resumed``'s file: a run resumed at its end
        writes none of its own) as ``best-<lineage>.h5``, beyond pruning; its path.

        A hard link where the file system allows it (no copy), else a copy; put
        in place by an atomic rename, so the best checkpoint is never half there.
        """
        source = (
            self.last
            if self.last_step == step
            else Path(resumed.path)
            if resumed is not None and resumed.step == step
            else None
        )
        if source is None or not source.is_file():
            raise RunError(
                f"--keep-best: the checkpoint of step {step}, the best so far, was neither written by "
                f"this run nor resumed from ({source or 'none'}): it cannot be kept"
            )
        self.best = checkpoint_save.keep_as(source, f"best-{self.files.lineage or 'run'}.h5")
        # (the best it replaced may have been the last to name a pruned sharded checkpoint's parts; nothing is
        # being written now: take() completed every write)
        parts_debris.remove_unnamed_folders(self.config.checkpoint_dir)
        return self.best

    def write(self, state, step, epoch, epoch_step, workers, best=None):
        """Write ``state`` (a :class:`~mpidist.parallel.saved_state.WholeState`) as the checkpoint of
        ``step``; prune.

        ``best``: the ``--keep-best`` figure's best so far (``{"figure", "value", "step"}``), stored with it.
        """
        self.collect(wait=True)  # (never two in flight)
        self.files.take_fingerprint()
        path = self.files.save(state, step, epoch, epoch_step, workers, best, self.run_time())
        self._written(path, step)
        return path

    def take(self, cluster, placement, placed, state, where, best, behind):
        """Collective where the model is split: write the checkpoint of ``where`` (``(step, epoch, epoch_step,
        workers)``): by the ranks that hold the model, each its ``placed`` state (a
        :class:`~mpidist.parallel.saved_state.PlacedState`, ordered as ``placement``), or else by the chief
        from the gathered ``state`` (a :class:`~mpidist.parallel.saved_state.WholeState`), behind training
        with ``behind``.  Returns the ``(path, step, epoch)`` of what the chief wrote (or completed) since the
        last call."""
        chief, (step, epoch) = cluster.is_chief, where[:2]
        if placed is None and chief and behind:
            return self.write_behind(state, *where, best=best)
        done = self.complete_parts()  # (collective where the model is split: a sharded write under way ends)
        done += self.collect(wait=True) if chief else []
        if placed is not None:
            return done + self.write_sharded(
                cluster.world,
                placement,
                placed,
                where,
                cluster.chief_rank,
                best,
                behind and not self.config.elastic,
            )
        if chief:
            done.append((self.write(state, *where, best=best), step, epoch))
        return done

    def write_sharded(self, comm, placement, placed, where, root, best=None, behind=False):
        """Collective over ``comm``: the checkpoint of ``where`` (``(step, epoch, epoch_step, workers)``)
        written by the ranks that hold the model, each its own slices (:mod:`mpidist.loop.sharded_save`), and
        pruned by ``root``, the chief; what it completed (as :meth:`take`).  ``behind``: the parts are synced
        and the index written in threads, and a later step boundary completes it (:meth:`at_boundary`).  Never
        under ``--elastic``: completing it is collective, and a lost rank would leave it half done."""
        if comm.Get_rank() == root:
            self.files.take_fingerprint()
        self.behind.parts = write = sharded_save.ShardedWrite(
            self.files,
            comm,
            placement,
            placed,
            where,
            root,
            best=best,
            behind=behind,
            elapsed=self.run_time(),
        )
        if not behind:
            return self.complete_parts()
        if write.part is not None:  # (this rank's syncing thread: busy while it rests, as a chief's write is)
            self.behind.last = write.part
        return []

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

    def _written(self, path, step):
        self.written.append(path)
        self.last_step = step

    # -- writing behind training ---------------------------------------------------------------------------
    @property
    def busy(self):
        """Whether the writer behind training is not free (on the chief; never elsewhere): a write in flight,
        or the rest after one that keeps writing within :data:`~mpidist.loop.writer.WRITER_SHARE` of the
        chief's time."""
        last = self.behind.last
        return last is not None and (last.is_alive() or time.monotonic() < last.free_at())

    def rolled_back(self, step):
        """Every rank, as the survivors of a lost rank go back to ``step``: the schedule goes on from there
        and nothing is owed or recently started.  These lockstep decisions are each rank's own record of the
        boundaries it went through, and a loss finds the ranks at different points of one (some past the
        boundary's agreement, some failed in it): one rank that still owed a checkpoint started it at the
        next boundary alone, its save waiting for good on ranks that stepped on."""
        self.schedule = CheckpointSchedule(
            self.config.checkpoint_every, self.config.checkpoint_seconds, step, self.clock()
        )
        self.behind.owed, self.behind.started_at = False, None

    def starts_at(self, step, due, busy):
        """Lockstep, alike on every rank: whether the checkpoint owed (``due`` now, or deferred) starts at
        ``step``.

        ``busy``: the chief's writer was busy at the step before (as the step
        agreement says, one step late); a write that started at the step
        before is busy whatever that said.  A checkpoint due meanwhile waits
        for the writer (several such become one), so training never waits for it.
        """
        behind = self.behind
        behind.owed = behind.owed or bool(due)
        return behind.owed and not busy and (behind.started_at is None or behind.started_at < step - 1)

    def taken(self, step):
        """Every rank: the checkpoint owed was taken at ``step`` (the chief writes it behind training)."""
        self.behind.owed, self.behind.started_at = False, step

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
