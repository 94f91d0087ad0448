"""Text files read a line at a time, never more than :data:`LINE_LIMIT` bytes of a line.

A file mpidist reads as lines (a run's ``metrics.jsonl`` for ``plot`` and
``plan --check``, a CSV file for ``ingest`` and ``predict``) is untrusted: one
line of a gigabyte, without a newline, read whole and then checked, costs two
gigabytes of memory before the check can say no.  :func:`bounded_lines` reads
each line with ``readline(limit + 1)``, so no more than the limit is ever
held, and refuses a longer line naming the file and the line's number.

The limit is far above any line mpidist writes (a ``done`` event with a role
row per rank of a large job is a few megabytes; a CSV row of a million
features, about ten) and far below what would strain a node.

The file is opened without blocking and checked to be a regular file before
anything is read: a named pipe would wait for a writer forever, a device
might never end.
"""

import os
import stat

from .errors import UsageError

LINE_LIMIT = 16 << 20  # bytes of one line, its newline included


def open_regular(path, what):
    """A binary file object of the regular file ``path``, opened without blocking; :class:`UsageError` (naming
    ``what``: ``"plot: metrics.jsonl"``) for anything else or a file that cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise UsageError(f"{what}: cannot be read ({err.strerror or err})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{what}: not a regular file (a directory, a named pipe or a device); name a file")
    return os.fdopen(fd, "rb")


def bounded_lines(path, what, limit=LINE_LIMIT, encoding="utf-8", errors="replace"):
    """``(number, text)`` of each line of the regular file ``path`` (numbered from 1, the newline left on),
    each decoded on its own; a line longer than ``limit`` bytes is refused before more of it is read.

    Args:
        path: the file.
        what: how messages name it: ``"plot: runs/x/metrics.jsonl"``, ``"data.csv"``.
        limit: the most bytes a line may have, its newline included.
        encoding, errors: how each line's bytes become text (``errors="strict"`` raises
            :class:`UnicodeDecodeError`, for the caller to word).

    Raises:
        UsageError: not a regular file, unreadable, or a line over ``limit`` (the line's number, the limit).
    """
    with open_regular(path, what) as handle:
        number = 0
        while True:
            try:
                raw = handle.readline(limit + 1)
            except OSError as err:
                raise UsageError(f"{what}: cannot be read ({err.strerror or err})") from None
            if not raw:
                return
            number += 1
            if len(raw) > limit:  # (limit + 1 bytes read, and the line goes on, or ends only there)
                raise UsageError(
                    f"{what}: line {number:,} is longer than {limit:,} bytes: not a file of lines "
                    "mpidist reads (refused before reading the rest of it)"
                )
            yield number, raw.decode(encoding, errors)
