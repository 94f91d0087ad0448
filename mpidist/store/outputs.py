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

An output that is a special file -- a named pipe, a socket, a device -- is
refused (:func:`refuse_special`): the rename would replace the node itself
with a regular file (as root, an output ``/dev/null`` would replace the
machine's), and writing through it instead could wait forever for a reader
(a FIFO, as ``--metrics`` refuses one) or throw the file away (a device),
which is not what a user naming a file for a dataset or predictions means.

A symbolic link at the output is replaced itself, as :mod:`mpidist.store.atomic`
says for every output: whatever it points to (a FIFO, a directory, a file
elsewhere) is neither refused nor written, so the checks here look at the
link (``lstat``), not through it.
"""

import contextlib
import errno
import os
import stat
from pathlib import Path

from ..runtime import leftovers
from ..runtime.errors import UsageError
from ..runtime.text import printable
from . import atomic


def unwritable(path, what, err):
    """The error for output ``path`` that ``err`` kept from being written: it names ``what`` and the reason.

    Args:
        path: the output the user named.
        what: what was to be written there, as a noun: ``"the dataset"``, ``"the predictions"``.
        err: an :class:`OSError` (its ``errno`` in words; h5py's carry none: their text), or the reason in
            words.
    """
    reason = err if isinstance(err, str) else os.strerror(err.errno) if err.errno else printable(err)
    return UsageError(f"{path}: cannot write {what} there: {reason}")


SPECIAL = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def special_kind(path, follow=True):
    """What ``path`` is, in words, where it is a special file (a link followed, unless not ``follow``); None
    for anything else."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except (OSError, ValueError):  # (missing, or a name the OS refuses: whoever writes it will say)
        return None
    return next((words for test, words in SPECIAL if test(mode)), None)


def is_regular_file(path):
    """Whether ``path`` is a regular file (a link followed), found without opening it.

    Whatever lists a directory and opens what it finds by name (checkpoints, their indexes, a dataset's
    files) asks this first: a named pipe opened to read waits for a writer forever, a device may never end,
    and a directory is not a file.  Such a node under a checkpoint's name is passed over, never opened.
    """
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):  # (gone meanwhile, a link that loops, a name the OS refuses)
        return False


def special_input(path):
    """Why ``path`` cannot be read as a file (a named pipe would block the reader forever, a device never
    end), in words; None for a regular file or anything whose opening will say what is wrong."""
    kind = special_kind(path)
    return None if kind is None else f"it is {kind}, not a file: name a regular file"


def read_input(path, limit, what, kind):
    """The bytes of the file ``path`` (untrusted): a :class:`UsageError` naming ``what`` (the flag) where it
    is a special file, cannot be read, or holds more than ``limit`` bytes (then it is not ``kind``)."""
    special = special_input(path)
    if special:
        raise UsageError(f"{what} {path}: cannot be read: {special}")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as err:
        raise UsageError(f"{what} {path}: cannot be read: {err.strerror or err}") from None
    if len(raw) > limit:
        raise UsageError(f"{what} {path}: larger than {limit:,} bytes: not {kind}")
    return raw


def refuse_special(path, what):
    """Raise :func:`unwritable`'s error where output ``path`` is a special file, which a rename would replace
    (a link to one is not: the rename replaces the link, and the node it points to is left as it is)."""
    kind = special_kind(path, follow=False)
    if kind is not None:
        raise unwritable(
            path,
            what,
            f"it is {kind}, which writing the file aside and renaming it into place "
            "would replace with a regular file: name a regular file",
        )


class Claim:
    """An output path claimed by :func:`claimed`: its aside file exists, to be filled by :meth:`write`."""

    def __init__(self, path, what, aside):
        self.path, self.what, self.aside = path, what, aside

    def write(self, fill):
        """Call ``fill(aside)`` to write the content, then make it the file ``path``, whole.

        An :class:`OSError` of either (a full disk, the path made a directory
        meanwhile) is :func:`unwritable`'s error; ``path`` is then as it was.
        """
        refuse_special(self.path, self.what)  # (made one since it was claimed)
        try:
            fill(self.aside)
            atomic.commit(self.aside, self.path)
        except OSError as err:
            raise unwritable(self.path, self.what, err) from None


@contextlib.contextmanager
def claimed(path, what):
    """The :class:`Claim` of output ``path``: its aside file created now, so an unwritable output fails at
    once.

    Creating the file is the test: ``os.access`` is fooled by root, and says
    nothing of a path under a regular file.  A special file is refused
    (:func:`refuse_special`).  Missing directories are made for
    it.  On the way out the aside file is removed (a :meth:`Claim.write` has
    renamed it into place), and if the body failed so are the directories made.

    Args:
        path: the output the user named.
        what: what is written there, for the messages: ``"the dataset"``, ``"the predictions"``.

    Raises:
        UsageError: ``path`` cannot be written (see :func:`unwritable`).
    """
    path, made, ok, aside = Path(path), [], False, None
    # what a signal that ends the command removes (mpidist.runtime.leftovers)
    stopping = contextlib.ExitStack()
    try:
        try:
            if path.is_dir() and not path.is_symlink():  # (a link to a directory is replaced, as any link)
                raise unwritable(path, what, os.strerror(errno.EISDIR))
            refuse_special(path, what)
            for parent in path.parents:  # innermost first: the order to remove them in
                if parent.exists():
                    if not parent.is_dir():
                        raise unwritable(path, what, f"{parent}: {os.strerror(errno.ENOTDIR)}")
                    break
                made.append(parent)
            aside = atomic.fresh_aside(path)
            for directory in reversed(made):  # (outermost first: removed last)
                stopping.enter_context(leftovers.pending(directory))
            path.parent.mkdir(parents=True, exist_ok=True)
            stopping.enter_context(leftovers.pending(aside))
            # (ours: never through a link)
            os.close(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except OSError as err:  # permission denied, a read-only file system, ...
            raise unwritable(path, what, err) from None
        yield Claim(path, what, aside)
        ok = True
    finally:
        stopping.close()
        if aside is not None:  # None: it failed before naming one
            atomic.remove_aside(aside)
        for directory in made if not ok else ():
            with contextlib.suppress(OSError):
                directory.rmdir()
