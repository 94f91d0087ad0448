"""A dataset file in the mpidist layout, written whole once its splits pass the checks ``train`` makes.

:func:`write_dataset` is how ``ingest`` (and the tests) write a single file:
the splits, the standardisation statistics and the class names are checked
as :func:`mpidist.data.inspect` and :class:`mpidist.data.Shard` will check
them, then written aside and renamed into place
(:func:`mpidist.store.outputs.claimed`).  The checks are also used on their
own by the readers of ``.npz`` and ``.csv`` files, so a bad value is refused
naming the file, the item and the value before anything is written.
"""

from pathlib import Path

import h5py
import numpy as np

from ..data import MAX_CLASSES, MAX_NAME, writer
from ..runtime.errors import UsageError
from ..runtime.text import printable
from ..store import new_hdf5
from ..store.outputs import claimed

FLOAT32_MAX = float(np.finfo(np.float32).max)
KINDS = {
    "U": "text",
    "S": "bytes",
    "O": "objects",
    "c": "complex numbers",
    "M": "dates",
    "m": "time spans",
    "V": "records",
}


def write_dataset(
    path,
    name,
    splits,
    num_classes,
    source,
    where=None,
    check_values=False,
    stats=None,
    class_names=None,
    compression="gzip",
    feature_names=None,
):
    """Write ``splits = {"train": (x, y), "test": (x, y)}`` to ``path`` atomically, if they pass
    :func:`check_splits`.

    ``check_values`` (ingest sets it) also checks the values; off by default, as
    tests write bad values on purpose to see training refuse them.  Messages name
    ``where`` (default: ``path``).  ``stats`` (``(mean, std)``, each of the sample
    shape) are stored as ``stats/mean`` and ``stats/std`` (float64), ``class_names``
    (one per class) as ``class_names``, ``feature_names`` (one per value of a sample) as ``feature_names``
    (UTF-8 strings).
    """
    path = Path(path)
    check_splits(splits, num_classes, where or path, check_values)
    check_extras(splits, num_classes, where or path, stats, class_names, feature_names)

    def fill(aside):
        with new_hdf5.created(aside) as handle:
            handle.attrs["name"] = name
            handle.attrs["num_classes"] = int(num_classes)
            handle.attrs["source"] = source
            for split, (x, y) in splits.items():
                group = handle.create_group(split)
                for key, value in (("x", x), ("y", y)):
                    value = np.asarray(value)
                    group.create_dataset(
                        key,
                        data=value,
                        chunks=writer.chunks_for(value.shape, value.itemsize),
                        **(writer.filters(compression) if len(value) else {}),
                    )
            for key, value in zip(("mean", "std"), stats if stats is not None else ()):
                handle.create_dataset(f"stats/{key}", data=np.asarray(value, np.float64))
            for key, names in (("class_names", class_names), ("feature_names", feature_names)):
                if names is not None:
                    handle.create_dataset(key, data=list(names), dtype=h5py.string_dtype())

    with claimed(path, "the dataset") as claim:
        claim.write(fill)
    return path


def check_splits(splits, num_classes, where, check_values=True):
    """Refuse splits ``train`` would refuse: the layout, non-empty splits and, with ``check_values``, the
    values."""
    if num_classes < 0 or num_classes == 1 or num_classes > MAX_CLASSES:
        raise UsageError(
            f"{where}: num_classes = {num_classes}; use 0 for regression or 2 to {MAX_CLASSES:,} classes"
        )
    if sorted(set(splits) - {"val"}) != ["test", "train"]:
        raise UsageError(f"{where}: needs the splits train and test (and val, if any), got {sorted(splits)}")
    for split, (x, y) in splits.items():
        x, y = np.asarray(x), np.asarray(y)
        as_numbers(where, f"{split}/x", x)
        as_numbers(where, f"{split}/y", y)
        check_samples(where, f"{split}/x", x, need=1)
        check_targets(where, f"{split}/x", len(x), f"{split}/y", y)
        if num_classes > 0 and y.dtype.kind not in "biu":
            raise UsageError(
                f"{where}: {split}/y must be integer class labels for num_classes = {num_classes}, "
                f"(N,) or (N, L) for one per position, got shape {y.shape} dtype {y.dtype}"
            )
        if check_values:
            check_floats(where, f"{split}/x", x)
            check_floats(where, f"{split}/y", y)
            outside = np.flatnonzero((y < 0) | (y >= num_classes)) if num_classes > 0 else ()
            if len(outside):
                at = np.unravel_index(int(outside[0]), y.shape)
                raise UsageError(
                    f"{where}: {split}/y[{', '.join(map(str, at))}] is {y[at]}, outside [0, {num_classes})"
                )
    xa, ya = splits["train"]
    for other in sorted(set(splits) - {"train"}):
        xb, yb = splits[other]
        if np.shape(xa)[1:] != np.shape(xb)[1:] or np.shape(ya)[1:] != np.shape(yb)[1:]:
            raise UsageError(
                f"{where}: train and {other} differ in shape: x {np.shape(xa)} and {np.shape(xb)}, "
                f"y {np.shape(ya)} and {np.shape(yb)}"
            )


def check_extras(splits, num_classes, where, stats=None, class_names=None, feature_names=None):
    """Refuse standardisation statistics, class and feature names that :func:`mpidist.data.inspect` would
    refuse."""
    shape = tuple(np.shape(splits["train"][0])[1:])
    for key, value in zip(("mean", "std"), stats if stats is not None else ()):
        value = np.asarray(value, np.float64)
        if value.shape != shape:
            raise UsageError(
                f"{where}: stats/{key} has shape {value.shape}; it must be the sample shape {shape}"
            )
        if not np.isfinite(value).all() or (key == "std" and not (value > 0).all()):
            raise UsageError(
                f"{where}: stats/{key} must be finite" + (" and greater than 0" if key == "std" else "")
            )
    if class_names is not None:
        if len(class_names) != num_classes:
            raise UsageError(f"{where}: {len(class_names)} class names for num_classes = {num_classes}")
        _check_names(where, class_names, "class")
    if feature_names is not None:
        if len(shape) != 1 or len(feature_names) != shape[0]:
            raise UsageError(f"{where}: {len(feature_names)} feature names for samples of shape {shape}")
        _check_names(where, feature_names, "feature")


def _check_names(where, names, what):
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
            raise UsageError(
                f"{where}: {what} name {index} is {printable(repr(name))}: a {what} name is text of 1 "
                f"to {MAX_NAME} characters"
            )
    if len(set(names)) != len(names):
        raise UsageError(f"{where}: the {what} names repeat a name; every {what} needs a name of its own")


def train_stats(x):
    """``(mean, std)`` per feature of the training samples ``x`` (numpy's, float64); a constant feature's std
    is 1."""
    x = np.asarray(x, np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[(std == 0) | (x == x[:1]).all(axis=0)] = 1.0  # constant: the mean's rounding can leave a std of 1e-17
    return mean, std


def check_samples(where, key, x, need):
    """Samples first, at least one feature (a 1-D ``x`` is refused, not guessed at), at least ``need`` of
    them."""
    if x.ndim < 2 or 0 in x.shape[1:]:
        raise UsageError(
            f"{where}: {key} has shape {x.shape}; it needs samples first and at least one feature "
            "axis, shape (N, features...) (one feature per sample is (N, 1))"
        )
    if len(x) < need:
        raise UsageError(
            f"{where}: {key} has {len(x)} sample{'s' * (len(x) != 1)}; "
            + (
                "a train and a test split need at least 2"
                if need == 2
                else "train and test each need at least 1"
            )
        )


def check_targets(where, xkey, n, ykey, y):
    """One target per sample: ``(N,)`` labels, ``(N, L)`` labels per position, or ``(N, K)`` regression
    targets."""
    if y.ndim == 0 or len(y) != n:
        raise UsageError(
            f"{where}: {xkey} has {n} samples but {ykey} has {len(y) if y.ndim else 'one value'}"
        )
    if y.ndim > 2 or 0 in y.shape[1:]:
        raise UsageError(f"{where}: {ykey} has shape {y.shape}; targets are (N,) or (N, K) with K >= 1")


def check_floats(where, key, item):
    """Refuse NaN, Inf, and values that become Inf in float32 (the dtype training reads them in)."""
    if item.dtype.kind != "f" or not item.size:
        return
    if not np.isfinite(item).all():
        index = np.unravel_index(np.flatnonzero(~np.isfinite(item))[0], item.shape)
        raise UsageError(
            f"{where}: {key}[{', '.join(map(str, index))}] is {item[index]}; ingest needs finite numbers"
        )
    largest = float(np.abs(item).max())
    if largest > FLOAT32_MAX:
        raise UsageError(
            f"{where}: {key} has values up to {largest:.3g} in magnitude, beyond float32 "
            f"(max {FLOAT32_MAX:.3g}); scale the data"
        )


def as_numbers(where, key, item):
    """``item`` as a numeric array (bools become 0/1); text, dates and complex numbers are refused."""
    if item.dtype.kind not in "biuf":
        raise UsageError(
            f"{where}: {key} has dtype {item.dtype} ({KINDS.get(item.dtype.kind, 'not numbers')}); "
            "ingest needs numbers"
        )
    return item.astype(np.uint8) if item.dtype.kind == "b" else item
