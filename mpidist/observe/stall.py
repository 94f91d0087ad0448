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

What the chief cannot see, each rank's :class:`LocalWatch` does, from the
start of set-up to the end of the run and without MPI: I/O that never
returns (``open()`` of a path on a hung file system retries after every
signal, so nothing else would end it), and a wait that no verdict ended
because the chief itself is frozen.  The chief's deputy (the next rank)
hears the chief's record too, and names where it was last seen:

    mpidist: error: stalled for 4.1 s (--stall-timeout 2): rank 1 waits in exchange at step 6; the chief
    (rank 0) has not reported for 3.9 s; it was last seen in compute at step 6
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from ..runtime import comm as mpi
from ..runtime.agreement import ABORT_GRACE_SECONDS, abort_quietly, exit_now
from ..runtime.errors import EXIT_FAILURE, error_line
from ..runtime.whereabouts import PHASES, WAITS

TAG = 91
CHIEF_TAG = 92  # the chief's own record, sent to its deputy


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
    waiting = [
        r
        for r, (step, phase, spent, silent) in seen.items()
        if phase in WAITS and spent > timeout and silent <= silence
    ]
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
        elif (step, phase) != where and phase != "serve":  # a serving ps waits for nobody
            late.append(f"rank {rank} ({last} for {spent:.1f} s)")
    step, phase = where
    arrived = f"not arrived: {', '.join(late)}" if late else "every rank is there: a deadlock in MPI"
    return (
        f"stalled for {seen[longest][2]:.1f} s (--stall-timeout {timeout:g}): {describe(waiters)} "
        f"wait{'s' if len(waiters) == 1 else ''} in {phase} at step {step}; {arrived}"
    )


class StallMonitor:
    """The monitor threads; collective to start (:meth:`start`) and to :meth:`close`.

    Args:
        world: the communicator of the run (duplicated here).
        chief: world rank that gathers the records and judges.
        timeout: ``--stall-timeout`` seconds (0: no monitor).
        where: this rank's :class:`Whereabouts`.

    The chief also sends its own record to its *deputy* (the next rank), so
    that when the chief freezes, the deputy's :class:`LocalWatch` can say
    where it was last seen.
    """

    def __init__(self, world, chief, timeout, where):
        self.timeout, self.where, self.chief = float(timeout), where, chief
        self.interval = report_interval(self.timeout)
        self.active = self.timeout > 0 and world.Get_size() > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.comm = world.Dup() if self.active else None
        self.deputy = (chief + 1) % world.Get_size()
        if self.active:  # when the chief freezes, its deputy (who heard it last) speaks before the others
            where.patience = 1 if world.Get_rank() in (chief, self.deputy) else 2
            if world.Get_rank() == self.deputy:
                where.chief_heard = (chief, None, time.monotonic())
        self._stop = threading.Event()
        self._thread = None
        self._in_flight = {}  # the buffers of sends not yet known complete, by tag

    def start(self):
        if self.active:
            target = self._judge if self.comm.Get_rank() == self.chief else self._report
            self._thread = threading.Thread(target=target, daemon=True, name="mpidist-stall-monitor")
            self._thread.start()
        return self

    def _send(self, pending, dest, tag):
        """Send this rank's record to ``dest`` unless the last one is still in flight; the request."""
        if pending is None or pending.Test():
            record = self.where.record()
            self._in_flight[tag] = record  # the buffer lives until the send completes
            return mpi.isend(self.comm, record, dest, tag)[0]
        return pending

    def _report(self):
        """Non-chief ranks: send this rank's record at once, then every ``interval``; the deputy hears the
        chief."""
        pending, incoming, status = None, np.zeros(3, dtype=np.int64), MPI.Status()
        try:
            while True:
                pending = self._send(pending, self.chief, TAG)
                while self.comm.Iprobe(self.chief, CHIEF_TAG, status):
                    mpi.recv(self.comm, incoming, self.chief, CHIEF_TAG)
                    self.where.chief_heard = (self.chief, incoming.copy(), time.monotonic())
                if self._stop.wait(self.interval):
                    return
        except MPI.Exception:
            return  # the run lost a rank (elastic mode recovers; otherwise MPI ends the job)

    def _judge(self):
        """The chief: collect records; past the timeout, report and end the job."""
        size = self.comm.Get_size()
        records, heard = [None] * size, [0.0] * size
        incoming, status = np.zeros(3, dtype=np.int64), MPI.Status()
        next_check, to_deputy = time.monotonic(), None  # the deputy hears the chief at once
        try:
            while not self._stop.wait(min(0.05, self.interval / 4)):
                while self.comm.Iprobe(MPI.ANY_SOURCE, TAG, status):
                    source = status.Get_source()
                    mpi.recv(self.comm, incoming, source, TAG)
                    records[source], heard[source] = incoming.copy(), time.monotonic()
                now = time.monotonic()
                if now < next_check:
                    continue
                next_check = now + self.interval
                to_deputy = self._send(to_deputy, self.deputy, CHIEF_TAG)
                records[self.chief], heard[self.chief] = self.where.record(), now
                verdict = diagnose(records, heard, now, self.timeout)
                if verdict is not None:
                    end_job(verdict + "; ending the job")
        except MPI.Exception:
            return

    def free(self, abandon=False):
        """Collective (unless ``abandon``, after a lost rank): stop the threads and free the communicator
        (once)."""
        if not self.active or self.comm is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not abandon:
            self.comm.Barrier()  # every rank has stopped sending; what is still queued is dropped
            status = MPI.Status()
            while self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                mpi.recv(self.comm, np.zeros(3, dtype=np.int64), status.Get_source(), status.Get_tag())
            self.comm.Free()
        self.comm = None
        self.where.chief_heard, self.where.patience = None, 1


def grace(timeout):
    """Seconds a rank's own watch gives the chief's verdict (which names the late ranks) to come first."""
    return 4 * report_interval(timeout) + 0.5


def overdue(where, timeout, rank, now):
    """The verdict of a rank's own watch on itself: a message, or None while it is within its time.

    I/O may take ``timeout`` seconds; a wait on other ranks ``timeout`` plus
    :func:`grace`, since the chief's monitor judges those first and names who
    is late.  A wait past that means no verdict came: the chief is frozen, or
    the monitor is not running yet (set-up).  A pure function of the record.
    """
    if not timeout or where.phase not in WAITS:
        return None
    spent = where.spent(now)
    if where.phase == "io":
        if spent <= timeout:
            return None
        return (
            f"rank {rank} has been blocked for {spent:.1f} s (--stall-timeout {timeout:g}) in I/O: "
            f"{where.detail or 'a file operation'}: the file system does not answer (a hung network "
            "mount, or a FIFO with no reader?)"
        )
    if spent <= timeout + where.patience * grace(timeout):
        return None
    heard = where.chief_heard
    if heard is not None:
        chief, record, when = heard
        chief_text = f"the chief (rank {chief}) has not reported for {now - when:.1f} s"
        if record is not None:
            step, phase, _ = (int(v) for v in record)
            chief_text += f"; it was last seen in {PHASES[phase]} at step {step}"
    else:
        chief_text = "no rank ended the job before: the chief, which judges stalls, is frozen or cannot run"
    return (
        f"stalled for {spent:.1f} s (--stall-timeout {timeout:g}): rank {rank} waits in {where.describe()}; "
        f"{chief_text}"
    )


class LocalWatch:
    """A thread on every rank, from the start of a run to its end, that watches this rank's own main thread.

    It needs no other rank: it covers set-up (before the stall monitor
    exists), I/O that never returns, and a frozen chief (whose monitor can
    judge nobody).  Past its time (see :func:`overdue`) it prints one line
    naming the rank and what it was doing, and ends the job (exit code 1).

    Args:
        where: the main thread's :class:`Whereabouts`.
        timeout: ``--stall-timeout`` (0: watch nothing); may be changed while it runs.
        rank: this rank, as named in messages.
    """

    def __init__(self, where, timeout, rank):
        self.where, self.timeout, self.rank = where, float(timeout), rank
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True, name="mpidist-local-watch")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(0.1 if not self.timeout else min(0.5, self.timeout / 10)):
            verdict = overdue(self.where, self.timeout, self.rank, time.monotonic())
            if verdict is not None and not self._stop.is_set():
                end_job(verdict + "; ending the job")


def end_job(message):
    """From a watch thread: print ``message`` as the one error line and end every rank (exit code 1)."""
    sys.stderr.write(error_line(message) + "\n")
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        # as errors.py: else the launcher may tear the job down before it forwards the line
        time.sleep(ABORT_GRACE_SECONDS)
        abort_quietly(EXIT_FAILURE)  # (MPI's own abort line would follow the one above)
    exit_now(EXIT_FAILURE)  # one process: the main thread may be stuck where no exception reaches it
