"""A run lineage's checkpoint files: what each stores beside the state, a whole one's writing, and pruning.

Every checkpoint a run writes stores the same record of the run beside the
state: its settings and seed, its lineage and the lineage it branched from,
the dataset's fingerprint.  The chief's whole checkpoint
(:class:`~mpidist.loop.checkpointer.Checkpointer`) and a split model's index
(:mod:`mpidist.loop.sharded_save`) store it alike and are pruned alike to the
newest ``--keep`` of the lineage, so both take it from here; the checkpointer
keeps deciding when a checkpoint is taken and what was written.
"""

from pathlib import Path

from ..data.fingerprint import fingerprint
from ..store import checkpoint_save
from ..store.lineage import CheckpointDir, file_name


class CheckpointFiles:
    """The checkpoint files a run lineage writes into ``--checkpoint-dir``, and what each stores beside the
    state.

    Args:
        config: the run's :class:`~mpidist.settings.config.Settings`.
        lineage: the run lineage its files belong to (see :mod:`mpidist.store.lineage`).
        parent: the lineage it branched from ("" for none).
        dataset: the :class:`~mpidist.data.DatasetInfo` trained on, whose fingerprint each checkpoint
            stores (taken at the first write, on the rank that writes); None: none stored.
    """

    def __init__(self, config, lineage, parent, dataset, parameters=()):
        self.config, self.lineage, self.parent = config, lineage, parent
        self.dataset, self.dataset_fingerprint = dataset, None
        #: the model's ``(name, shape, offset)``, which a whole checkpoint names under ``parameters/``
        self.parameters = list(parameters)

    def take_fingerprint(self):
        """The dataset's fingerprint, taken once, in the training thread (a write behind finds it taken)."""
        if self.dataset_fingerprint is None:
            self.dataset_fingerprint = fingerprint(self.dataset) if self.dataset is not None else ""

    def path(self, step):
        """The file the checkpoint of ``step`` is written to (a split model's: its index)."""
        return Path(self.config.checkpoint_dir) / file_name(step, self.lineage)

    def attributes(self, where, best, elapsed):
        """What a checkpoint of ``where`` (``(step, epoch, epoch_step, workers)``) stores beside the state, as
        a split model's index stores it; ``best``: the ``--keep-best`` record, ``elapsed``: the run's time so
        far."""
        step, epoch, epoch_step, workers = where
        return checkpoint_save.attributes(
            step,
            epoch,
            epoch_step,
            self.config.to_json(),
            self.config.seed,
            workers,
            self.lineage,
            self.parent,
            best,
            elapsed,
            self.dataset_fingerprint or "",
        )

    def save(self, state, step, epoch, epoch_step, workers, best, elapsed):
        """Write and prune (in the training thread, or behind it); the checkpoint's path."""
        config = self.config
        path = checkpoint_save.save(
            config.checkpoint_dir,
            state.params,
            state.optimizer,
            state.steps,
            step,
            epoch,
            epoch_step,
            config.to_json(),
            config.seed,
            workers,
            self.lineage,
            self.parent,
            best=best,
            elapsed=elapsed,
            per_worker=state.per_worker or None,
            dataset_fingerprint=self.dataset_fingerprint,
            parameters=self.parameters,
        )
        self.prune(path)
        return path

    def prune(self, newest):
        """Delete all but the newest ``--keep`` checkpoints of the lineage, never ``newest`` (the file just
        written); the paths removed."""
        return CheckpointDir(self.config.checkpoint_dir).prune(self.lineage, self.config.keep, newest=newest)
