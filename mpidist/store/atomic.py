"""Files written whole or not at all: aside, on disk, then renamed into place.

Everything mpidist writes that a user keeps (checkpoints, datasets,
predictions, settings, traces, benchmark results) goes through here, so a
crash, a full disk or a signal mid-write leaves either the old file or the
new one, never a part:

1. the content is written to a file aside in the same directory (so the
   rename cannot cross file systems), ``.<name>.tmp-<pid>`` (:func:`aside_path`:
   the pid keeps two writers apart, and tells :mod:`mpidist.store.lineage` whose
   leftovers it sees) unless the writer made its own;
2. the aside file is synced, so its data is on disk before its name is;
3. it is renamed over the final name (atomic on POSIX), and the directory is
   synced, so the rename itself survives a crash.

A failure anywhere removes the aside file and leaves the final name as it
was; the :class:`OSError` goes on to the caller, which words it for its user
(for an output the user named, :mod:`mpidist.store.outputs` does).

A symbolic link at the final name is replaced by the rename, itself: the
file it points to is never written (it may be anywhere, outside the chosen
directory, and someone else's).  This is the one rule for every output
mpidist writes; a file that is appended to rather than replaced (the
metrics, a run's log, a checkpoint directory's lock) is opened with
``O_NOFOLLOW`` (:data:`NO_FOLLOW`), and a link there is refused.  The aside
name is made afresh (:func:`fresh_aside`): whatever sits under it -- a stale
file, a link planted there -- is removed first, never written through.
"""

import contextlib
import os
from pathlib import Path

from ..runtime import leftovers


def aside_path(final):
    """Where ``final`` is written before it is renamed into place: ``.<name>.tmp-<pid>`` beside it."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


#: open flags that refuse a symbolic link at the last part of the path (ELOOP) instead of following it
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


def fresh_aside(final):
    """:func:`aside_path` of ``final``, with whatever was under that name removed: the writer creates it
    anew."""
    aside = aside_path(final)
    remove_aside(aside)
    return aside


def sync_file(path):
    """Flush ``path``'s data to disk."""
    with open(path, "rb+") as raw:
        os.fsync(raw.fileno())


def sync_directory(path):
    """Flush directory ``path``'s entries (a rename into it) to disk, where the file system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # (a platform or file system without directory handles: nothing more can be done)
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on a directory (EINVAL)
            os.fsync(fd)
    finally:
        os.close(fd)


def commit(aside, final):
    """Make the whole file ``aside`` the file ``final``: synced, renamed over it, the rename synced."""
    sync_file(aside)
    os.replace(aside, final)
    sync_directory(Path(final).parent)


def remove_aside(aside):
    """Remove ``aside`` if it is still there (a write that failed before its rename)."""
    with contextlib.suppress(OSError):
        Path(aside).unlink(missing_ok=True)


@contextlib.contextmanager
def replacing(final):
    """The path to write in place of ``final`` (:func:`aside_path`), committed when the body returns.

    ``with replacing(path) as aside: write(aside)``: once the body returns,
    ``aside`` becomes ``path`` (:func:`commit`); if the body or the commit
    raises, ``aside`` is removed and ``path`` is untouched.
    """
    aside = fresh_aside(final)
    try:
        with leftovers.pending(aside):  # (a signal that ends a command removes it too)
            yield aside
            commit(aside, final)
    finally:
        remove_aside(aside)
