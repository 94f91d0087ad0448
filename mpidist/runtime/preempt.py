"""Stopping cleanly when the job is told to: SIGTERM, SIGUSR1 or SIGINT on any rank.

A scheduler preempts or times out a job by signalling its processes (Slurm:
SIGTERM, then SIGKILL after ``KillWait``; ``--signal=USR1@T`` warns T seconds
ahead).  The handler only records the signal; the training loop acts on it at
a step boundary, where the model is consistent on every rank.

The ranks must act at the *same* step, or their collectives would no longer
match.  :class:`StepAgreement` gets them there without a blocking collective
on the hot path: at every step boundary each rank posts its flags (signal
seen, checkpoint due) in a non-blocking ``Iallreduce(MAX)`` on a private
communicator and collects the one it posted a step earlier, which has long
completed.  Every rank therefore learns the same flags at the same boundary,
one step after the first rank saw them.

Strategies whose ranks do not step together (``ps-async``, backup workers)
carry the stop request in their own traffic instead (see their modules);
every strategy ends with :func:`agree_on_stop`, where all ranks agree on whether a
signal cut the run short.
"""

import contextlib
import signal

import numpy as np
from mpi4py import MPI

from . import comm as mpi
from . import leftovers
from .agreement import end_interrupted
from .errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: What ends a command other than ``train``: a closed terminal too (``train`` runs under schedulers and
#: ``nohup``; a command run at a terminal that goes away should not leave its file aside behind).
INTERRUPTS = SIGNALS + (signal.SIGHUP,)

#: A stop a callback asked for, carried where signal numbers are (flags combine with MAX): it is below
#: every signal mpidist catches, so a real signal seen at the same boundary wins (checkpoint, exit 3).
EARLY_STOP = 1
#: A failed write of the chief's (the metrics file on a full disk), carried the same way: above every
#: signal, so the run ends as failed (after a checkpoint, exit 1) whatever else was asked at that boundary.
WRITE_FAILED = 1 << 20


def signal_name(number):
    """``SIGTERM`` for 15; ``signal 99`` for numbers Python does not know."""
    if number == EARLY_STOP:
        return "a callback's stop request"
    if number == WRITE_FAILED:
        return "a failed write"
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class StopSignals:
    """Records the first of :data:`SIGNALS` this process receives (``received``: its number or 0).

    A SIGINT while a stop is already pending raises KeyboardInterrupt, so
    Ctrl-C twice still ends a run that cannot reach a step boundary (the
    exception aborts the whole job, see mpidist.runtime.errors).

    Installs nest: the command line installs the handlers before it parses
    its flags, the run installs them again, and a signal that came during
    start-up is still ``received`` when the loop looks (it stops the run at
    its first step boundary, with exit code 3).  Only the outermost
    :meth:`restore` puts the previous handlers back.
    """

    def __init__(self):
        self.received = 0
        self._previous = {}
        self._depth = 0

    def _handle(self, number, frame):
        if number == signal.SIGINT and self.received:
            raise KeyboardInterrupt
        self.received = self.received or number

    def install(self):
        self._depth += 1
        if self._depth == 1 and not _INTERRUPTING:  # (a command's handlers stay: see interrupt_on_signals)
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
            self.received = 0
        return self

    def restore(self):
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.restore()


_PROCESS = StopSignals()
# set once interrupt_on_signals has installed its handlers: a command, not a training run
_INTERRUPTING = False


def stop_signals():
    """This process's :class:`StopSignals` (the main thread's handlers are per process)."""
    return _PROCESS


@contextlib.contextmanager
def interrupt_on_signals():
    """For the commands other than ``train``, run inside: the first of :data:`INTERRUPTS` ends the process
    where it lands.

    A command that writes a file (``ingest``, ``predict``, ``plot``, ``bench``,
    ``plan``) writes it aside and renames it into place, and names what it
    is writing to :mod:`mpidist.runtime.leftovers`.  The handler removes
    those, prints one line and ends the process at once with exit code 3
    (every rank: ``MPI_Abort`` where there are several).  It raises nothing:
    an exception raised by a signal handler lands wherever the main thread
    is, and a ``__del__`` or a weak reference's callback swallows it (the
    command went on and wrote its output), while inside h5py it leaves a file
    half-closed.  A training run inside the command (``plan --calibrate``,
    ``bench``) keeps these handlers (:meth:`StopSignals.install` leaves them):
    it is the command's measurement, not a run to checkpoint, and the signal
    ends the command.  A signal recorded before (while the flags were parsed)
    ends it at once.  ``SIGHUP`` is left ignored where it was (``nohup``).
    """
    global _INTERRUPTING
    pending = stop_signals().received
    stop_signals().restore()
    _INTERRUPTING = True
    previous = {
        number: signal.signal(number, _end_here)
        for number in INTERRUPTS
        if number != signal.SIGHUP or signal.getsignal(number) is not signal.SIG_IGN
    }
    if pending:
        _end_here(pending, None)
    try:
        yield
    finally:  # (the command returned: a process that goes on, a test's, gets its handlers back)
        for number, handler in previous.items():
            signal.signal(number, handler)
        _INTERRUPTING = False


def _end_here(number, frame):
    """The handler :func:`interrupt_on_signals` installs: remove what is being written, say so, end (code
    3)."""
    for each in INTERRUPTS:  # (a second signal while this one cleans up changes nothing)
        signal.signal(each, signal.SIG_IGN)
    leftovers.remove_all()
    # (not signal_name: SIGHUP is 1, EARLY_STOP)
    end_interrupted(Interrupted(number, signal.Signals(number).name))


class StepAgreement:
    """Flags every rank sees at the same step boundary, one step after they were raised.

    Flags (int64, combined with MAX): ``signal`` (the signal's number),
    ``rank`` (1 + the rank that saw it), ``due`` (a timed checkpoint is
    due, as the chief's clock says), ``busy`` (a rank's writer behind
    training is not free for the next checkpoint) and ``writing`` (a rank is
    still syncing its part of a sharded checkpoint).
    """

    FIELDS = ("signal", "rank", "due", "busy", "writing")

    def __init__(self, comm):
        self.comm = comm.Dup()  # its own context: never matched against the strategy's collectives
        # this rank's, then (in place) every rank's max
        self._flags = np.zeros(len(self.FIELDS), dtype=np.int64)
        self._pending = None

    def boundary(self, signal_number=0, due=False, busy=False, writing=False):
        """Post this rank's flags; returns the flags all ranks posted at the previous boundary (a dict)."""
        agreed = self._collect()
        self._flags[...] = (
            signal_number,
            self.comm.Get_rank() + 1 if signal_number else 0,
            int(due),
            int(busy),
            int(writing),
        )
        self._pending = mpi.iallreduce(self.comm, self._flags, MPI.MAX)
        return agreed

    def _collect(self):
        if self._pending is None:
            return dict.fromkeys(self.FIELDS, 0)
        self._pending.wait()
        self._pending = None
        return dict(zip(self.FIELDS, (int(v) for v in self._flags)))

    def free(self):
        """Complete the last exchange and free the communicator (once: a second call does nothing)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()


def agree_on_stop(comm, signal_number, early):
    """Blocking, after the last step: ``{"signal", "rank", "early"}`` over all ranks.

    ``early``: this rank left the training loop before its last step because
    of a stop request.  A signal that came only after the work was done
    leaves ``early`` at 0: the run finished, and says so.
    """
    flags = np.array([signal_number, comm.Get_rank() + 1 if signal_number else 0, int(early)], dtype=np.int64)
    mpi.allreduce_max(comm, flags)
    return dict(zip(("signal", "rank", "early"), (int(v) for v in flags)))
