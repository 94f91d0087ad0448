"""A checkpoint directory shared by runs: lineages, a lock, and what may be pruned.

Every checkpoint belongs to a *lineage*: the id of the run that wrote it,
inherited by the runs that resume it.  The id is part of the file name
(``ckpt-<step>-<lineage>.h5``; files from before lineages, ``ckpt-<step>.h5``,
form the lineage ``""``), so runs never overwrite each other's files, and a
run prunes only its own lineage (see :class:`CheckpointDir`):

- A fresh run (no ``--resume``) in a directory holding checkpoints stops with
  exit 2 and says how to go on: resume, another directory, or ``--new-lineage``.
- A resumed run continues the lineage of its checkpoint if that checkpoint is
  the lineage's newest; resuming an older one (by choice, or because newer
  ones do not load) starts a *branch*: a new lineage that records its parent,
  so the newer files it passed over are never pruned by it.
- ``--resume auto`` follows the lineage whose checkpoint was written last.
- One run at a time writes to a directory: the chief holds an exclusive
  ``flock`` on ``.mpidist-lock`` for the whole run.  The kernel releases it
  when the holder dies, however it dies, so a dead run never keeps it.
- Temporary files that killed writers left (``.ckpt-*.tmp-*``) are removed by
  the next run that holds the lock: no live writer can own them then.
"""

import dataclasses
import errno
import fcntl
import json
import os
import re
import socket
import stat
import time
from pathlib import Path

from ..runtime.errors import UsageError
from ..runtime.text import printable
from . import atomic, parts_debris, removal
from .outputs import is_regular_file

#: a checkpoint's name: its step in 8 digits or more (``{step:08d}`` grows a digit from step 10^8 on; 19 hold
#: any step a checkpoint may have, 2^62), then its lineage; matched whole (``fullmatch``: no trailing newline)
PATTERN = re.compile(r"ckpt-(\d{8,19})(?:-([0-9a-f]{8}))?\.h5")
LINEAGE = re.compile(r"[0-9a-f]{8}")
TEMPORARY = re.compile(r"\.(?:ckpt|best)-.*\.tmp-\d+")
LOCK_NAME = ".mpidist-lock"
RUN_LOCK_NAME = ".mpidist-run-lock"  # a run directory's: its metrics, log and settings are one run's


def new_lineage():
    """A fresh lineage id: 8 hex digits, random."""
    return os.urandom(4).hex()


def file_name(step, lineage):
    """``ckpt-00000066-3fa2c1d0.h5`` (``ckpt-00000066.h5`` for the lineage ``""`` of older runs)."""
    return f"ckpt-{step:08d}{'-' + lineage if lineage else ''}.h5"


def parse_name(name):
    """``(step, lineage)`` of a checkpoint file name, or None for other files.

    Files are ordered by this step, a number (never by their names: ``ckpt-100000000`` sorts before
    ``ckpt-99999999`` as a string).
    """
    match = PATTERN.fullmatch(name)
    return None if match is None else (int(match.group(1)), match.group(2) or "")


def describe(lineage):
    return f"lineage {lineage}" if lineage else "the lineage of files without an id (an older mpidist)"


@dataclasses.dataclass(frozen=True)
class Entry:
    """A checkpoint file in a directory, known by its name alone."""

    path: Path
    step: int
    lineage: str

    @property
    def written(self):
        """When the file was last written (nanoseconds); 0 if it vanished meanwhile."""
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return 0


class CheckpointDir:
    """The checkpoint files of one directory, by lineage."""

    def __init__(self, path):
        self.path = Path(path)

    def entries(self, lineage=None):
        """Checkpoint files (of ``lineage``, or all), lowest step first.

        Only regular files count: a named pipe, a socket, a device or a directory under a checkpoint's name
        is no checkpoint, and every user of this list (pruning, ``--resume auto``, the best checkpoint) would
        otherwise open it, where a pipe waits for a writer forever.  It is left where it is, untouched.
        """
        if not self.path.is_dir():
            return []
        found = []
        for path in self.path.iterdir():
            parsed = parse_name(path.name)
            if parsed is not None and (lineage is None or parsed[1] == lineage) and is_regular_file(path):
                found.append(Entry(path, *parsed))
        return sorted(found, key=lambda e: (e.step, e.lineage))

    def last_written(self):
        """The checkpoint file written last (by modification time, then step), or None."""
        entries = self.entries()
        return max(entries, key=lambda e: (e.written, e.step)) if entries else None

    def latest_lineage(self):
        """The lineage whose checkpoint was written last (``--resume auto`` follows it), or None."""
        last = self.last_written()
        return None if last is None else last.lineage

    def newest_of(self, lineage):
        """The highest-step entry of ``lineage``, or None."""
        entries = self.entries(lineage)
        return entries[-1] if entries else None

    def prune(self, lineage, keep, newest):
        """Delete all but the ``keep`` highest-step checkpoints of ``lineage``; returns the paths removed.

        ``newest`` (the file just written) is never removed, whatever its step:
        nothing newer than what the run just saved may push it out.  A symbolic
        link under a checkpoint's name is neither removed nor counted: mpidist
        never wrote one (see :mod:`mpidist.store.removal`).
        """
        if keep <= 0:
            return []
        entries = [
            e
            for e in self.entries(lineage)
            if e.path != Path(newest) and removal.kind(e.path) == removal.FILE
        ]
        old = entries[: max(0, len(entries) - (keep - 1))]
        done = removal.Removal()
        for entry in old:
            removal.remove_file(entry.path, done)
        return [e.path for e in old if e.path.name in done.removed]

    def remove_stale_temporaries(self):
        """Delete what killed writers left behind (call with the lock held): files aside, and the parts
        folders of sharded checkpoints no index names; returns the
        :class:`~mpidist.store.removal.Removal` (what was removed, and what was left and why)."""
        done = removal.Removal()
        if self.path.is_dir():  # (the directory the user named, a link to scratch or not; nothing in it)
            for path in sorted(self.path.iterdir()):
                if TEMPORARY.fullmatch(path.name):
                    removal.remove_file(path, done)
            debris = parts_debris.remove_unnamed_folders(self.path)
            done.removed += debris.removed
            done.left += debris.left
        return done


def newest_checkpoint(directory):
    """The path of the newest checkpoint of the lineage written last in ``directory`` ("" or missing:
    None)."""
    place = CheckpointDir(directory) if directory else None
    if place is None or not place.entries():
        return None
    latest = place.newest_of(place.latest_lineage())
    return None if latest is None else latest.path


@dataclasses.dataclass
class Claim:
    """What the chief settled at start-up: the lineage this run writes, and notes for the terminal."""

    lineage: str
    parent: str = None
    notes: list = dataclasses.field(default_factory=list)
    lock: "DirectoryLock" = None
    run_lock: "DirectoryLock" = None  # the run directory's, where there is one

    def release(self):
        for lock in (self.lock, self.run_lock):
            if lock is not None:
                lock.release()
        self.lock = self.run_lock = None


class DirectoryLock:
    """An exclusive ``flock`` on ``DIR/.mpidist-lock``, held while a run may write checkpoints there; with
    ``run`` on ``DIR/.mpidist-run-lock``, held while a run writes its run directory's metrics, log and
    settings."""

    def __init__(self, directory, run=False):
        self.path = Path(directory) / (RUN_LOCK_NAME if run else LOCK_NAME)
        self.flag, self.what = (
            ("--run-dir", "a run directory's metrics and settings")
            if run
            else ("--checkpoint-dir", "checkpoints to one directory")
        )
        self.fd = None
        self.warning = None  # why the directory could not be locked, where the file system cannot

    def acquire(self):
        """Take the lock, or raise :class:`UsageError` naming the run that holds it."""
        try:
            # (the holder's description is written into it: through a link, into any file the user may write;
            # O_NONBLOCK: a FIFO named like the lock is not waited on, and S_ISREG refuses it below)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | atomic.NO_FOLLOW, 0o644)
        except OSError as err:
            reason = (
                "it is a symbolic link, which mpidist never writes through"
                if err.errno == errno.ELOOP
                else err.strerror
            )
            raise UsageError(
                f"{self.flag} {self.path.parent}: cannot create its lock file {self.path.name} ({reason})"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(
                f"{self.flag} {self.path.parent}: its lock file {self.path.name} is not a file: remove it"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_holder(fd)
                os.close(fd)
                raise UsageError(
                    f"{self.flag} {self.path.parent} is in use by another run ({holder}): two "
                    f"runs cannot write {self.what}; wait for it to end, or use another "
                    f"{self.flag}"
                ) from None
            # some parallel file systems have no locks (Lustre without -o flock): go on, and say so
            self.warning = (
                f"{self.flag} {self.path.parent} cannot be locked ({err.strerror}): make sure no "
                "other run writes there"
            )
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(holder).encode())
        except OSError as err:  # (a full disk, a quota: nothing the run writes there would fit either)
            os.close(fd)
            raise UsageError(
                f"{self.flag} {self.path.parent}: cannot write its lock file {self.path.name} "
                f"({err.strerror or err})"
            ) from None
        self.fd = fd
        return self

    def release(self):
        if self.fd is not None:
            # (a run directory is the user's to read: no file is left there)
            if self.path.name == RUN_LOCK_NAME:
                self.path.unlink(missing_ok=True)
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _read_holder(fd):
    """The holder's own description of itself (untrusted text: printed escaped), or a fallback."""
    try:
        raw = os.pread(fd, 512, 0)
        holder = json.loads(raw.decode("utf-8"))
        return f"pid {int(holder['pid'])} on {str(holder['host'])!r} since {str(holder['since'])!r}"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "its lock file names no process"


def claim(config, resume):
    """Chief, at start-up: lock ``--checkpoint-dir``, clean it, and settle the lineage this run writes.

    Args:
        config: the run's settings (``checkpoint_dir``, ``resume``, ``new_lineage``).
        resume: the :class:`~mpidist.store.checkpoint.Checkpoint` the run resumes from, or None.

    Returns:
        a :class:`Claim` (its lock held until :meth:`Claim.release`).
    """
    if not config.checkpoint_dir:
        return Claim(lineage=resume.lineage if resume is not None else new_lineage())
    directory = CheckpointDir(config.checkpoint_dir)
    lock = DirectoryLock(directory.path).acquire()
    try:
        result = _settle_lineage(config, resume, directory)
    except BaseException:
        lock.release()
        raise
    result.lock = lock
    if lock.warning:
        result.notes.append(f"warning: {lock.warning}")
    cleaned = directory.remove_stale_temporaries()
    if cleaned.removed:
        result.notes.append(
            f"removed {len(cleaned.removed)} temporary file(s) that interrupted checkpoint writes left in "
            f"{directory.path}: {', '.join(printable(name) for name in cleaned.removed)}"
        )
    if cleaned.left:
        result.notes.append(f"note: {cleaned.note(directory.path)}")
    return result


def _settle_lineage(config, resume, directory):
    if resume is None:
        present = directory.entries()
        if present and config.resume != "auto" and not config.new_lineage:
            latest = directory.last_written()
            raise UsageError(
                f"--checkpoint-dir {directory.path} holds the checkpoints of another run "
                f"({len(present)} file(s), the last written {latest.path.name}, step {latest.step}); "
                "continue that run with --resume auto, write to another --checkpoint-dir, or start a "
                "new lineage of checkpoints beside it with --new-lineage (its files are kept)"
            )
        lineage = new_lineage()
        notes = (
            [
                f"new checkpoint lineage {lineage} in {directory.path}, beside {len(present)} checkpoint(s) "
                "of "
                "other runs (never pruned by this one)"
            ]
            if present
            else []
        )
        return Claim(lineage=lineage, notes=notes)
    newest = directory.newest_of(resume.lineage)
    continues = (
        newest is None
        or newest.step <= resume.step
        or Path(newest.path).resolve() == Path(resume.path).resolve()
    )
    if continues:
        return Claim(lineage=resume.lineage)
    lineage = new_lineage()
    return Claim(
        lineage=lineage,
        parent=resume.lineage,
        notes=[
            f"branching: {resume.path} (step {resume.step}) is not the newest checkpoint of its "
            f"{describe(resume.lineage)} ({newest.path.name} is): this run writes the new lineage "
            f"{lineage}, and leaves that one's files as they are"
        ],
    )
