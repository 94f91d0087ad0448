"""Where ``bench`` results go: the table printed, and the JSON file written whole or not at all."""

import contextlib
import json
import os
import secrets
import stat

from ..runtime import leftovers
from ..runtime.errors import UsageError
from ..runtime.text import os_reason
from ..store import atomic
from ..store.kept import refuse_kept
from ..store.outputs import unwritable


def format_table(rows, columns):
    header = [title for _, title, _ in columns]
    body = [
        [fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in columns] for row in rows
    ]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header] + body)


def _create_beside(target):
    """``(file descriptor, path)`` of a new hidden file in ``target``'s directory, created with the usual
    mode."""
    directory = os.path.dirname(target) or "."
    path = os.path.join(directory, f".mpidist-bench-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path


def _existing_file(target):
    """Raise ``OSError`` or ``ValueError`` unless ``target`` is absent, a symbolic link (replaced itself, see
    :mod:`mpidist.store.atomic`: what it points to is never written), or a regular file that can be appended
    to.

    Opens to append (never truncates) and closes: the file is left as it was.
    """
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        return
    if stat.S_ISDIR(info.st_mode):
        raise ValueError("it is a directory; name a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("it is not a regular file (a pipe, a socket or a device)")
    try:
        with open(target, "a"):
            pass
    except PermissionError:
        raise ValueError("the file is not writable (permission denied)") from None


def _directory_takes_files(target):
    """Raise ``OSError`` unless a file can be created (and removed) beside ``target``, as the final rename
    needs."""
    fd, probe = _create_beside(target)
    os.close(fd)
    os.unlink(probe)


def check_output(output, option="--output", inputs=()):
    """Raise :class:`UsageError` naming ``output`` and the reason if the results could not be written there,
    or may not: it is one of ``inputs`` (files the command reads), a run's file or a checkpoint
    (:func:`~mpidist.store.kept.refuse_kept`).

    Called before any benchmark runs, so a bad ``--output`` does not cost the
    run.  Changes nothing: an existing file is opened to append and closed,
    and a probe file is created beside it and removed (the results are
    written aside and renamed over it: its directory must take new files).
    """
    refuse_kept(output, option, inputs)
    target = os.fspath(output)  # a link there is replaced itself, never written through
    try:
        _existing_file(target)
        _directory_takes_files(target)
    except ValueError as err:
        raise UsageError(f"{option} {output}: cannot be written: {err}") from None
    except OSError as err:
        reason = os_reason(err, "its directory does not exist", "permission denied")
        raise UsageError(f"{option} {output}: cannot be written: {reason}") from None


def write_results(output, document, what="the results"):
    """Write ``document`` as JSON to ``output`` atomically: aside, then renamed over it.

    An existing results file is replaced whole or left as it was, never half
    written; the new file takes the mode of the one it replaces.  A symbolic
    link at ``output`` is replaced by the file, and what it pointed to is left
    as it was (one rule for every output: :mod:`mpidist.store.atomic`).  A
    write that fails (a full disk, a quota) is one :class:`UsageError` naming
    ``output`` and ``what`` was to be written there
    (:func:`mpidist.store.outputs.unwritable`), as for the other outputs a user names.
    """
    target = os.fspath(output)
    aside = None
    try:
        fd, aside = _create_beside(target)
        with leftovers.pending(aside):  # (a signal that ends the command removes it too)
            with os.fdopen(fd, "w") as handle:
                json.dump(document, handle, indent=2)
            with contextlib.suppress(FileNotFoundError):
                info = os.lstat(target)
                if stat.S_ISREG(info.st_mode):
                    os.chmod(aside, stat.S_IMODE(info.st_mode))
            atomic.commit(aside, target)
    except OSError as err:
        raise unwritable(output, what, err) from None
    finally:
        if aside is not None:
            atomic.remove_aside(aside)
