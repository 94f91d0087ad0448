"""Where a run is: its step, the epoch and the step within that epoch."""

import dataclasses

import numpy as np


@dataclasses.dataclass
class Position:
    """The run's ``step`` (steps taken), its ``epoch`` (0-based) and ``epoch_step`` (steps taken in it).

    One object per run, moved by the loop and read by the recovery of an
    elastic run (:class:`~mpidist.loop.elastic.State`), which agrees on the
    chief's.
    """

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0

    @classmethod
    def of(cls, resume, steps_per_epoch):
        """Where a run starts: ``resume``'s position (a checkpoint), or the beginning; a full epoch rolls
        over."""
        if resume is None:
            return cls()
        if resume.epoch_step >= steps_per_epoch:
            return cls(resume.step, resume.epoch + 1, 0)
        return cls(resume.step, resume.epoch, resume.epoch_step)

    def shifted(self, steps, steps_per_epoch):
        """This position ``steps`` (-1, 0 or 1) steps on, in epochs of ``steps_per_epoch`` (a new object)."""
        if steps not in (-1, 0, 1):
            raise ValueError(f"a position moves one step at most, not {steps}")
        if steps < 0 and self.epoch_step == 0:  # the last step of the epoch before
            return Position(self.step - 1, self.epoch - 1, steps_per_epoch - 1)
        if steps > 0 and self.epoch_step >= steps_per_epoch:  # the first of the next one
            return Position(self.step + 1, self.epoch + 1, 1)
        return Position(self.step + steps, self.epoch, self.epoch_step + steps)

    def move_to(self, other):
        """Take ``other``'s place (in place: everyone holding this object sees it)."""
        self.step, self.epoch, self.epoch_step = other.step, other.epoch, other.epoch_step

    def as_array(self):
        return np.array([self.step, self.epoch, self.epoch_step], dtype=np.int64)
