"""Removing only what mpidist wrote: never through a link, only names its own writes make.

Every removal of a file or folder a run may find on disk (a pruned
checkpoint, a parts folder an interrupted write left, a temporary file aside,
an empty run directory) goes through here, by one rule:

* a symbolic link is never followed: a link named like a checkpoint, a parts
  folder or a temporary may lead to a user's archive, and mpidist never wrote
  what it leads to;
* only regular files whose names mpidist's own writes make are removed, and
  only from real folders (``lstat``): a folder holding anything else keeps it,
  and is left in place;
* what was left is said, so the caller can tell its user (:class:`Removal`).

The kinds are read with ``lstat`` once and acted on at once; a name that
changes kind in between (a race with another process) fails the removal
(``rmdir`` of a link, ``unlink`` of a directory), which is caught, and the
entry stays.
"""

import dataclasses
import os
import stat
from pathlib import Path

from ..runtime.text import printable

#: what :func:`kind` answers
FILE, FOLDER, LINK, OTHER, MISSING = "file", "folder", "symbolic link", "special file", "missing"


def kind(path, dir_fd=None):
    """What ``path`` itself is (a link not followed; a name in the directory ``dir_fd`` where given): one of
    :data:`FILE`, :data:`FOLDER`, :data:`LINK`, :data:`OTHER` (a pipe, socket or device), :data:`MISSING`."""
    try:
        mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except (OSError, ValueError):
        return MISSING
    if stat.S_ISLNK(mode):
        return LINK
    return FILE if stat.S_ISREG(mode) else FOLDER if stat.S_ISDIR(mode) else OTHER


@dataclasses.dataclass
class Removal:
    """What one removal did: the names it removed, and what it left with the reason (``(name, why)``)."""

    removed: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)

    def note(self, where):
        """One line naming what was left in ``where`` and why; "" when nothing was."""
        if not self.left:
            return ""
        items = "; ".join(f"{printable(name)} ({why})" for name, why in self.left)
        return f"left in {where}, as mpidist removes only what it wrote: {items}"


def remove_file(path, removal=None, dir_fd=None):
    """Remove ``path`` if it is a regular file (not a link, a folder or a special file); the
    :class:`Removal`.  ``dir_fd``: ``path`` is a name in that open directory."""
    removal = removal if removal is not None else Removal()
    name = Path(path).name
    if not _is(path, FILE, "a file mpidist wrote", removal, dir_fd):
        return removal
    try:
        os.unlink(path, dir_fd=dir_fd)
        removal.removed.append(name)
    except FileNotFoundError:
        pass
    except OSError as err:
        removal.left.append((name, err.strerror or str(err)))
    return removal


def remove_folder(folder, own):
    """Remove the regular files in ``folder`` whose names ``own`` (a compiled pattern) matches whole, then
    the folder if that emptied it; the :class:`Removal` (``removed`` names the folder once it is gone).

    A ``folder`` that is a link, or not a folder, is left whole; so is anything in it that is not a regular
    file of such a name (a link among the parts, a file of the user's), and then the folder too.  The folder
    is opened once, never through a link, and its files are removed by their names in it: a folder swapped
    for a link meanwhile leads nowhere else.
    """
    folder, removal = Path(folder), Removal()
    if not _is(folder, FOLDER, "a folder mpidist made", removal):
        return removal
    inside = Removal()
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:  # (a link put there since: ELOOP)
        removal.left.append((folder.name, err.strerror or str(err)))
        return removal
    try:
        for name in sorted(os.listdir(fd)):
            if own.fullmatch(name):
                remove_file(name, inside, dir_fd=fd)
            else:
                inside.left.append((name, "not a name mpidist writes"))
    finally:
        os.close(fd)
    if inside.left:
        removal.left.append((folder.name, f"holds what mpidist did not write: {_names(inside.left)}"))
        return removal
    try:
        os.rmdir(folder)  # (a link there now is not a directory: refused)
        removal.removed.append(folder.name)
    except FileNotFoundError:
        pass
    except OSError as err:  # (something appeared meanwhile: it stays, and so does the folder)
        removal.left.append((folder.name, err.strerror or str(err)))
    return removal


def _is(path, expected, what, removal, dir_fd=None):
    """Whether ``path`` is of kind ``expected``; where it is something else, it is left, and ``removal`` says
    so (``what`` it would have been)."""
    found = kind(path, dir_fd)
    if found not in (expected, MISSING):
        removal.left.append((Path(path).name, f"a {found}, not {what}"))
    return found == expected


def _names(left, shown=3):
    names = [printable(name, 60) for name, _ in left]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def make_directories(path):
    """``os.makedirs(path, exist_ok=True)``; returns the directories it made, innermost first (what
    :func:`remove_made` may take back where the run that made them is refused)."""
    missing, probe = [], Path(os.path.abspath(path))
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # (a full disk, a quota part way: the directories made so far are taken back)
        remove_made([folder for folder in missing if os.path.lexists(folder)])
        raise
    return missing


def remove_made(made, own=None):
    """Remove the directories ``made`` (:func:`make_directories`' answer), innermost first, where they hold
    nothing but regular files whose names ``own`` matches (the innermost only; None: nothing); the first
    that holds anything else stops it (it and those around it are left)."""
    for depth, folder in enumerate(made):
        if depth == 0 and own is not None:
            done = remove_folder(folder, own)
            if done.left:
                return
            continue
        try:
            os.rmdir(folder)  # (only an empty folder: never through a link, which rmdir refuses)
        except FileNotFoundError:
            continue
        except OSError:
            return
