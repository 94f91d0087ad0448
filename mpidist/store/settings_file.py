"""A run directory's ``settings.toml``: the run's settings, resolved, as ``--config`` reads them back; one
there already that says something else is kept first (``settings-<n>.toml``)."""

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

from ..runtime.errors import UsageError
from . import atomic
from .outputs import is_regular_file
from .rundir import SETTINGS, WHERE


def write_settings(config, run_dir):
    """Write the resolved settings to ``run_dir/settings.toml`` (atomically): what ``--config`` reads back.

    Where the run's files went is left out, so a run started from the file
    writes a directory of its own.  A ``settings.toml`` there already that
    says something else (an earlier run's in a ``--run-dir`` used again, a
    user's own file) is kept first, as ``settings-<n>.toml`` (the first free
    ``n``), whose name is returned (None where nothing was kept).
    """
    lines = ["# mpidist: this run's settings, resolved; `python -m mpidist train --config` takes them back"]
    for field in dataclasses.fields(config):
        if field.name not in WHERE:
            lines.append(f"{field.name.replace('_', '-')} = {toml_value(getattr(config, field.name))}")
    text = ("\n".join(lines) + "\n").encode("utf-8")
    target = Path(run_dir) / SETTINGS
    try:
        kept = _keep_other(target, text)
        with atomic.replacing(target) as aside:
            aside.write_bytes(text)
    except OSError as err:
        raise UsageError(f"--run-dir {run_dir}: cannot write {SETTINGS} ({err.strerror})") from None
    return kept


def _keep_other(target, text):
    """Keep the file ``target`` under a free ``settings-<n>.toml`` name beside it (a hard link, else a copy)
    unless it holds ``text`` or is no regular file; the name kept, or None."""
    if not is_regular_file(target):
        return None
    if target.stat().st_size == len(text) and target.read_bytes() == text:  # (read only at the same size)
        return None
    for count in range(1, 10_000):
        kept = target.with_name(f"{target.stem}-{count}{target.suffix}")
        try:
            _keep_as(target, kept)
        except FileExistsError:
            continue
        return kept.name
    raise UsageError(f"{target}: settings-1.toml to settings-9999.toml all exist: clear some of them")


def _keep_as(target, kept):
    """``target``'s content under the new name ``kept``: a hard link, or where the file system has none a
    copy (never over a file: FileExistsError, as for the link)."""
    try:
        os.link(target, kept)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    with open(target, "rb") as source, open(kept, "xb") as copy:
        shutil.copyfileobj(source, copy)


def toml_value(value):
    """A TOML literal of a setting: a bool, an int, a float (``inf``, ``nan`` as TOML spells them) or a
    string.

    JSON's string escapes are TOML's basic-string escapes.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    return json.dumps(str(value))
