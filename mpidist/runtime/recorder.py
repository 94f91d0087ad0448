"""This process's buffer of timeline events (``--trace``): recorded in memory, no I/O, no MPI.

Each event is a tuple appended to a list while training; the writer of
``trace.json`` (:mod:`mpidist.observe.trace`) gathers every rank's at the
end.  The phases of :mod:`mpidist.runtime.whereabouts` become spans of the
``main`` thread; strategies add ``steps`` and ``buckets`` spans and the
arrows between pipeline stages.
"""

import contextlib
import time

MAIN, STEPS, BUCKETS = 0, 1, 2
THREADS = {MAIN: "main", STEPS: "steps", BUCKETS: "buckets"}
#: the trace category of each phase of :mod:`mpidist.runtime.whereabouts`
CATEGORY = {
    "compute": "compute",
    "exchange": "exchange",
    "staleness-bound": "wait",
    "agree": "wait",
    "start": "wait",
    "finish": "wait",
    "gather": "checkpoint",
    "write": "checkpoint",
    "serve": "serve",
    "setup": "setup",
    "io": "io",
}
FLOW_BITS = 52  # flow ids stay exact in JavaScript numbers
LIMIT = 2_000_000  # events a rank keeps (a few hundred MB of JSON); later ones are counted, not kept


def now():
    """Microseconds on this process's monotonic clock (the unit of the Chrome format)."""
    return time.perf_counter_ns() / 1e3


class Tracer:
    """This process's buffer of trace events; off (and free) until :meth:`enable`."""

    def __init__(self):
        self.on, self.detail, self.events, self.phase_start, self.dropped = False, False, [], None, 0

    def enable(self, detail=False):
        self.on, self.detail, self.events, self.phase_start, self.dropped = True, bool(detail), [], now(), 0

    def _full(self):
        """Whether the buffer holds :data:`LIMIT` events (then the event is counted, not kept)."""
        if len(self.events) < LIMIT:
            return False
        self.dropped += 1
        return True

    def disable(self):
        self.on, self.phase_start = False, None

    def phase(self, previous, step):
        """The main thread leaves phase ``previous`` (of :mod:`mpidist.runtime.whereabouts`) now: one span for
        it."""
        at = now()
        if self.phase_start is not None and not self._full():
            self.events.append(
                (
                    "X",
                    previous,
                    CATEGORY.get(previous, "wait"),
                    self.phase_start,
                    at - self.phase_start,
                    MAIN,
                    {"step": step},
                )
            )
        self.phase_start = at

    def complete(self, name, cat, start, tid=MAIN, **args):
        """A span from ``start`` (:func:`now`) to now."""
        if not self._full():
            self.events.append(("X", name, cat, start, now() - start, tid, args))

    @contextlib.contextmanager
    def span(self, name, cat, tid=MAIN, **args):
        """The body as one span (nothing recorded while tracing is off)."""
        if not self.on:
            yield
            return
        start = now()
        try:
            yield
        finally:
            if not self._full():
                self.events.append(("X", name, cat, start, now() - start, tid, args))

    def flow(self, begins, flow_id, name):
        """One end of an arrow between ranks: ``begins`` at the sender (inside its send span), else the
        receiver."""
        if not self._full():
            self.events.append(("s" if begins else "f", name, "pipeline", now(), 0, MAIN, flow_id))

    def records(self, pid, offset):
        """The events as Chrome trace records of process ``pid``, shifted by ``offset`` microseconds."""
        out = []
        for ph, name, cat, ts, dur, tid, extra in self.events:
            record = {"name": name, "cat": cat, "ph": ph, "pid": pid, "tid": tid, "ts": round(ts + offset, 3)}
            if ph == "X":
                record["dur"] = round(dur, 3)
                if extra:
                    record["args"] = extra
            else:
                record["id"] = extra
                if ph == "f":
                    record["bp"] = "e"  # binds to the span that encloses it (the receive)
            out.append(record)
        return out


_TRACER = Tracer()


def tracer():
    """This process's tracer."""
    return _TRACER


def flow_id(*parts):
    """An id both ends of an arrow compute alike from what they both know (step, micro-batch, stages...)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % (1 << FLOW_BITS)
    return value
