"""A run's directory: its settings, metrics, log, timeline and checkpoints, in ``runs/<name>-<date-time>/``.

As TensorBoard and Lightning users expect, each run writes into a directory
of its own (``--run-dir``; ``auto``: ``runs/<model>-<data>-<strategy>-<date>-<time>``
under the working directory):

=================  ==========================================================
``settings.toml``  the run's settings, resolved (``--config`` takes it back)
``metrics.jsonl``  the metrics (unless ``--metrics`` names another file)
``log.txt``        what the chief printed, as plain lines
``trace.json``     the timeline, with ``--trace``
``checkpoints/``   unless ``--checkpoint-dir`` names another directory
=================  ==========================================================

A resumed run continues in the directory it resumes from: ``--resume
runs/X/checkpoints/ckpt-...h5``, or ``--resume auto`` (the newest directory of
runs of the same name that holds a checkpoint).  ``--run-dir ''`` writes no
directory: metrics go to ``metrics.jsonl`` in the working directory, and
there are no checkpoints unless ``--checkpoint-dir`` asks for them.
"""

import dataclasses
import datetime
import os
import re
import shlex
from pathlib import Path

from ..runtime.errors import UsageError
from . import atomic, bounded, removal
from .checkpoint import settings_of
from .kept import RUN_FILES
from .lineage import LOCK_NAME, RUN_LOCK_NAME, newest_checkpoint
from .outputs import is_regular_file, special_kind

ROOT = "runs"
SETTINGS, METRICS, LOG, TRACE = RUN_FILES
CHECKPOINTS = "checkpoints"
AUTO = "auto"
#: settings that say where this run's files go, not what it does: not written to settings.toml
WHERE = ("run_dir", "resume", "metrics", "checkpoint_dir", "config")


def run_name(config, by_file=False):
    """``mlp-digits-allreduce``: the model, the dataset and the strategy, in characters safe in a file name.

    A builder is named by its file's or module's last name and its function
    (``my_script-build`` for ``/home/me/work/my_script.py:build``), not by the
    path that leads to it.  A dataset file is named by the ``name`` it records
    (``ingest`` writes the source's: ``diabetes``, not ``data`` of ``data.h5``),
    or ``by_file``, or where it records none, by the file's.
    """
    data = config.data
    if os.sep in data or data.endswith(".h5"):
        data = (None if by_file else _recorded_name(data)) or Path(data).stem
    parts = [_model_name(config.model), data, config.strategy]
    return "-".join(_safe(part) for part in parts if part)


def _safe(part):
    return re.sub(r"[^A-Za-z0-9_.]+", "-", part).strip("-.")[:40]


def _recorded_name(path):
    """The ``name`` attribute of dataset file ``path`` as a name part, or None (not a regular HDF5 file, no
    name, nothing left of it once made safe).  Untrusted: only its first 200 characters are looked at."""
    import h5py

    # (a directory of files, or something opening would wait on: the file's name)
    if not os.path.isfile(path):
        return None
    try:
        with h5py.File(path, "r") as handle:
            name = bounded.Attributes(handle, lambda item, problem: ValueError(problem)).get("name")
    except (OSError, ValueError, RuntimeError):
        return None
    name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
    return (_safe(name[:200]) or None) if isinstance(name, str) else None


def _model_name(spec):
    """A model spec's short name: a zoo spec as it is, a builder's file (or module) stem and function."""
    where, _, function = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where or "/" in where:
        return f"{Path(where).stem}-{function}"
    if "." in where:  # package.module:function
        return f"{where.rsplit('.', 1)[1]}-{function}"
    return spec


def planned(config):
    """The run directory ``config`` asks for, before it is made: its path, ``''`` for none, or None (a new
    one)."""
    if config.run_dir != AUTO:
        return config.run_dir
    if config.resume:  # a run directory's checkpoint (or its checkpoints/): continue that run
        directory, path = _resumed_from(config)
        source = Path(directory) if directory is not None else Path(path).parent if path else None
        if source is not None and source.name == CHECKPOINTS and (source.parent / SETTINGS).is_file():
            return str(source.parent)
        # a checkpoint kept elsewhere (--checkpoint-dir): the run directory its run recorded, if it is still
        # there
        recorded = _recorded_run_dir(path) if path else None
        if recorded is not None:
            return recorded
    if config.resume == AUTO and config.checkpoint_dir == AUTO:
        newest = newest_run(config)
        if newest is not None:
            return str(newest)
    return None


def _resumed_from(config):
    """``(directory, checkpoint)`` a resumed run takes its checkpoint from: ``--resume auto``'s
    ``--checkpoint-dir`` and its newest, ``--resume DIR`` and its newest, or ``--resume FILE`` (no directory);
    None where it is not known yet."""
    if config.resume == AUTO:
        if config.checkpoint_dir in (AUTO, ""):
            return None, None
        return config.checkpoint_dir, newest_checkpoint(config.checkpoint_dir)
    if os.path.isdir(config.resume):
        directory = checkpoints_in(config.resume)
        return directory, newest_checkpoint(directory)
    return None, config.resume


def checkpoints_in(directory):
    """The checkpoint directory ``--resume DIR`` names: a run directory's ``checkpoints/``, or ``DIR``."""
    inner = Path(directory) / CHECKPOINTS
    if inner.is_dir() and (Path(directory) / SETTINGS).is_file():
        return str(inner)
    return str(directory)


def _recorded_run_dir(path):
    """The run directory checkpoint ``path``'s settings name, where it still holds that run's settings; else
    None.

    Only the settings are read (``--resume`` itself validates the whole file later).
    """
    recorded = (settings_of(path) or {}).get("run_dir")
    if not isinstance(recorded, str) or not recorded or not os.path.isabs(recorded):
        return None
    return recorded if (Path(recorded) / SETTINGS).is_file() else None


def metrics_of(path):
    """The metrics file of run directory ``path`` (or ``path`` itself, a metrics file given as such)."""
    path = Path(path)
    return path if path.is_file() else path / METRICS


def newest_run(config, root=ROOT):
    """The newest directory of runs named as ``config``'s under ``root`` holding a checkpoint, or None (runs
    named by their dataset file's name, as before datasets were named by what they record, too)."""
    names = "|".join(re.escape(run_name(config, by_file)) for by_file in (False, True))
    pattern = re.compile(rf"(?:{names})-(\d{{8}}-\d{{6}})(?:-(\d+))?")

    def started(entry):  # (its time, then its -2, -3... among runs started in the same second)
        match = pattern.fullmatch(entry.name)
        return match.group(1), int(match.group(2) or 1)

    try:
        candidates = [
            entry
            for entry in Path(root).iterdir()
            if pattern.fullmatch(entry.name)
            and any(is_regular_file(ckpt) for ckpt in (entry / CHECKPOINTS).glob("ckpt-*.h5"))
        ]
    except OSError:
        return None
    return max(candidates, key=started, default=None)


def resolved(config, run_dir):
    """``config`` with ``run_dir`` in place and ``--metrics``/``--checkpoint-dir`` ``auto`` resolved."""
    metrics = config.metrics
    if metrics == AUTO:
        metrics = str(Path(run_dir) / METRICS) if run_dir else METRICS
    checkpoint_dir = config.checkpoint_dir
    if checkpoint_dir == AUTO:
        checkpoint_dir = str(Path(run_dir) / CHECKPOINTS) if run_dir else ""
    return dataclasses.replace(config, run_dir=run_dir, metrics=metrics, checkpoint_dir=checkpoint_dir)


def absolute(config):
    """``config`` with its paths (``--metrics``, ``--checkpoint-dir``, ``--resume``) absolute.

    A checkpoint records its run's settings: a relative path there would
    name another file for a command run from another directory.
    """
    paths = {
        name: os.path.abspath(getattr(config, name))
        for name in ("metrics", "checkpoint_dir", "resume")
        if getattr(config, name) not in ("", AUTO)
    }
    return dataclasses.replace(config, **paths)


def make(config, where, now=None, root=ROOT, created=None):
    """Create the run directory ``where`` (:func:`planned`'s answer for ``config``) and return its absolute
    path.

    One rank makes it, the others are told.  A new one (``where`` None) is
    named ``<name>-<YYYYmmdd>-<HHMMSS>``, with ``-2``, ``-3``... where runs
    started in the same second.  Nothing is written in it yet.  ``created``, a
    list, receives the directories made, innermost first (:func:`take_back`
    takes back those a refused run never wrote into).
    """
    created = [] if created is None else created
    if where == "":
        return ""
    try:
        if where is not None:
            if os.path.exists(where) and not os.path.isdir(where):
                raise UsageError(f"--run-dir {where}: is a file, not a directory")
            _refuse_metrics_among_its_files(config, where)
            created += removal.make_directories(where)
            _check_directory(where)
            for name in (SETTINGS, LOG):  # (renamed over or appended to: a FIFO would be replaced or block)
                kind = special_kind(Path(where) / name)
                # (appended: it would be written through)
                if name == LOG and os.path.islink(Path(where) / name):
                    kind = "a symbolic link, which appending would write through"
                if kind is not None:
                    raise UsageError(
                        f"--run-dir {where}: its {name} is {kind}, not a file: remove it, or give "
                        "another --run-dir"
                    )
            return os.path.abspath(where)
        stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
        created += removal.make_directories(root)  # (the run's own goes first: innermost)
        base = Path(root) / f"{run_name(config)}-{stamp}"
        for count in range(1, 1000):
            path = base if count == 1 else Path(f"{base}-{count}")
            try:
                os.mkdir(path)
                created.insert(0, Path(os.path.abspath(path)))
                return os.path.abspath(path)
            except FileExistsError:
                continue
    except OSError as err:
        raise UsageError(
            f"--run-dir {where or root}: cannot create the run directory ({err.strerror})"
        ) from None
    raise UsageError(f"--run-dir: {base} and 998 more like it exist already")


def take_back(created):
    """Take back the directories a run made (``created``, innermost first: :func:`make`'s) where it wrote
    nothing into them (:func:`remove_if_empty`)."""
    if created:
        remove_if_empty(created[0])
        if not os.path.lexists(created[0]):
            removal.remove_made(created[1:])


def remove_if_empty(path):
    """Remove run directory ``path`` if the run wrote nothing into it.

    Nothing: an empty ``checkpoints/`` (its lock aside), the run's lock, and a metrics file
    or log opened but never written (a run refused after it opened them).  Only regular files
    and real folders count as the run's (see :mod:`mpidist.store.removal`): a link among them,
    or anything else, keeps the directory as it is.
    """
    root, checkpoints = Path(path), Path(path) / CHECKPOINTS
    try:
        if removal.kind(root) != removal.FOLDER:
            return
        unwritten = [
            root / name
            for name in (METRICS, LOG)
            if removal.kind(root / name) == removal.FILE and (root / name).stat().st_size == 0
        ]
        if (
            {entry.name for entry in root.iterdir()}
            - {CHECKPOINTS, RUN_LOCK_NAME}
            - {e.name for e in unwritten}
        ):
            return
        if removal.kind(checkpoints) not in (removal.FOLDER, removal.MISSING):
            return
        if checkpoints.is_dir() and {entry.name for entry in checkpoints.iterdir()} - {LOCK_NAME}:
            return
        done = removal.Removal()
        for entry in unwritten + [root / RUN_LOCK_NAME, checkpoints / LOCK_NAME]:
            removal.remove_file(entry, done)
        if done.left:
            return
        if checkpoints.is_dir():
            checkpoints.rmdir()
        root.rmdir()
    except OSError:  # (someone else's files appeared, or it went: either way, leave it)
        return


def _check_directory(path):
    if not os.path.isdir(path):
        raise UsageError(f"--run-dir {path}: is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--run-dir {path}: cannot be written to")


def _refuse_metrics_among_its_files(config, where):
    """Refuse ``--metrics`` naming another of run directory ``where``'s files: metrics appended to its
    settings (which the run then keeps aside as settings-1.toml) or interleaved with its log."""
    if config.metrics in ("", AUTO):
        return
    metrics = Path(config.metrics).expanduser().resolve()
    for name in (SETTINGS, LOG, TRACE):
        if metrics == (Path(where).expanduser() / name).resolve():
            raise UsageError(
                f"--metrics {config.metrics}: is the run directory's {name}, which the run writes itself: "
                f"leave --metrics out (its metrics go to {Path(where) / METRICS}) or name another file"
            )


class LogCopy:
    """The chief's terminal stream, copied to ``log.txt`` as plain lines: a redrawn progress bar is left out.

    Text is copied a whole line at a time, each line from its last carriage
    return on (what a terminal shows of it once drawn).
    """

    def __init__(self, stream, path):
        self.stream, self.path, self.pending, self.file = stream, path, "", None
        self.broken = False  # the log could not be written: the terminal alone goes on

    def write(self, text):
        self.stream.write(text)
        if self.broken:
            return
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if lines:
            try:
                if self.file is None:  # opened at the first line: a run refused at set-up leaves no file
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | atomic.NO_FOLLOW, 0o644)
                    self.file = open(fd, "a", encoding="utf-8", errors="backslashreplace")
                self.file.write("".join(line.rsplit("\r", 1)[-1] + "\n" for line in lines))
                self.file.flush()
            except OSError:  # a full disk: the terminal still shows everything, the log stops
                self.close()
                self.broken = True

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()

    def close(self):
        if self.pending.rsplit("\r", 1)[-1].strip() and not self.broken:
            self.pending += "\n"
            self.write("")
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
            self.file = None


def resume_flags(config):
    """The flags that resume the run of ``config`` from its newest checkpoint, as a user would type them."""
    if config.run_dir and os.path.abspath(config.checkpoint_dir) == os.path.abspath(
        Path(config.run_dir) / CHECKPOINTS
    ):
        return f"--resume auto --run-dir {shlex.quote(config.run_dir)}"
    return f"--resume auto --checkpoint-dir {shlex.quote(config.checkpoint_dir)}"
