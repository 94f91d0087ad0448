"""A run's checkpoints: when one is due, writing it with its position and pruning, and what was written.

One rule decides when a checkpoint is due, for the training loop (lockstep
strategies, where the chief's clock is agreed on at a step boundary) and for
the first ps of ``ps-async`` and backup workers (which decides for its
workers): a step that passes a multiple of ``--checkpoint-every``, or
``--checkpoint-seconds`` since the last one.  The rule is pure (the clock is
passed in) and tested without MPI.
"""

import time

from ..data.fingerprint import fingerprint
from ..store import checkpoint
from ..store.lineage import CheckpointDir


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

    def __init__(self, config, step, lineage="", parent="", clock=time.perf_counter, elapsed=0.0, dataset=None):
        self.config, self.clock, self.lineage, self.parent = config, clock, lineage, parent or ""
        self.dataset, self.dataset_fingerprint = dataset, None
        self.origin = clock() - elapsed
        self.schedule = CheckpointSchedule(config.checkpoint_every, config.checkpoint_seconds, step, clock())
        self.written = []   # paths this process wrote, oldest first
        self.last_step = None
        self.taken_at = None   # the step the run's state was last checkpointed at, on every rank (once a step)
        self.best = None    # --keep-best: the file that keeps the best checkpoint, once there is one

    def run_time(self, now=None):
        """Seconds the run has trained, resumed parts included (what the metrics' ``time`` and checkpoints say)."""
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

    def keep_best(self, step):
        """Keep the checkpoint of ``step`` (written last) as ``best-<lineage>.h5``, beyond pruning; its path.

        A hard link where the file system allows it (no copy), else a copy; put
        in place by an atomic rename, so the best checkpoint is never half there.
        """
        assert self.last_step == step, f"the checkpoint of step {step} is not the last written"
        self.best = checkpoint.keep_as(self.last, f"best-{self.lineage or 'run'}.h5")
        return self.best

    def write(self, state, step, epoch, epoch_step, workers, best=None, data_position=None):
        """Write ``state`` (``(params, optimizer arrays, optimizer steps[, each worker's own state])``) as the
        checkpoint of ``step``; prune.

        ``best``: the ``--keep-best`` figure's best so far (``{"figure", "value", "step"}``), stored with it.
        ``data_position``: what is left of the epoch (:func:`mpidist.loop.feed.data_position`), stored with it.
        """
        config = self.config
        params, opt_state, opt_steps, *per_worker = state
        if self.dataset_fingerprint is None:
            self.dataset_fingerprint = fingerprint(self.dataset) if self.dataset is not None else ""
        path = checkpoint.save(config.checkpoint_dir, params, opt_state, opt_steps, step, epoch, epoch_step,
                               config.to_json(), config.seed, workers, self.lineage, self.parent, best=best,
                               elapsed=self.run_time(), per_worker=per_worker[0] if per_worker else None,
                               dataset_fingerprint=self.dataset_fingerprint, data_position=data_position)
        CheckpointDir(config.checkpoint_dir).prune(self.lineage, config.keep, newest=path)
        self.written.append(path)
        self.last_step = step
        return path
