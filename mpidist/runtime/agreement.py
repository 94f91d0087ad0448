"""The two mechanisms that keep a job from hanging.

1. :func:`install_abort_on_exception`: an exception that escapes on any rank
   prints its traceback tagged with the rank and calls ``MPI_Abort``, so the
   other ranks are killed instead of waiting forever in a collective (a plain
   Python exit on one rank leaves the rest blocked; see README "Failures").
2. :func:`agreed`: set-up work that only touches local state (parsing flags,
   reading this rank's shard, building the model) runs inside ``with
   agreed(comm, ...)``.  At its end every rank reports success or failure in
   one small ``Allgather``; if any rank failed, the first failing rank prints
   its message once and *every* rank exits with the same code.  No collective
   can block, because each rank reaches the agreement point whatever happens.
"""

import contextlib
import sys
import threading
import time
import traceback

import numpy as np

from . import comm as mpi
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
from .whereabouts import here

# Time the launcher gets to forward what a failing rank printed before MPI_Abort
# tears the job down: without it, 1 traceback in 100 was lost under load (MPICH hydra).
ABORT_GRACE_SECONDS = 0.5


def _tagged(text, rank):
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))


def abort_job(exc_type, exc, tb):
    """Report ``exc`` (tagged with this rank) and end the whole MPI job with its exit code.

    A :class:`UsageError` or :class:`RunError` prints one line, an
    :class:`Interrupted` command says which signal stopped it (exit code 3),
    anything else prints its traceback.  With more than one rank this calls ``MPI_Abort``: the
    other ranks may be waiting for this one in a collective.
    """
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if isinstance(exc, (UsageError, RunError)):
        sys.stderr.write(error_line(exc, rank) + "\n")
        code = EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE
    elif isinstance(exc, Interrupted):
        sys.stderr.write(f"mpidist: stopped by {exc.name} (rank {rank}); a file it had not finished writing was "
                         "removed, any it had finished is whole\n")
        code = EXIT_PREEMPTED
    else:
        sys.stderr.write(_tagged("".join(traceback.format_exception(exc_type, exc, tb)), rank))
        code = EXIT_FAILURE
    sys.stderr.flush()
    sys.stdout.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(ABORT_GRACE_SECONDS)
        MPI.COMM_WORLD.Abort(code)
    sys.exit(code)


def install_abort_on_exception():
    """Make any uncaught exception, in any thread, end the whole MPI job."""
    sys.excepthook = abort_job
    threading.excepthook = lambda args: abort_job(args.exc_type, args.exc_value, args.exc_traceback)


@contextlib.contextmanager
def agreed(comm):
    """Run a local-only phase; if it fails on any rank, every rank exits together.

    The body must not call collectives (it runs before the agreement).  A
    :class:`UsageError` exits with code 2, any other exception with 1.
    """
    code, message = EXIT_OK, ""
    try:
        yield
    except UsageError as err:
        code, message = EXIT_USAGE, str(err)
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
    raise SystemExit(int(codes[first]))


class ends_the_job_on_error:
    """An exception on this rank ends the whole job (``MPI_Abort``), even if the script would catch it.

    Ranks past the set-up agreement may be waiting for this one in a
    collective: letting the exception reach a ``try`` in the user's script
    would leave them waiting forever.  ``SystemExit`` (an agreed exit, on
    every rank alike) passes through; one process alone just raises.
    """

    def __init__(self, world):
        self.world = world

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, SystemExit) or self.world.Get_size() == 1:
            return False
        abort_job(exc_type, exc, tb)
