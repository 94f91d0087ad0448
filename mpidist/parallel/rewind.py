"""Taking the last update back: what lets the survivors of a lost rank agree on one step (``--elastic``).

A rank that holds a slice of the state nobody else holds (a ps-sync ps's
shard, a pipeline stage's layers) may have applied a step's update that
another survivor never saw: a collective that a death breaks may complete on
some ranks and fail on others.  Such a rank keeps its slice as it was before
the last update (:class:`PreviousSlice`, one copy a step) and counts the
steps it took (:class:`StepLedger`); the survivors agree on a step, and a
rank one update ahead of it takes that update back.
"""

import numpy as np


class PreviousSlice:
    """A slice of the parameters and its optimizer state as they were before the last update."""

    def __init__(self, params, optimizer):
        self.params = params.copy()
        self.arrays = {name: array.copy() for name, array in optimizer.state_arrays().items()}
        self.steps = optimizer.steps

    def keep(self, params, optimizer):
        self.params[...] = params
        for name, array in optimizer.state_arrays().items():
            np.copyto(self.arrays[name], array)
        self.steps = optimizer.steps

    def restore(self, params, optimizer):
        params[...] = self.params
        optimizer.load_state(self.arrays, self.steps)


class StepLedger:
    """A rank's count of the steps it took, and (under ``--elastic``) its slice before the last one.

    Args:
        previous: a :class:`PreviousSlice` to keep each step, or None (no ``--elastic``).
    """

    def __init__(self, previous=None):
        self.previous = previous
        self.start_step = 0  # the run's step at initialize
        self.applied = 0  # steps this rank has taken part in since (updated or skipped)

    @property
    def step(self):
        """The run's step this rank's slice is at."""
        return self.start_step + self.applied

    def keep(self, params, optimizer):
        """Before a step's update: remember the slice as it is (under ``--elastic``)."""
        if self.previous is not None:
            self.previous.keep(params, optimizer)

    def rewind_to(self, step, params, optimizer):
        """Make the slice the one of the agreed ``step``: a rank one update ahead takes it back."""
        ahead = self.step - step
        assert ahead in (0, 1), f"this rank is at step {self.step}, the survivors agreed on step {step}"
        if ahead:
            self.previous.restore(params, optimizer)
