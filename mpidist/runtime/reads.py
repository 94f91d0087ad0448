"""What a read that fails after a file's checks becomes: one line naming the file, the item and the rows.

A file's layout is checked before anything is read, but the library reading
its bytes can still fail on them: a compressed chunk its filter cannot decode,
a chunk index that points outside the file, a compressed member of an ``.npz``
that is not deflate data.  That is bad input wherever it is found, so it is a
:class:`~mpidist.runtime.errors.UsageError` (exit code 2) at set-up, where every
rank agrees on it, and mid-run, where the rank that meets it ends the job (the
abort hook, :mod:`mpidist.runtime.agreement`): the same file gives the same
code whether a rank held its shard in memory (read at set-up) or streamed it
(read as training goes), which depends on the node's memory, not on the file;
and a scheduler that retries failed jobs would only meet it again.

A read the operating system failed (an ``errno``: a disk's ``EIO``, a network
file system gone away) says nothing of the file: that is a
:class:`~mpidist.runtime.errors.RunError`, exit code 1, a failure while running.
HDF5 reports the system's failure in its message (``errno = 5``), h5py's
``OSError`` carries no ``errno`` of its own.
"""

import contextlib
import os
import re

from .errors import RunError, UsageError
from .text import printable

#: what h5py raises for an error of the HDF5 library (a failed read, a file it cannot open)
HDF5_ERRORS = (OSError, RuntimeError)
_SYSTEM_ERRNO = re.compile(r"\berrno = (\d+)")


def system_errno(error):
    """The operating system's error number behind ``error``, or None where the failure is the file's
    content."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    found = _SYSTEM_ERRNO.search(str(error))
    return int(found.group(1)) if found and int(found.group(1)) else None


def read_failure(error, what, where="", library="HDF5"):
    """The exception to raise for ``error`` met reading ``what`` (``"d.h5: train/x"``) ``where`` (``"at
    samples 0..1023"``, or "")."""
    where = f" {where}" if where else ""
    number = system_errno(error)
    if number:
        return RunError(
            f"{what} cannot be read{where}: the system's read failed ({os.strerror(number)}, errno "
            f"{number}), not the file's format: check the storage, then resume"
        )
    return UsageError(f"{what} cannot be read{where} ({library}: {printable(error)})")


@contextlib.contextmanager
def reading(what, where="", library="HDF5", errors=HDF5_ERRORS):
    """Turn ``errors`` raised in the block into :func:`read_failure`'s one-line error about ``what``."""
    try:
        yield
    except errors as error:
        raise read_failure(error, what, where, library) from None
