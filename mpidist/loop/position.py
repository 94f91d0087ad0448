"""Where a run is: its step, the epoch and the step within that epoch."""

import dataclasses

import numpy as np


@dataclasses.dataclass
class Position:
    """The run's ``step`` (steps taken), its ``epoch`` (0-based) and ``epoch_step`` (steps taken in it).

    ``segment``: where the run entered its epoch midway, what was left of it
    (the rest of the epoch follows from it, the worker count and the steps
    since).  One object per run, moved by the loop and read by the recovery of an
    elastic run (:class:`~mpidist.loop.elastic.State`), which agrees on the
    chief's.
    """

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    # ``(epoch, epoch_step, remaining)``: what was left of ``epoch`` at its step ``epoch_step``, where the run
    # started (a checkpoint, or the survivors of a lost rank) inside it (mpidist.data.virtual); None: the
    # epoch is whole at its step 0
    segment: tuple = None

    @classmethod
    def of(cls, resume, steps_per_epoch):
        """Where a run starts: ``resume``'s position (a checkpoint), or the beginning; a full epoch rolls over."""
        if resume is None:
            return cls()
        if resume.epoch_step >= steps_per_epoch:
            return cls(resume.step, resume.epoch + 1, 0)
        segment = None if resume.remaining is None else (resume.epoch, resume.epoch_step, resume.remaining)
        return cls(resume.step, resume.epoch, resume.epoch_step, segment)

    def move_to(self, other):
        """Take ``other``'s place (in place: everyone holding this object sees it)."""
        self.step, self.epoch, self.epoch_step = other.step, other.epoch, other.epoch_step
        self.segment = other.segment

    def as_array(self):
        """``step, epoch, epoch_step`` (what the survivors of a lost rank agree on; the segment follows from them)."""
        return np.array([self.step, self.epoch, self.epoch_step], dtype=np.int64)
