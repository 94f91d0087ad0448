"""The figures of the steps since the last ``step`` line: loss, throughput, clipped and skipped steps.

Pure bookkeeping (no MPI, no I/O): the loop feeds each step's result in and
takes a line's figures out every ``--log-every`` steps.
"""

import math
import time


class StepWindow:
    """Figures of the steps taken since the last line, and the run's totals that come from them.

    Args:
        nan_patience: skipped steps in a row (NaN or Inf loss or gradients) after which the run diverged.
        clock: seconds, monotonic (a test passes its own).
    """

    def __init__(self, nan_patience, clock=time.perf_counter):
        self.nan_patience, self.clock = nan_patience, clock
        self.started = self.opened = clock()
        self.loss = 0.0
        self.steps = self.good = self.clipped = 0  # in the window
        self.trained = self.clipped_total = self.skipped_in_row = 0  # in the run, on this rank
        self.last_loss = math.nan  # the mean loss of the last window (or epoch) with a finite one

    def account(self, loss, skipped, clipped=False):
        """One step's result; returns True when ``skipped`` made one skip too many (the run diverged)."""
        self.steps += 1
        self.trained += 1
        self.clipped += bool(clipped)
        self.clipped_total += bool(clipped)
        if skipped:  # the same on every rank of a lockstep strategy, so all count alike
            self.skipped_in_row += 1
            return self.skipped_in_row > self.nan_patience
        self.skipped_in_row = 0
        self.loss, self.good = self.loss + loss, self.good + 1
        return False

    def diverged(self, step):
        """Why the run diverged at ``step``, in words."""
        return (
            f"the loss or gradients were NaN or Inf {self.skipped_in_row} step(s) in a row "
            f"(--nan-patience {self.nan_patience}), the last at step {step}: training diverged; lower --lr, "
            "or check the data"
        )

    def line(self, batch_size):
        """``(mean loss, samples per second, clipped steps, now)`` of the window; a new window opens."""
        now = self.clock()
        rate = self.steps * batch_size / (now - self.opened) if now > self.opened else 0.0
        self.last_loss = self.loss / self.good if self.good else math.nan
        clipped = self.clipped
        self.opened, self.loss, self.steps, self.good, self.clipped = now, 0.0, 0, 0, 0
        return self.last_loss, rate, clipped, now

    def end_epoch(self):
        """At an epoch's end: its last finite losses become the loss reported (evaluations, the summary)."""
        if self.good:
            self.last_loss = self.loss / self.good

    def elapsed(self):
        """Seconds since this part of the run started (a resumed run's time goes on in the checkpointer's
        clock)."""
        return self.clock() - self.started
