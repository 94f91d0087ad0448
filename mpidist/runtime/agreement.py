"""The two mechanisms that keep a job from hanging.

1. :func:`install_abort_on_exception`: an exception that escapes on any rank
   prints its traceback tagged with the rank and calls ``MPI_Abort``, so the
   other ranks are killed instead of waiting forever in a collective (a plain
   Python exit on one rank leaves the rest blocked; see README "Failures").
   A refusal or failure mpidist understands (:class:`UsageError`,
   :class:`RunError`) raised after the set-up's agreement -- by a strategy's
   construction, a stream's check of a block it reads, the first forward
   pass -- may come on several ranks at once: inside
   :class:`ends_the_job_on_error` the first of them to claim :class:`OneVoice`
   prints its one line, the others print nothing, and MPI's own abort line
   (which repeats nothing useful) is not shown.
2. :func:`agreed`: set-up work that only touches local state (parsing flags,
   reading this rank's shard, building the model) runs inside ``with
   agreed(comm, ...)``.  At its end every rank reports success or failure in
   one small ``Allgather``; if any rank failed, the first failing rank prints
   its message once and *every* rank exits with the same code.  No collective
   can block, because each rank reaches the agreement point whatever happens.
"""

import contextlib
import os
import sys
import threading
import time
import traceback

import numpy as np

from . import comm as mpi
from . import ulfm
from .errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    Interrupted,
    RunError,
    UsageError,
    error_line,
)
from .price import out_of_memory
from .rma import Window
from .segments import forget_segments
from .whereabouts import here

# Time the launcher gets to forward what a failing rank printed before MPI_Abort
# tears the job down: without it, 1 traceback in 100 was lost under load (MPICH hydra).
ABORT_GRACE_SECONDS = 0.5
# How long a rank that found a failure waits to learn whether another rank speaks for it, and how long a
# rank that lost the claim waits for the speaker's MPI_Abort before calling its own
CLAIM_SECONDS = 2.0
QUIET_SECONDS = 2.0


class OneVoice:
    """Which rank speaks for a failure found on several ranks at once: the first to claim it.

    One counter in a window on rank 0 of ``comm`` (collective to make and to
    :meth:`free`).  :meth:`claim` adds one to it, atomically: the rank that
    found it 0 speaks.  Between ranks on one node the add needs nothing of
    rank 0; across nodes rank 0 answers as soon as it is in MPI, which a rank
    that waits for a failed one is.  No answer within ``CLAIM_SECONDS`` (rank
    0 busy, or gone) counts as the claim won: a second line is better than
    none.
    """

    def __init__(self, comm):
        self.window = Window(comm, 1 if comm.Get_rank() == 0 else 0, np.int64)

    def claim(self, seconds=CLAIM_SECONDS):
        """Whether this rank speaks (the first to claim, or no answer in ``seconds``)."""
        earlier = np.full(1, -1, dtype=np.int64)

        def add():
            try:
                self.window.fetch_add(np.ones(1, dtype=np.int64), earlier, 0)
                self.window.flush(0)
            except Exception:  # (a broken window: this rank speaks)
                earlier[0] = -1

        from mpi4py import MPI

        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:  # (the claim could block with no way to give up)
            return True
        asking = threading.Thread(target=add, daemon=True, name="mpidist-claim")
        asking.start()
        asking.join(seconds)
        return asking.is_alive() or int(earlier[0]) <= 0

    def free(self):
        """Collective: release the window (once)."""
        self.window.free()


_VOICE = None  # the OneVoice of the job's ends_the_job_on_error, while one is entered


def abort_quietly(code):
    """``MPI_Abort(code)`` on the world, without MPI's own line (``Abort(2) on node ...``).

    For where mpidist has printed the one line that says why: stderr goes to
    /dev/null first, so the job's output ends with that line.
    """
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    except OSError:
        pass
    abort_now(code)


def abort_now(code):
    """``MPI_Abort(code)`` on the world, MPICH's shared-memory files of this process unlinked first (an
    abort skips the ``MPI_Finalize`` that removes them: :mod:`~mpidist.runtime.segments`)."""
    from mpi4py import MPI

    forget_segments()
    MPI.COMM_WORLD.Abort(code)


def exit_now(code):
    """``os._exit(code)``: this process ends at once, MPICH's shared-memory files of it unlinked first."""
    forget_segments()
    os._exit(code)


def _tagged(text, rank):
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def abort_job(exc_type, exc, tb):
    """Report ``exc`` (tagged with this rank) and end the whole MPI job with its exit code.

    A :class:`UsageError` or :class:`RunError` prints one line (inside
    :class:`ends_the_job_on_error`, only on the rank that claims
    :class:`OneVoice` first; MPI's abort line is not shown), an
    :class:`Interrupted` command says which signal stopped it (exit code 3),
    anything else its traceback.  With more than one rank this calls ``MPI_Abort``: the
    other ranks may be waiting for this one in a collective.
    """
    from mpi4py import MPI

    if isinstance(exc, MemoryError) or _mpi_out_of_memory(exc):  # (the price bounds a run: one line)
        exc = out_of_memory(exc, f"while in {here().phase} at step {here().step}")
    rank = MPI.COMM_WORLD.Get_rank()
    many = MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1
    understood = isinstance(exc, (UsageError, RunError))
    speaks = not (understood and many and _VOICE is not None) or _VOICE.claim()
    if understood and speaks:
        sys.stderr.write(error_line(exc, rank) + "\n")
    elif isinstance(exc, Interrupted):
        sys.stderr.write(interrupted_line(exc, rank) + "\n")
    elif not understood:
        sys.stderr.write(_tagged("".join(traceback.format_exception(exc_type, exc, tb)), rank))
    code = (
        EXIT_USAGE
        if isinstance(exc, UsageError)
        else EXIT_PREEMPTED
        if isinstance(exc, Interrupted)
        else EXIT_FAILURE
    )
    sys.stderr.flush()
    sys.stdout.flush()
    if many:
        # (the speaker's abort ends this one first)
        time.sleep(ABORT_GRACE_SECONDS if speaks else QUIET_SECONDS)
        if understood:
            abort_quietly(code)
        abort_now(code)
    sys.exit(code)


def _mpi_out_of_memory(exc):
    """Whether ``exc`` is MPI's error for an allocation of its own that failed."""
    from mpi4py import MPI

    if not isinstance(exc, MPI.Exception):
        return False
    return exc.Get_error_class() == MPI.ERR_NO_MEM or "Out of memory" in str(exc)


def interrupted_line(stop, rank):
    """The one line a command other than ``train`` stopped by a signal (an :class:`Interrupted`) prints."""
    return (
        f"mpidist: stopped by {stop.name} (rank {rank}); a file it had not finished writing was removed, any "
        "it "
        "had finished is whole"
    )


def end_interrupted(stop):
    """End this process at once for :class:`Interrupted` ``stop``: its line, then exit code 3 for every rank.

    Called by a signal handler, where the main thread stands: nothing may run
    after it (no ``finally``, no h5py closing a file half-written, no exit
    handler), so one process ends with ``os._exit``; with more than one rank
    ``MPI_Abort`` ends them all (the others may wait for this one).
    """
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
    many = MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1
    with contextlib.suppress(Exception):  # (a closed stream must not keep the process from ending)
        sys.stderr.write(interrupted_line(stop, rank) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    if many:
        # (the launcher forwards the line before the abort tears the job down)
        time.sleep(ABORT_GRACE_SECONDS)
        abort_quietly(EXIT_PREEMPTED)
    exit_now(EXIT_PREEMPTED)


def install_abort_on_exception():
    """Make any uncaught exception, in any thread, end the whole MPI job."""
    sys.excepthook = abort_job
    threading.excepthook = lambda args: abort_job(args.exc_type, args.exc_value, args.exc_traceback)


@contextlib.contextmanager
def agreed(comm):
    """Run a local-only phase; if it fails on any rank, every rank exits together.

    The body must not call collectives (it runs before the agreement).  A
    :class:`UsageError` exits with code 2, a :class:`RunError` with 1 (both one line), any other
    exception with 1 and its traceback.
    """
    code, message = EXIT_OK, ""
    try:
        yield
    except UsageError as err:
        code, message = EXIT_USAGE, str(err)
    except RunError as err:  # understood (the system failed a read): its line, no traceback
        code, message = EXIT_FAILURE, str(err)
    except MemoryError as err:
        code, message = EXIT_FAILURE, str(out_of_memory(err, "at start-up", priced=False))
    except Exception:  # a bug or I/O failure: keep the traceback, still exit together
        code, message = EXIT_FAILURE, "unexpected failure:\n" + traceback.format_exc()
    size = 1 if comm is None else comm.Get_size()
    codes = np.full(size, code, dtype=np.int32)
    if comm is not None:
        with here().doing("agree", "set-up: every rank's checks"):
            mpi.allgather(comm, np.array([code], dtype=np.int32), codes)
    failed = np.flatnonzero(codes)
    if failed.size == 0:
        return
    first = int(failed[0])
    if comm is None or comm.Get_rank() == first:
        only_some = failed.size < size
        sys.stderr.write(error_line(message, first if only_some else None) + "\n")
        sys.stderr.flush()
    raise AgreedExit(int(codes[first]))


class AgreedExit(SystemExit):
    """An exit every rank takes alike (a refusal :func:`agreed` on): :class:`ends_the_job_on_error` lets it
    pass, where a ``sys.exit()`` of one rank's own (a user's callback or layer) ends the job."""


class ends_the_job_on_error:
    """An exception on this rank ends the whole job (``MPI_Abort``), even if the script would catch it.

    Ranks past the set-up agreement may be waiting for this one in a
    collective: letting the exception reach a ``try`` in the user's script
    would leave them waiting forever.  A refusal found here on several ranks
    (the same flag refused by every rank's strategy, bad rows in two
    workers' streams) prints one line: the rank that claims :class:`OneVoice`
    first speaks.  An :class:`AgreedExit` (on every rank alike) passes
    through; any other ``SystemExit`` (``sys.exit()`` in a user's callback or
    layer, on this rank alone) ends the job with its code, as the others may
    be waiting for this one.  One process alone just raises.  Collective to
    enter and (without an error) to leave.
    """

    def __init__(self, world):
        self.world = world
        self.voice = self.outer = None

    def __enter__(self):
        global _VOICE
        if self.world.Get_size() > 1:
            self.voice, self.outer = OneVoice(self.world), _VOICE
            _VOICE = self.voice
        return self

    def __exit__(self, exc_type, exc, tb):
        global _VOICE
        if exc is None or isinstance(exc, AgreedExit) or self.world.Get_size() == 1:
            if self.voice is not None:
                _VOICE = self.outer
                if not ulfm.failure_seen():  # (after a lost rank the window's communicator is broken)
                    self.voice.free()
            return False
        if isinstance(exc, SystemExit):  # (this rank's own: the others run on, or wait for it)
            code = exc.code if isinstance(exc.code, int) else EXIT_FAILURE
            rank = self.world.Get_rank()
            sys.stderr.write(
                error_line(f"sys.exit({exc.code!r}) while the other ranks ran on: the job ends with it", rank)
                + "\n"
            )
            sys.stderr.flush()
            abort_now(code)
        abort_job(exc_type, exc, tb)
