"""Exit codes, the two exceptions that carry them, and the one line a user sees for an error.

The bottom of the package: nothing here imports anything of mpidist, so every
layer can raise these.  How an error on one rank ends every rank (``agreed``,
the abort hook) is :mod:`mpidist.runtime.agreement`.
"""

EXIT_OK = 0
EXIT_FAILURE = 1  # a failure while running (a bug, a lost rank, an I/O error)
EXIT_USAGE = 2  # bad usage, configuration or input
# stopped by SIGTERM/SIGUSR1/SIGINT: train after writing a checkpoint (resume to go on), the
EXIT_PREEMPTED = 3
#                    other commands (SIGHUP too) after removing the files they were writing (run them again)


class UsageError(Exception):
    """Bad usage, configuration or input: one clear message, exit code 2."""


class Interrupted(BaseException):
    """A command other than ``train`` stopped by a signal (SIGTERM, SIGUSR1, SIGINT, SIGHUP): exit code 3.

    What the command line's handler ends the process for
    (:func:`mpidist.runtime.agreement.end_interrupted`), after removing the
    files being written (:mod:`mpidist.runtime.leftovers`); it is not raised
    there, as an exception a signal handler raises can be swallowed where it
    lands.  Raised all the same (a ``BaseException``, so that no ``except
    Exception`` takes it for an error of the work), it ends the job with its
    line and exit code 3 too.
    """

    def __init__(self, number, name):
        super().__init__(name)
        self.number, self.name = number, name


class RunError(Exception):
    """A failure while running that needs no traceback (a full disk, a diverged run): exit code 1.

    Raised on one rank, it ends the whole job like any uncaught exception,
    but prints only ``mpidist: error (rank N): <message>``.
    """


def error_line(message, rank=None):
    """The one line a user sees for an error, tagged with the rank if only some failed."""
    where = "" if rank is None else f" (rank {rank})"
    return f"mpidist: error{where}: {message}"
