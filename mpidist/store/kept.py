"""Files that no output a user names may replace: the command's own inputs, a run's files, checkpoints.

Every output of mpidist's commands (``ingest``'s dataset, ``predict``'s
predictions, ``bench``'s and ``plan``'s results, a calibration, a figure)
replaces the file at its path whole.  That is right for a file of its own
kind, and wrong for a file the command reads (``plan --calibration c.json
--output c.json`` turned the measured calibration into the plan) or a file a
run keeps: its ``settings.toml`` (``--config`` reads it back), its
``metrics.jsonl``, its log and timeline, and checkpoints, which ``--resume``
and ``eval`` find by their names.  :func:`refuse_kept` refuses those, in one
line, before any work.
"""

import contextlib
import os
from pathlib import Path

from ..runtime.errors import UsageError
from .lineage import PATTERN

#: a run directory's files (:mod:`mpidist.store.rundir` names them): the settings and the metrics first,
#: which are refused wherever they are; a log or a timeline only where a run keeps one of those beside it
RUN_FILES = ("settings.toml", "metrics.jsonl", "log.txt", "trace.json")
_WHAT = dict(zip(RUN_FILES, ("settings", "metrics", "log", "timeline")))


def refuse_kept(path, option, inputs=()):
    """Raise :class:`UsageError` if output ``path`` (named by ``option``, e.g. ``"--output"``) would replace
    one of ``inputs`` (paths this command reads), a run's file or a checkpoint."""
    path = Path(path)
    for source in inputs:
        if _same(path, Path(source)):
            raise UsageError(
                f"{option} {path}: is {source}, an input of this command: write the output elsewhere"
            )
    if PATTERN.fullmatch(path.name):
        raise UsageError(
            f"{option} {path}: is named as a checkpoint is (ckpt-<step>.h5), which runs would take it for: "
            "give the output another name"
        )
    if path.name in RUN_FILES and (path.exists() or path.is_symlink()):
        if path.name in RUN_FILES[:2] or any((path.parent / name).exists() for name in RUN_FILES[:2]):
            raise UsageError(
                f"{option} {path}: an existing {path.name}, the file a run keeps its {_WHAT[path.name]} in: "
                "write the output elsewhere"
            )


def _same(target, source):
    """Whether ``target`` is ``source`` (by path, or an existing file by its inode: a hard link, a link)."""
    if target.resolve() == source.resolve():
        return True
    with contextlib.suppress(OSError):
        return target.exists() and os.path.samefile(target, source)
    return False
