"""Where a rank's main thread is: the step, a phase, since when, and what it is doing there.

One record per process (:func:`here`), written by the main thread with two
attribute writes and read by the watch threads of :mod:`mpidist.observe.stall`.
Set-up code marks its I/O with :meth:`Whereabouts.doing`, so a read or an
``open()`` that never returns (a hung network file system) is named by what
it was doing, not only that it hangs.
"""

import contextlib
import threading
import time

import numpy as np

from .recorder import tracer

_TRACER = tracer()

#: Phases a rank can be in; those in WAITS are where it blocks on other ranks or on I/O.
PHASES = (
    "start",
    "compute",
    "exchange",
    "staleness-bound",
    "agree",
    "gather",
    "write",
    "finish",
    "serve",
    "setup",
    "io",
)
WAITS = frozenset({"start", "exchange", "staleness-bound", "agree", "gather", "finish", "io"})


class Whereabouts:
    """``step``, ``phase``, the monotonic time it entered the phase (``since``) and a ``detail`` in words."""

    def __init__(self):
        self.step, self.phase, self.since, self.detail = 0, "start", time.monotonic(), ""
        # (the chief's rank, its last record, when it came): kept by the chief's deputy
        self.chief_heard = None
        self.patience = 1  # graces this rank's own watch waits past the timeout (2: let the deputy speak)

    def enter(self, phase, step=None, detail=""):
        """Record that the main thread entered ``phase`` (at ``step``, if given)."""
        if step is not None:
            self.step = step
        if phase != self.phase or detail != self.detail:
            if _TRACER.on and phase != self.phase:  # --trace: the phase just left is a span of the timeline
                _TRACER.phase(self.phase, self.step)
            self.phase, self.detail, self.since = phase, detail, time.monotonic()

    @contextlib.contextmanager
    def doing(self, phase, detail):
        """``phase`` with ``detail`` for the body (``with here().doing("io", "opening x")``), then back.

        The record is the training thread's: in mpidist's own background
        threads (named ``mpidist-...``: a stream's reader shares the reading
        code) the body runs unrecorded, or the training thread would seem to
        wait on I/O while it computes, and be put back into a phase it has left.
        """
        if threading.current_thread().name.startswith("mpidist-"):
            yield
            return
        previous = self.phase, self.detail
        self.enter(phase, detail=detail)
        try:
            yield
        finally:
            self.enter(previous[0], detail=previous[1])

    def record(self):
        """``[step, phase index, milliseconds in the phase]``, as the watch threads send it."""
        return np.array([self.step, PHASES.index(self.phase), int(1000 * self.spent())], dtype=np.int64)

    def spent(self, now=None):
        """Seconds in the current phase."""
        return (time.monotonic() if now is None else now) - self.since

    def describe(self):
        """``exchange at step 13`` or ``io (opening --metrics m.jsonl) at step 0``."""
        return f"{self.phase}{f' ({self.detail})' if self.detail else ''} at step {self.step}"


_HERE = Whereabouts()


def here():
    """This process's record (its main thread's)."""
    return _HERE
