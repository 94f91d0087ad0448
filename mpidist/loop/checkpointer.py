"""A run's checkpoints: taking one (whole or sharded, at once or behind training), and what was written.

:class:`Checkpointer` is three concerns in one object the loop holds: when a
checkpoint is taken (:mod:`mpidist.loop.checkpoint_timing`: one rule decides
when one is due, for the training loop, where the chief's clock is agreed on
at a step boundary, and for the first ps of ``ps-async`` and backup workers,
which decides for its workers), writing behind training
(:mod:`mpidist.loop.writing_behind`), and here, taking one and keeping the
record of what was written.  What each checkpoint stores beside the state, a
whole one's writing and pruning are the run lineage's files'
(:mod:`mpidist.loop.checkpoint_files`).
"""

import time
from pathlib import Path

from ..runtime.errors import RunError
from ..store import checkpoint_save, parts_debris
from . import sharded_save
from .checkpoint_files import CheckpointFiles
from .checkpoint_timing import CheckpointTiming
from .writing_behind import Behind, WritingBehind


class Checkpointer(CheckpointTiming, WritingBehind):
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
        self.start_schedule(step)
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

    def _written(self, path, step):
        self.written.append(path)
        self.last_step = step
