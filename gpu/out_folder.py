"""The folder the GPU check writes in (``gpu/check.sh OUT``, ``gpu/check.py --out``), claimed before anything
is written there.

The check fills OUT with its logs, its summaries and a folder per run, and
replaces what a check wrote there before: each run folder is removed and made
again.  So OUT must be a folder the check may fill: one it makes, an empty
one, or one a check made before (it holds :data:`MARK`).  Anything else is
refused before the check installs or writes anything, with one line naming
OUT and why:

* a symbolic link (the check would write, and remove run folders, wherever it
  points): the folder itself is named instead;
* something that is not a folder (a file, a named pipe, a device);
* a folder holding files the check did not write (its summary and logs would
  overwrite files of the same names);
* a place where the folder cannot be made or written in (a path under a file,
  a read-only file system, no permission): creating a file there is the test.

Run as a script (``python out_folder.py OUT``, as ``gpu/check.sh`` does) it
prints OUT's absolute path, or the refusal on stderr with exit code 2.
"""

import os
import stat
import sys
from pathlib import Path

#: The file that marks a folder as the check's own: a check may write there again.
MARK = ".mpidist-gpu-check"
NOTE = "gpu/check.sh writes its output here and replaces it on its next run\n"
#: The exit code of a check that could not start (gpu/check.sh's too).
EXIT_REFUSED = 2
#: Foreign names a refusal lists before "..."
SHOWN = 3

KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class Refused(Exception):
    """Why a folder cannot hold the check's output, in words."""


def claim(path):
    """Make ``path`` ready for the check's output: made where it is missing, marked as the check's.

    Args:
        path: OUT as the user gave it (relative to the working directory, or absolute).

    Returns:
        Its absolute path (links above it kept as named: only OUT itself must not be one).

    Raises:
        Refused: OUT is none of a missing folder, an empty one or a check's (see the module's list).
    """
    path = Path(path).absolute()  # (not resolved: a link at OUT must be seen as one)
    if path.is_symlink():
        raise Refused(f"it is a symbolic link (to {os.readlink(path)}): name the folder itself")
    made = _missing_folders(path)
    if not made:
        _refuse_what_is_there(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        _mark(path)
    except OSError as err:
        for folder in made:  # (innermost first: each is empty again once the one inside it is gone)
            try:
                folder.rmdir()
            except OSError:
                break
        raise Refused(f"cannot {'make' if made else 'write in'} it: {err.strerror or err}") from None
    return path


def _missing_folders(path):
    """The folders of ``path`` that do not exist yet, innermost first (none where ``path`` exists)."""
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    return missing


def _refuse_what_is_there(path):
    """Raise :class:`Refused` where the existing ``path`` is not a folder the check may fill."""
    try:
        mode = os.lstat(path).st_mode
        names = os.listdir(path) if stat.S_ISDIR(mode) else None
    except OSError as err:
        raise Refused(f"cannot be read: {err.strerror or err}") from None
    if names is None:
        kind = next((words for test, words in KINDS if test(mode)), "not a folder")
        raise Refused(f"it exists and is {kind}, not a folder: name a folder")
    if names and MARK not in names:
        shown = ", ".join(sorted(names)[:SHOWN]) + (", ..." if len(names) > SHOWN else "")
        raise Refused(
            f"it holds {len(names)} file(s) the check did not write ({shown}), which its output could "
            "overwrite: name a new or empty folder"
        )


def _mark(path):
    """Write :data:`MARK` in ``path`` through a new file renamed into place: the test that the check may
    create files there, whatever ``os.access`` says (root passes it everywhere)."""
    aside = path / f"{MARK}.{os.getpid()}"
    descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(NOTE)
        os.replace(aside, path / MARK)
    finally:
        if os.path.lexists(aside):  # (the rename failed: MARK is a folder, say)
            os.unlink(aside)


def main(argv):
    """``out_folder.py OUT``: OUT claimed and its absolute path printed; exit code 2 where it is refused."""
    if len(argv) != 1:
        print("usage: out_folder.py OUT", file=sys.stderr)
        return EXIT_REFUSED
    try:
        print(claim(argv[0]))
    except Refused as why:
        print(f"gpu/check.sh: error: OUT {argv[0]}: {why}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
