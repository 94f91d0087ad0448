"""An output file a user named: claimed before the work that fills it, then written whole.

``ingest`` and ``predict`` may work for minutes before they have anything to
write, so the path is claimed first: :func:`claimed` creates the file aside
(:func:`mpidist.store.atomic.aside_path`) at once, and an output that cannot
be written -- a directory, a path under a regular file, a read-only
directory -- is refused before any of the work.  :meth:`Claim.write` then
fills the aside file and commits it (:func:`mpidist.store.atomic.commit`), so
the path holds the old file or the whole new one, never a part.

Every failure is one :class:`~mpidist.runtime.errors.UsageError` worded by
:func:`unwritable`: ``"<path>: cannot write <what> there: <reason>"``, where
the caller names what it writes (``"the dataset"``, ``"the predictions"``).
"""

import contextlib
import errno
import os
from pathlib import Path

from ..runtime.errors import UsageError
from ..runtime.text import printable
from . import atomic


def unwritable(path, what, err):
    """The error for output ``path`` that ``err`` kept from being written: it names ``what`` and the reason.

    Args:
        path: the output the user named.
        what: what was to be written there, as a noun: ``"the dataset"``, ``"the predictions"``.
        err: an :class:`OSError` (its ``errno`` in words; h5py's carry none: their text), or the reason in words.
    """
    reason = err if isinstance(err, str) else os.strerror(err.errno) if err.errno else printable(err)
    return UsageError(f"{path}: cannot write {what} there: {reason}")


class Claim:
    """An output path claimed by :func:`claimed`: its aside file exists, to be filled by :meth:`write`."""

    def __init__(self, path, what, aside):
        self.path, self.what, self.aside = path, what, aside

    def write(self, fill):
        """Call ``fill(aside)`` to write the content, then make it the file ``path``, whole.

        An :class:`OSError` of either (a full disk, the path made a directory
        meanwhile) is :func:`unwritable`'s error; ``path`` is then as it was.
        """
        try:
            fill(self.aside)
            atomic.commit(self.aside, self.path)
        except OSError as err:
            raise unwritable(self.path, self.what, err) from None


@contextlib.contextmanager
def claimed(path, what):
    """The :class:`Claim` of output ``path``: its aside file created now, so an unwritable output fails at once.

    Creating the file is the test: ``os.access`` is fooled by root, and says
    nothing of a path under a regular file.  Missing directories are made for
    it.  On the way out the aside file is removed (a :meth:`Claim.write` has
    renamed it into place), and if the body failed so are the directories made.

    Args:
        path: the output the user named.
        what: what is written there, for the messages: ``"the dataset"``, ``"the predictions"``.

    Raises:
        UsageError: ``path`` cannot be written (see :func:`unwritable`).
    """
    path, made, ok, aside = Path(path), [], False, None
    try:
        try:
            if path.is_dir():
                raise unwritable(path, what, os.strerror(errno.EISDIR))
            for parent in path.parents:         # innermost first: the order to remove them in
                if parent.exists():
                    if not parent.is_dir():
                        raise unwritable(path, what, f"{parent}: {os.strerror(errno.ENOTDIR)}")
                    break
                made.append(parent)
            aside = atomic.aside_path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            open(aside, "wb").close()
        except OSError as err:                  # permission denied, a read-only file system, ...
            raise unwritable(path, what, err) from None
        yield Claim(path, what, aside)
        ok = True
    finally:
        if aside is not None:                   # None: it failed before naming one
            atomic.remove_aside(aside)
        for directory in made if not ok else ():
            with contextlib.suppress(OSError):
                directory.rmdir()
