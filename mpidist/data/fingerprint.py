"""How a run records its dataset: by an absolute path (or a bundled name), and by a fingerprint of its
content.

A checkpoint stores the ``--data`` it trained on, so that ``eval`` and
``predict`` without ``--data`` use that dataset again.  :func:`recorded` gives
the form stored: a path as the absolute, resolved path it stood for (a
relative one would name whatever file has that name in the working directory
of the later command), a bundled dataset's name as it is.

A path says where a dataset was, not what it held: a file re-ingested under
the same name is another dataset.  So a checkpoint also stores the dataset's
:func:`fingerprint`, a SHA-256 over what the layout declares (attributes,
each file's rows per split, each item's shape and dtype, statistics, class
names) and a bounded sample of its bytes: :data:`SAMPLE_BYTES` at the start,
the middle and the end of each split's ``x`` and ``y`` in up to
:data:`SAMPLED_FILES` of its files.  It reads a few megabytes whatever the
dataset's size, and tells a changed dataset from the recorded one in all but
contrived cases (a change in rows outside the samples, the shapes and
attributes kept).  :func:`mismatch` compares them.
"""

import glob
import hashlib
import os
from pathlib import Path

import numpy as np

from ..runtime.errors import UsageError
from .arrays import ArrayData
from .sources import open_source, resolve

SCHEME = "sha256-1"  # the fingerprint's recipe: a checkpoint written by another is not compared
SAMPLED_FILES = 8  # files of a dataset whose bytes are sampled (spread over them)
SAMPLE_BYTES = 64 << 10  # bytes read at each of three places of each item of a sampled file


def recorded(spec):
    """What a run records of dataset ``spec``: a bundled name as it is, a path absolute and resolved.

    An :class:`~mpidist.data.arrays.ArrayData` is recorded by its description.
    """
    if not isinstance(spec, (str, os.PathLike)):  # (arrays in memory: no later command reads them again)
        return str(spec)
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_file() or path.is_dir():
        return str(path.resolve())
    if glob.has_magic(text):
        return os.path.abspath(path)  # (its matches are found again from there)
    if path.suffix == "" and os.sep not in text:
        return text  # a bundled dataset's name (or none: resolve() says so)
    return os.path.abspath(path)


def fingerprint(info):
    """``"sha256-1:<hex>"`` of dataset ``info``'s content (see the module text); ``""`` for arrays in memory,
    or where its files cannot be read now (nothing is then recorded, and nothing compared)."""
    if isinstance(info.path, ArrayData) or not info.files:
        return ""
    digest = hashlib.sha256()

    def add(*parts):
        digest.update(repr(parts).encode("utf-8", "backslashreplace"))

    add(
        info.name,
        info.num_classes,
        info.source,
        tuple(info.sample_shape),
        info.target_width,
        info.class_names,
    )
    for stats in (info.mean, info.std):
        add(None if stats is None else np.asarray(stats, np.float64).tobytes())
    add([sorted(member.sizes.items()) for member in info.files])
    count = len(info.files)
    picked = (
        range(count)
        if count <= SAMPLED_FILES
        else sorted({k * (count - 1) // (SAMPLED_FILES - 1) for k in range(SAMPLED_FILES)})
    )
    try:
        for index in picked:
            member = info.files[index]
            with open_source(member.path) as handle:
                for split in sorted(member.sizes):
                    for key in ("x", "y"):
                        _add_samples(add, handle[f"{split}/{key}"])
    # (gone or changed since it was inspected)
    except (
        OSError,
        KeyError,
        ValueError,
        TypeError,
        RuntimeError,
    ):
        return ""
    return f"{SCHEME}:{digest.hexdigest()}"


def _add_samples(add, item):
    """``item``'s shape, dtype and up to :data:`SAMPLE_BYTES` of its values at its start, middle and end."""
    add(tuple(item.shape), item.dtype.str)
    rows = int(item.shape[0]) if item.shape else 0
    if rows == 0:
        return
    trailing = [int(d) for d in item.shape[1:]]
    # rows per place; where one row is larger than the sample, only the first part of its last axes
    row_bytes = max(1, item.dtype.itemsize * int(np.prod(trailing, dtype=np.int64)))
    take = max(1, min(rows, SAMPLE_BYTES // row_bytes))
    while (
        item.dtype.itemsize * take * int(np.prod(trailing, dtype=np.int64)) > SAMPLE_BYTES
        and max(trailing) > 1
    ):
        largest = trailing.index(max(trailing))
        trailing[largest] = (trailing[largest] + 1) // 2
    for start in sorted({0, (rows - take) // 2, rows - take}):
        add(np.asarray(item[(slice(start, start + take),) + tuple(slice(0, d) for d in trailing)]).tobytes())


def mismatch(recorded_fingerprint, recorded_data, info):
    """Why dataset ``info`` is not the one a checkpoint recorded under the same name; None where it is.

    Args:
        recorded_fingerprint: the checkpoint's fingerprint (``""`` for one written before they were).
        recorded_data: the ``--data`` the checkpoint's settings record.
        info: the :class:`~mpidist.data.DatasetInfo` of the dataset read now.

    Returns:
        None where ``info`` is another dataset than the one recorded (nothing to compare), where either
        fingerprint is unknown, or where they agree; else the words of the difference.
    """
    if (
        not recorded_fingerprint
        or not recorded_fingerprint.startswith(SCHEME + ":")
        or _where(info.path) is None
        or _where(info.path) != _where(recorded_data)
    ):
        return None
    now = fingerprint(info)
    if not now or now == recorded_fingerprint:
        return None
    return (
        f"dataset {recorded_data} is not the dataset it was trained on: its content changed since (its "
        "fingerprint, over the attributes, shapes and a sample of the rows, differs from the one the "
        "checkpoint recorded)"
    )


def _where(spec):
    """The absolute path ``spec`` (a path, a bundled name, a DatasetInfo's path) reads; None for arrays or
    nothing."""
    if isinstance(spec, ArrayData):
        return None
    try:
        return os.path.realpath(resolve(os.fspath(spec)))
    except (UsageError, OSError, ValueError, TypeError):
        return None
