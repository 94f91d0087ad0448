"""A timeline of every rank (``--trace``): Chrome trace events, merged by the chief into ``trace.json``.

Each rank buffers its own events in memory (a tuple appended per event, no
I/O, no MPI while training) and the chief gathers them at the end, shifted
onto its own clock (measured at start-up by a few ping-pongs with each rank:
the offset of the exchange with the shortest round trip).  The file loads in
Perfetto (ui.perfetto.dev) and ``chrome://tracing``: one process per rank,
three threads each:

* ``main``: what the rank's main thread is doing, as the stall monitor sees
  it (:mod:`mpidist.runtime.whereabouts`: ``compute``, ``exchange``, waits, ``serve``,
  checkpoint phases), with ``forward``/``backward`` nested in compute (and,
  with ``--trace detail``, each layer), pipeline ``send``/``recv`` spans
  joined by flow arrows from sender to receiver;
* ``steps``: each training step, each evaluation, each checkpoint;
* ``buckets``: each gradient bucket's allreduce, from its start to its
  arrival (overlapping backward where the exchange overlaps).

Categories (``cat``): compute, exchange, wait, serve, pipeline, eval,
checkpoint, io, setup, step.
"""

import json
import os
from pathlib import Path

import numpy as np

from ..runtime import comm as mpi
from ..runtime.errors import UsageError
from ..runtime.recorder import LIMIT, THREADS, now, tracer
from ..store import atomic
from ..store.outputs import special_kind

ROUNDS = 5  # ping-pongs per rank when aligning clocks: the shortest round trip's offset is kept
_TRACER = tracer()


def clock_offset(comm, root):
    """Collective: microseconds to add to this rank's :func:`now` to read ``root``'s clock (0 on ``root``).

    ``root`` answers each rank in turn; of :data:`ROUNDS` round trips the
    shortest bounds the error best (Cristian's algorithm).
    """
    rank = comm.Get_rank()
    stamp = np.zeros(1, dtype=np.float64)
    if rank == root:
        for other in range(comm.Get_size()):
            for _ in range(ROUNDS if other != root else 0):
                mpi.recv(comm, stamp, other, 0x7ACE)
                stamp[0] = now()
                mpi.send(comm, stamp, other, 0x7ACE)
        return 0.0
    best = None
    for _ in range(ROUNDS):
        sent = now()
        stamp[0] = sent
        mpi.send(comm, stamp, root, 0x7ACE)
        mpi.recv(comm, stamp, root, 0x7ACE)
        back = now()
        if best is None or back - sent < best[0]:
            best = (back - sent, float(stamp[0]) - (sent + back) / 2)
    return best[1]


def check_writable(path):
    """Raise :class:`UsageError` where ``path`` cannot be written at the end: checked before training
    starts."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--trace: {path} is a directory; the timeline is written there as a file")
    kind = special_kind(path)
    if kind is not None:  # (renamed over, the node would become a regular file)
        raise UsageError(
            f"--trace: {path} is {kind}; the timeline is written aside and renamed into place: "
            "remove it, or give another --run-dir"
        )
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise UsageError(f"--trace: cannot write {path} (its directory {path.parent} is not writable)")


def gather_and_write(comm, root, offset, label, path):
    """Collective: every rank's events to ``root``, which writes them to ``path`` (atomically), rank by rank.

    ``label``: this rank's process name (``rank 2 (ps, shard [0, 13061))``).
    Each rank's events travel as one message of JSON bytes and are written
    as they come, so the chief never holds them all.  Returns, on ``root``,
    None or why ``path`` could not be written (every rank's events are
    received all the same: no rank is left waiting); elsewhere None.
    """
    rank = comm.Get_rank()
    names = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
    ]
    names += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        for tid, name in THREADS.items()
    ]
    if _TRACER.dropped:
        names.append(
            {
                "name": "trace_truncated",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"events_not_recorded": _TRACER.dropped, "limit": LIMIT},
            }
        )
    events = names + _TRACER.records(rank, offset)
    _TRACER.disable()
    own = np.frombuffer(json.dumps(events)[1:-1].encode("utf-8"), dtype=np.uint8)  # (the list's items)
    size = np.array([own.size], dtype=np.int64)
    if rank != root:
        mpi.send(comm, size, root, 0x7ACE)
        mpi.send(comm, own, root, 0x7ACF)
        return None
    path = Path(path)
    aside = atomic.fresh_aside(path)
    problem, handle = None, None
    try:
        handle = open(aside, "wb")
        handle.write(
            b'{"displayTimeUnit":"ms","otherData":{"producer":"mpidist","clock":"the chief\'s, '
            b'microseconds"},"traceEvents":['
        )
    except OSError as err:
        problem = err.strerror or str(err)
    first = True
    for other in range(comm.Get_size()):
        data = own  # the root's own events, in their turn
        if other != root:
            mpi.recv(comm, size, other, 0x7ACE)
            data = np.empty(int(size[0]), dtype=np.uint8)
            mpi.recv(comm, data, other, 0x7ACF)
        if handle is not None and problem is None and data.size:
            try:
                handle.write((b"" if first else b",") + data.tobytes())
                first = False
            except OSError as err:
                problem = err.strerror or str(err)
    try:
        if handle is not None:
            if problem is None:
                handle.write(b"]}")
            handle.close()
        if problem is None:
            atomic.commit(aside, path)
    except OSError as err:
        problem = err.strerror or str(err)
    finally:
        atomic.remove_aside(aside)
    return problem
