"""Hang diagnosis: when ranks wait longer than ``--stall-timeout``, say who has not arrived, then end.

Horovod's stall check, for MPI: each rank's main thread records where it is
(:class:`Whereabouts`: the step, a phase such as ``exchange``, and since
when), which costs two attribute writes.  A monitor thread on every rank sends
that record to the chief every ``interval`` seconds, on a communicator of its
own (a ``Dup`` of the world, so it never matches the training's messages;
this needs ``MPI_THREAD_MULTIPLE``, which mpi4py asks for).  The chief's
monitor keeps the latest record of every rank.  When a rank has waited in one
phase (an exchange, the step agreement, an evaluation, the final gather)
longer than the timeout, the chief prints which ranks are elsewhere, or
silent, and where they were last seen, and ends the job with exit code 1:

    mpidist: error: stalled for 5.0 s (--stall-timeout 5): ranks 0, 2, 3 wait in exchange at step 13;
    not arrived: rank 1 (compute at step 13 for 5.2 s)

Computing, serving (ps-async and backup ps ranks) and the chief's
checkpoint writes are not waits: a long one shows as the others waiting for
it.  Set the timeout above the longest of those in your runs.
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .errors import EXIT_FAILURE, error_line

#: Phases a rank can be in; those in WAITS are where ranks block on others.
PHASES = ("start", "compute", "exchange", "staleness-bound", "agree", "gather", "write", "finish", "serve")
WAITS = frozenset({"start", "exchange", "staleness-bound", "agree", "gather", "finish"})
TAG = 91


class Whereabouts:
    """Where this rank's main thread is: ``step``, ``phase`` and the monotonic time it entered the phase."""

    def __init__(self):
        self.step, self.phase, self.since = 0, "start", time.monotonic()

    def enter(self, phase, step=None):
        """Record that the main thread entered ``phase`` (at ``step``, if given)."""
        if step is not None:
            self.step = step
        if phase != self.phase:
            self.phase, self.since = phase, time.monotonic()

    def record(self):
        """``[step, phase index, milliseconds in the phase]`` as sent to the chief."""
        return np.array([self.step, PHASES.index(self.phase), int(1000 * (time.monotonic() - self.since))],
                        dtype=np.int64)


def describe(ranks):
    """``rank 3`` or ``ranks 0, 2, 3``."""
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def report_interval(timeout):
    """Seconds between a rank's reports: often enough that three missed ones are well inside the timeout."""
    return min(1.0, timeout / 5)


def diagnose(records, heard, now, timeout):
    """The chief's verdict: a message if some rank has waited longer than ``timeout``, else None.

    Args:
        records: per rank, the last ``[step, phase index, ms in phase]`` received (None: never heard).
        heard: per rank, the monotonic time that record arrived.
        now: the chief's monotonic time.
        timeout: seconds.

    A rank whose last three reports are missing is silent (frozen, or gone):
    what it said last no longer tells where it is.  A pure function, so the
    verdicts are tested without threads or MPI.
    """
    size = len(records)
    silence = 3 * report_interval(timeout)
    seen = {}
    for rank in range(size):
        if records[rank] is not None:
            step, phase, ms = (int(v) for v in records[rank])
            seen[rank] = (step, PHASES[phase], ms / 1000 + now - heard[rank], now - heard[rank])
    # a silent rank may be frozen or gone: what it last said is no evidence that it waits now
    waiting = [r for r, (step, phase, spent, silent) in seen.items()
               if phase in WAITS and spent > timeout and silent <= silence]
    if not waiting:
        return None
    longest = max(waiting, key=lambda r: seen[r][2])
    where = seen[longest][:2]
    waiters = [r for r in waiting if seen[r][:2] == where]
    late = []
    for rank in range(size):
        if rank in waiters:
            continue
        if rank not in seen:
            late.append(f"rank {rank} (never reported)")
            continue
        step, phase, spent, silent = seen[rank]
        last = f"{phase} at step {step}"
        if silent > silence:
            late.append(f"rank {rank} (no report for {silent:.1f} s; last seen in {last})")
        elif (step, phase) != where and phase != "serve":   # a serving ps waits for nobody
            late.append(f"rank {rank} ({last} for {spent:.1f} s)")
    step, phase = where
    arrived = f"not arrived: {', '.join(late)}" if late else "every rank is there: a deadlock in MPI"
    return (f"stalled for {seen[longest][2]:.1f} s (--stall-timeout {timeout:g}): {describe(waiters)} "
            f"wait{'s' if len(waiters) == 1 else ''} in {phase} at step {step}; {arrived}")


class StallMonitor:
    """The monitor threads; collective to start (:meth:`start`) and to :meth:`close`.

    Args:
        world: the communicator of the run (duplicated here).
        chief: world rank that gathers the records and judges.
        timeout: ``--stall-timeout`` seconds (0: no monitor).
        where: this rank's :class:`Whereabouts`.
    """

    def __init__(self, world, chief, timeout, where):
        self.timeout, self.where, self.chief = float(timeout), where, chief
        self.interval = report_interval(self.timeout)
        self.active = self.timeout > 0 and world.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.comm = world.Dup() if self.active else None
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        if self.active:
            target = self._judge if self.comm.Get_rank() == self.chief else self._report
            self._thread = threading.Thread(target=target, daemon=True, name="mpidist-stall-monitor")
            self._thread.start()
        return self

    def _report(self):
        """Non-chief ranks: send this rank's record at once, then every ``interval`` (one in flight at most)."""
        pending = None
        try:
            while True:
                if pending is None or pending.Test():
                    record = self.where.record()
                    pending = self.comm.Isend(record, self.chief, TAG)
                    self._in_flight = record   # the buffer lives until the send completes
                if self._stop.wait(self.interval):
                    return
        except MPI.Exception:
            return   # the run lost a rank (elastic mode recovers; otherwise MPI ends the job)

    def _judge(self):
        """The chief: collect records; past the timeout, report and end the job."""
        size = self.comm.Get_size()
        records, heard = [None] * size, [0.0] * size
        incoming, status = np.zeros(3, dtype=np.int64), MPI.Status()
        next_check = time.monotonic() + self.interval
        try:
            while not self._stop.wait(min(0.05, self.interval / 4)):
                while self.comm.Iprobe(MPI.ANY_SOURCE, TAG, status):
                    source = status.Get_source()
                    self.comm.Recv(incoming, source, TAG)
                    records[source], heard[source] = incoming.copy(), time.monotonic()
                now = time.monotonic()
                if now < next_check:
                    continue
                next_check = now + self.interval
                records[self.chief], heard[self.chief] = self.where.record(), now
                verdict = diagnose(records, heard, now, self.timeout)
                if verdict is not None:
                    sys.stderr.write(error_line(verdict + "; ending the job") + "\n")
                    sys.stderr.flush()
                    MPI.COMM_WORLD.Abort(EXIT_FAILURE)
        except MPI.Exception:
            return

    def close(self, abandon=False):
        """Collective (unless ``abandon``, after a lost rank): stop the threads and free the communicator."""
        if not self.active or self.comm is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not abandon:
            self.comm.Barrier()   # every rank has stopped sending; the chief drops what is still queued
            status = MPI.Status()
            while self.comm.Iprobe(MPI.ANY_SOURCE, TAG, status):
                self.comm.Recv(np.zeros(3, dtype=np.int64), status.Get_source(), TAG)
            self.comm.Free()
        self.comm = None
