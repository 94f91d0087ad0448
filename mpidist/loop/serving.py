"""What a serving rank (a ps of ``ps-async`` or of backup workers) consults from the run while it serves."""

from .checkpointer import Checkpointer


class ServerControl:
    """What the ps ranks of ``ps-async`` and backup workers consult while they serve.

    Those workers are not in lockstep, so the train loop cannot agree on a
    step for them: a signal is passed on by the strategy, and mid-run
    checkpoints are decided and written by the first ps, which holds (or
    gathers) the whole state.  ``step`` here is the run's step: the chief's
    for ``ps-async``, the global version with backup workers.
    """

    def __init__(self, config, setup, signals, workers, start_step, lineages):
        self.setup, self.signals, self.workers = setup, signals, workers
        self.checkpointer = Checkpointer(
            config,
            start_step,
            *lineages,
            elapsed=setup.resume.elapsed if setup.resume is not None else 0.0,
            dataset=setup.info,
        )
        self.periodic = self.checkpointer.enabled and self.checkpointer.schedule.periodic

    def signalled(self):
        return self.signals.received

    def checkpoint_due(self, step):
        """Whether a checkpoint is due at ``step`` (the rule the training loop follows too)."""
        return self.checkpointer.schedule.due(step, self.checkpointer.clock())

    def write(self, step, state):
        """First ps: write ``state`` as the checkpoint of ``step`` (its data position from the step), behind.

        The workers do not wait for a ps: while it wrote, the chief's clock
        passed the next multiples of ``--checkpoint-every`` (a write of 20-70 ms
        against steps of 5 ms here), and those checkpoints were never taken.
        Written in a thread, the ps serves on and takes each one as its step
        comes; it waits for a write still under way only when the next is due.
        """
        epoch, epoch_step = divmod(step, self.setup.steps_per_epoch)
        self.checkpointer.write_behind(state, step, epoch, epoch_step, self.workers)

    def finish_writes(self):
        """After serving: the write still under way is completed (a failed one raises here)."""
        self.checkpointer.collect(wait=True)
