"""Rows cut into train and test splits, and labels read as classes, class names or regression targets.

What ``ingest`` decides about a source's rows whatever file they came from:
the seeded shuffle and the test split (never all rows, never none), whether
the labels make a classification (non-negative integers) or a regression
(``--task`` may say), and the classes of labels given as text (the sorted
distinct names are classes 0 to K-1).  Each refusal names the file, the item
and the value.
"""

import numpy as np

from ..data import MAX_CLASSES, MAX_NAME
from ..runtime.errors import UsageError
from ..runtime.text import printable
from .dataset_file import check_floats, check_samples

EXACT_INTEGERS = 2.0**53  # floats beyond this are not exact integers: never read them as labels
TEST_FRACTION = 0.2  # ingest's test split, where neither the source nor --test-fraction gives one


def check_test_fraction(test_fraction):
    """Refuse a test fraction that would cut no rows, or all of them, off as the test split."""
    if not 0.0 < test_fraction < 1.0:
        raise UsageError(f"--test-fraction must be between 0 and 1, got {test_fraction}")


def split_train_test(x, y, test_fraction, seed):
    """Shuffle with ``seed`` and cut off the last ``test_fraction`` as the test split (never all, never
    none)."""
    check_test_fraction(test_fraction)
    check_samples("ingest", "x", x, need=2)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = min(len(x) - 1, max(1, int(round(len(x) * test_fraction))))
    train, test = order[:-n_test], order[-n_test:]
    return {"train": (x[train], y[train]), "test": (x[test], y[test])}


def shuffled(x, y, seed):
    """Rows in a seeded random order (files sorted by label would bias shards)."""
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], y[order]


#: Above this many classes, whole-number labels with fewer than 2 rows a class are as likely quantities (ages,
#: prices, counts): ``--task auto`` asks which rather than guess
AMBIGUOUS_CLASSES = 20


def infer_task(y, task, where="ingest", key="y"):
    """``(y, num_classes)``: integer labels for classification, float32 targets for regression."""
    integral = y.dtype.kind in "iu" or (
        y.ndim == 1 and np.all(np.mod(y, 1) == 0) and np.abs(y).max() <= EXACT_INTEGERS
    )
    labels = integral and y.ndim == 1 and y.min() >= 0
    if task == "auto":
        task = "classification" if labels else "regression"
        classes = int(y.max()) + 1 if labels else 0
        if classes > AMBIGUOUS_CLASSES and classes > len(y) / 2:
            raise UsageError(
                f"{where}: {key} holds whole numbers from {y.min()} to {y.max()}: as classes, "
                f"{classes} of them for {len(y):,} rows (fewer than 2 rows a class); if they "
                "are quantities to predict, pass --task regression, if classes, --task classification"
            )
    if task == "regression":
        check_floats(where, key, y)
        return y.astype(np.float32), 0
    if not labels:
        found = (
            f"shape {y.shape}"
            if y.ndim != 1
            else f"{y.min()}"
            if integral
            else f"{y[np.flatnonzero(np.mod(y, 1) != 0)[0]]}"
        )
        raise UsageError(
            f"{where}: --task classification needs one column of non-negative integer labels; "
            f"{key} has {found}"
        )
    if y.max() < 1 or y.max() >= MAX_CLASSES:  # num_classes would be 1, or more than train accepts
        raise UsageError(
            f"{where}: "
            + (
                f"every label in {key} is 0, so there is 1 class; training needs 2 or more"
                if y.max() < 1
                else f"{key} has labels up to {y.max()}: more than {MAX_CLASSES:,} classes"
            )
            + " (or pass --task regression)"
        )
    return y.astype(np.int64), int(y.max()) + 1


def as_text(where, key, y):
    """Labels given as bytes or text, as text (bytes must be UTF-8)."""
    if y.dtype.kind == "S":
        try:
            return np.char.decode(y, "utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{where}: {key} holds bytes that are not UTF-8 text") from None
    return y


def name_classes(y, task, where="ingest", key="y"):
    """``(y, num_classes, class_names)`` of text labels: the sorted distinct names are classes 0 to K-1."""
    y = as_text(where, key, y)
    if task == "regression":
        raise UsageError(
            f"{where}: {key} holds text (class names such as {printable(repr(str(y.flat[0])), 60)}); "
            "--task regression needs numbers"
        )
    if y.ndim != 1:
        raise UsageError(
            f"{where}: {key} has shape {y.shape}; text labels are one class name per sample, shape (N,)"
        )
    empty = np.flatnonzero(np.char.str_len(np.char.strip(y)) == 0)
    if len(empty):
        raise UsageError(f"{where}: {key}[{empty[0]}] is empty; every sample needs a class name")
    names, codes = np.unique(y, return_inverse=True)
    return (codes.reshape(-1).astype(np.int64),) + checked_names(where, key, [str(name) for name in names])


def checked_names(where, key, names):
    """``(num_classes, names)`` for the sorted distinct class ``names`` found in ``key``, refused if training
    would."""
    if len(names) < 2:
        raise UsageError(
            f"{where}: every label in {key} is {printable(repr(names[0]), 60)}, so there is 1 class; "
            "training needs 2 or more"
        )
    if len(names) > MAX_CLASSES:
        raise UsageError(
            f"{where}: {key} holds {len(names):,} distinct names: more than {MAX_CLASSES:,} classes"
        )
    for name in names:
        if len(name) > MAX_NAME:
            raise UsageError(
                f"{where}: {key} holds a class name of {len(name):,} characters "
                f"({printable(repr(name), 60)}); a class name has at most {MAX_NAME}"
            )
    return len(names), tuple(names)


def labels_of(y, task, where="ingest", key="y"):
    """``(y, num_classes, class_names)``: class names where ``y`` holds text, else as :func:`infer_task`
    says."""
    if y.dtype.kind in "US":
        return name_classes(y, task, where, key)
    return infer_task(y, task, where, key) + (None,)
