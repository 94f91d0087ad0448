"""A timeline of every rank (``--trace``): Chrome trace events, merged by the chief into ``trace.json``.

Each rank buffers its own events in memory (a tuple appended per event, no
I/O, no MPI while training) and the chief gathers them at the end, shifted
onto its own clock (measured at start-up by a few ping-pongs with each rank:
the offset of the exchange with the shortest round trip).  The file loads in
Perfetto (ui.perfetto.dev) and ``chrome://tracing``: one process per rank,
three threads each:

* ``main``: what the rank's main thread is doing, as the stall monitor sees
  it (:mod:`mpidist.whereabouts`: ``compute``, ``exchange``, waits, ``serve``,
  checkpoint phases), with ``forward``/``backward`` nested in compute (and,
  with ``--trace detail``, each layer), pipeline ``send``/``recv`` spans
  joined by flow arrows from sender to receiver;
* ``steps``: each training step, each evaluation, each checkpoint;
* ``buckets``: each gradient bucket's allreduce, from its start to its
  arrival (overlapping backward where the exchange overlaps).

Categories (``cat``): compute, exchange, wait, serve, pipeline, eval,
checkpoint, io, setup, step.
"""

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np

MAIN, STEPS, BUCKETS = 0, 1, 2
THREADS = {MAIN: "main", STEPS: "steps", BUCKETS: "buckets"}
#: the trace category of each phase of :mod:`mpidist.whereabouts`
CATEGORY = {"compute": "compute", "exchange": "exchange", "staleness-bound": "wait", "agree": "wait",
            "start": "wait", "finish": "wait", "gather": "checkpoint", "write": "checkpoint", "serve": "serve",
            "setup": "setup", "io": "io"}
ROUNDS = 5          # ping-pongs per rank when aligning clocks: the shortest round trip's offset is kept
FLOW_BITS = 52      # flow ids stay exact in JavaScript numbers


def now():
    """Microseconds on this process's monotonic clock (the unit of the Chrome format)."""
    return time.perf_counter_ns() / 1e3


class Tracer:
    """This process's buffer of trace events; off (and free) until :meth:`enable`."""

    def __init__(self):
        self.on, self.detail, self.events, self.phase_start = False, False, [], None

    def enable(self, detail=False):
        self.on, self.detail, self.events, self.phase_start = True, bool(detail), [], now()

    def disable(self):
        self.on, self.phase_start = False, None

    def phase(self, previous, step):
        """The main thread leaves phase ``previous`` (of :mod:`mpidist.whereabouts`) now: one span for it."""
        at = now()
        if self.phase_start is not None:
            self.events.append(("X", previous, CATEGORY.get(previous, "wait"), self.phase_start, at - self.phase_start,
                                MAIN, {"step": step}))
        self.phase_start = at

    def complete(self, name, cat, start, tid=MAIN, **args):
        """A span from ``start`` (:func:`now`) to now."""
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
            self.events.append(("X", name, cat, start, now() - start, tid, args))

    def flow(self, begins, flow_id, name):
        """One end of an arrow between ranks: ``begins`` at the sender (inside its send span), else the receiver."""
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
                    record["bp"] = "e"     # binds to the span that encloses it (the receive)
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


def clock_offset(comm, root):
    """Collective: microseconds to add to this rank's :func:`now` to read ``root``'s clock (0 on ``root``).

    ``root`` answers each rank in turn; of :data:`ROUNDS` round trips the
    shortest bounds the error best (Cristian's algorithm).
    """
    from . import comm as mpi

    rank = comm.Get_rank()
    stamp = np.zeros(1, dtype=np.float64)
    if rank == root:
        for other in range(comm.Get_size()):
            for _ in range(ROUNDS if other != root else 0):
                mpi.recv(comm, stamp, other, 0x7ace)
                stamp[0] = now()
                mpi.send(comm, stamp, other, 0x7ace)
        return 0.0
    best = None
    for _ in range(ROUNDS):
        sent = now()
        stamp[0] = sent
        mpi.send(comm, stamp, root, 0x7ace)
        mpi.recv(comm, stamp, root, 0x7ace)
        back = now()
        if best is None or back - sent < best[0]:
            best = (back - sent, float(stamp[0]) - (sent + back) / 2)
    return best[1]


def gather_and_write(comm, root, offset, label, path):
    """Collective: every rank's events to ``root``, which writes them to ``path`` (atomically).

    ``label``: this rank's process name (``rank 2 (ps, shard [0, 13061))``).
    Returns the number of events written on ``root``, else None.
    """
    from . import comm as mpi

    rank = comm.Get_rank()
    names = [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}},
             {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    names += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
              for tid, name in THREADS.items()]
    data = np.frombuffer(json.dumps(names + _TRACER.records(rank, offset)).encode("utf-8"), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    mpi.gather(comm, np.array([data.size], dtype=np.int64), sizes, root)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    gathered = np.empty(int(sizes.sum()) if comm.Get_rank() == root else 0, dtype=np.uint8)
    mpi.gatherv(comm, data, gathered, sizes, displs, root)
    _TRACER.disable()
    if comm.Get_rank() != root:
        return None
    events = []
    for other in range(comm.Get_size()):
        events.extend(json.loads(gathered[displs[other]:displs[other] + sizes[other]].tobytes()))
    _write(path, {"traceEvents": events, "displayTimeUnit": "ms",
                  "otherData": {"producer": "mpidist", "clock": "the chief's, microseconds"}})
    return len(events)


def _write(path, document):
    path = Path(path)
    aside = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(aside, "w", encoding="utf-8") as handle:
            json.dump(document, handle, separators=(",", ":"))
        os.replace(aside, path)
    finally:
        if aside.exists():
            aside.unlink()
