"""The dataset layout: what a file (or a directory of files) must hold, checked before anything is read.

Layout (contract): one HDF5 file with groups ``train/`` and ``test/``, each holding ``x`` (samples first) and
``y`` (integer class labels, or float targets; class labels may have a sequence axis, ``(N, L)``: one label
per position, for models that classify every position); file attributes ``name``, ``num_classes`` (0 for
regression) and ``source``.  Optional: ``stats/mean`` and ``stats/std`` (floats of the sample shape:
standardisation statistics, applied when samples are read, so ``x`` stays as stored), ``class_names`` (text,
one per class), ``feature_names`` (text, one per value of a sample of one axis: a CSV header's) and a ``val/``
group (the validation split, checked like the others).

A dataset may also be a directory (or a glob) of such files, taken in natural
name order (``part-2`` before ``part-10``): each split's rows are the
concatenation of that split's rows over the files.  The files must agree on
everything but their rows (attributes, sample shape, statistics, class
names); a file may hold no rows of a split, the dataset as a whole may not.

This module checks that contract: the splits' ``x`` and ``y``, the file's
attributes, and the files' agreement.  Around it, one module per concept:
:mod:`~mpidist.data.sources` finds the files ``--data`` names,
:mod:`~mpidist.data.items` fetches each item safely and checks the optional
ones, and :mod:`~mpidist.data.info` holds the :class:`DatasetInfo` the checks
produce and the splits a run cuts from it.
"""

import dataclasses
from pathlib import Path

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.text import printable, shown
from ..runtime.whereabouts import here
from ..store import bounded
from .arrays import ArrayData
from .info import DatasetInfo, Member
from .items import checked_dataset, class_names, feature_names, present, statistics
from .sources import members, open_source

SPLITS = ("train", "test")
OPTIONAL_SPLITS = ("val",)  # a validation split a file may hold (else --val-fraction carves one from train)
MAX_CLASSES = 2**24  # more output units than any classifier here could train: a corrupt attribute


def inspect(path, allow_external=False):
    """Open dataset ``path`` (a file, or a directory or glob of files), check the layout, describe it.

    Reads no sample data.  Every file is untrusted: every item is checked
    before it is used (type, shape, dtype, range), links that leave the file
    (external links, virtual datasets) are refused unless ``allow_external``
    (``--allow-external``), and a broken file gives one message naming the
    file and the item.
    """
    path = path if isinstance(path, ArrayData) else Path(path)
    files = members(path)
    if len(files) == 1 and files[0] is path:
        return _inspect_file(path, allow_external, part=False)
    return _combined(path, [_inspect_file(file, allow_external, part=True) for file in files])


#: the files ``ingest`` turns into datasets, by their suffix
INGESTED = (".csv", ".tsv", ".txt", ".npy", ".npz")


def _ingest_hint(path):
    """Where ``path`` is a file ``ingest`` reads (a CSV, numpy arrays): how to make a dataset of it."""
    suffix = Path(str(path)).suffix.lower()
    if suffix not in INGESTED:
        return ""
    made = Path(str(path)).with_suffix(".h5").name
    return (
        f"; a {suffix[1:].upper()} file is read by ingest, which writes a dataset to train on: "
        f"python -m mpidist ingest {path} {made}"
    )


def _inspect_file(path, allow_external, part):
    with here().doing("io", f"reading dataset {path}"):
        try:
            handle = open_source(path)
        except OSError as err:
            raise UsageError(
                f"{path}: not a readable HDF5 file ({printable(err)}){_ingest_hint(path)}"
            ) from None
        with handle:
            try:
                return _describe(path, handle, allow_external, part)
            except (KeyError, RuntimeError, OSError, ValueError, TypeError) as err:  # links that loop, a
                raise UsageError(f"{path}: not a readable dataset ({printable(err)})") from None  # bad header


def _combined(path, parts):
    """One :class:`DatasetInfo` for the files ``parts`` describe: they must agree on all but their rows."""
    first = parts[0]
    for other in parts[1:]:
        for what, mine, theirs in (
            ("num_classes", first.num_classes, other.num_classes),
            ("sample shape", first.sample_shape, other.sample_shape),
            ("target width", first.target_width, other.target_width),
            ("class_names", first.class_names, other.class_names),
            ("feature_names", first.feature_names, other.feature_names),
            ("splits", sorted(first.sizes), sorted(other.sizes)),
        ):
            if mine != theirs:
                raise UsageError(
                    f"{path}: the files differ in {what}: {first.path.name} has "
                    f"{shown(mine)}, {other.path.name} has {shown(theirs)}; the files of one "
                    "dataset differ only in their rows"
                )
        for key, mine, theirs in (("mean", first.mean, other.mean), ("std", first.std, other.std)):
            if (mine is None) != (theirs is None) or (mine is not None and not np.array_equal(mine, theirs)):
                raise UsageError(
                    f"{path}: the files differ in stats/{key}: {first.path.name} and "
                    f"{other.path.name} must be standardised with the same statistics"
                )
    sizes = {split: sum(part.sizes[split] for part in parts) for split in first.sizes}
    for split, rows in sizes.items():
        if rows == 0:
            raise UsageError(
                f"{path}: no file has rows of the {split} split; training and evaluation need "
                "samples in both train and test"
            )
    return dataclasses.replace(
        first, path=path, sizes=sizes, files=tuple(m for part in parts for m in part.files)
    )


def _describe(path, handle, allow_external, part=False):
    """A file's :class:`DatasetInfo`; ``part``: one file of several, which may hold no rows of a split."""
    items = {}
    splits = SPLITS + tuple(split for split in OPTIONAL_SPLITS if present(handle, split))
    for split in splits:
        for key in ("x", "y"):
            items[split, key] = checked_dataset(path, handle, f"{split}/{key}", allow_external)
    attrs = bounded.Attributes(handle, lambda item, problem: UsageError(f"{path}: {item} {problem}"))
    num_classes = _num_classes(path, attrs)
    sizes, shapes, widths = {}, set(), set()
    for split in splits:
        x, y = items[split, "x"], items[split, "y"]
        for key, item in (("x", x), ("y", y)):
            if item.dtype.kind not in "biuf":
                raise UsageError(f"{path}: {split}/{key} has dtype {item.dtype}; it must be numeric")
        if x.ndim < 2:
            raise UsageError(
                f"{path}: {split}/x has shape {x.shape}; it needs samples first and at least one feature axis"
            )
        if 0 in x.shape[1:]:
            raise UsageError(f"{path}: {split}/x has shape {x.shape}: samples of no features")
        if y.ndim == 0:
            raise UsageError(f"{path}: {split}/y is a single value; it needs one target per sample")
        if y.shape[0] != x.shape[0]:
            raise UsageError(f"{path}: {split}/x has {x.shape[0]} samples but {split}/y has {y.shape[0]}")
        if x.shape[0] == 0 and not part:
            raise UsageError(
                f"{path}: the {split} split is empty; training and evaluation need samples in "
                "both (`python -m mpidist ingest --test-fraction` splits a source)"
            )
        if num_classes > 0 and (y.ndim not in (1, 2) or y.dtype.kind not in "biu" or 0 in y.shape[1:]):
            raise UsageError(
                f"{path}: {split}/y must be integer class labels for num_classes = {num_classes}, "
                f"(N,) or (N, L) for one per position, got shape {y.shape} dtype {y.dtype}"
            )
        if num_classes == 0 and (y.ndim > 2 or (y.ndim == 2 and y.shape[1] == 0)):
            raise UsageError(f"{path}: {split}/y has shape {y.shape}; regression targets are (N,) or (N, K)")
        sizes[split] = int(x.shape[0])
        shapes.add(tuple(int(d) for d in x.shape[1:]))
        widths.add(1 if y.ndim == 1 else int(y.shape[1]))
    if len(shapes) > 1:
        raise UsageError(f"{path}: the {', '.join(splits)} samples differ in shape: {sorted(shapes)}")
    if len(widths) > 1:
        raise UsageError(f"{path}: the {', '.join(splits)} targets differ in width: {sorted(widths)}")
    sample_shape = shapes.pop()
    mean, std = statistics(path, handle, sample_shape, allow_external)
    member = Member(
        path,
        sizes,
        chunk_rows={s: int(items[s, "x"].chunks[0]) if items[s, "x"].chunks else 1 for s in splits},
        row_bytes={s: int(np.prod(sample_shape)) * items[s, "x"].dtype.itemsize for s in splits},
        spans={s: (_span(items[s, "x"]), _span(items[s, "y"])) for s in splits},
    )
    return DatasetInfo(
        path=path,
        name=_text(attrs.get("name"), path.stem),
        num_classes=num_classes,
        source=_text(attrs.get("source"), ""),
        sample_shape=sample_shape,
        sizes=sizes,
        target_width=widths.pop(),
        mean=mean,
        std=std,
        class_names=class_names(path, handle, num_classes, allow_external),
        feature_names=feature_names(path, handle, sample_shape, allow_external),
        files=(member,),
    )


def _span(item):
    """Bytes HDF5 decompresses to read any row of a chunk of ``item``: its chunk rows' values; 0 if not
    filtered."""
    if item.chunks is None or not item.id.get_create_plist().get_nfilters():
        return 0
    return int(item.chunks[0]) * item.dtype.itemsize * int(np.prod(item.shape[1:], dtype=np.int64))


def _num_classes(path, attrs):
    """The ``num_classes`` attribute, checked: an integer, 0 (regression) or 2 to MAX_CLASSES."""
    if "num_classes" not in attrs:
        raise UsageError(f"{path}: missing file attribute 'num_classes' (0 for regression)")
    value = attrs.get("num_classes")
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(())[()]
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if isinstance(value, (float, np.floating)) and np.isfinite(value) and float(value).is_integer():
        integral, value = True, int(value)
    if not integral:
        raise UsageError(
            f"{path}: num_classes = {shown(value)} is not an integer (0 for regression, "
            "or the number of classes)"
        )
    value = int(value)
    if value < 0 or value == 1 or value > MAX_CLASSES:
        raise UsageError(
            f"{path}: num_classes = {value}; use 0 for regression or 2 to {MAX_CLASSES:,} classes"
        )
    return value


def _text(value, default):
    """An attribute shown to users: text with control characters escaped."""
    if value is None:
        return default
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return printable(value)
