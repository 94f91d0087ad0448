"""HDF5 datasets: layout, validation, per-worker shards, shuffling, prefetch.

Layout (contract): one HDF5 file with groups ``train/`` and ``test/``, each
holding ``x`` (samples first) and ``y`` (integer class labels, or float
targets); file attributes ``name``, ``num_classes`` (0 for regression) and
``source``.  Optional: ``stats/mean`` and ``stats/std`` (floats of the sample
shape: standardisation statistics, applied when samples are read, so ``x``
stays as stored), ``class_names`` (text, one per class) and a ``val/`` group
(the validation split, checked like the others).

Worker ``w`` of ``W`` reads only rows ``w, w+W, w+2W, ...`` of each split: a
strided shard, so every worker sees every class even when a file is stored
sorted by label.  Each epoch the worker shuffles its shard with a generator
seeded by ``(seed, epoch, worker)``: the order is reproducible, so a resumed
run continues exactly where it stopped.  The global batch ``B`` is split as
evenly as possible (the first ``B % W`` workers take one more sample); all
workers run the same number of steps per epoch, computed from sizes alone.
"""

import dataclasses
import math
import os
import queue
import sys
import threading
from pathlib import Path

import h5py
import numpy as np

from .arrays import ArrayData
from .errors import UsageError
from .memory import check_fits
from .text import printable, shown
from .whereabouts import here

SPLITS = ("train", "test")
OPTIONAL_SPLITS = ("val",)   # a validation split a file may hold (else --val-fraction carves one from train)
VAL_SEED = 0x7661            # mixed into --seed for the carving, so it is not the data order's stream
MAX_CLASSES = 2 ** 24   # more output units than any classifier here could train: a corrupt attribute
MAX_NAME = 200          # characters in a class name


def data_dirs():
    """Where bundled datasets are looked for, in order."""
    dirs = []
    if os.environ.get("MPIDIST_DATA_DIR"):
        dirs.append(Path(os.environ["MPIDIST_DATA_DIR"]))
    dirs.append(Path(__file__).resolve().parent.parent / "data")      # a checkout / editable install
    dirs.append(Path(sys.prefix) / "share" / "mpidist" / "data")      # a wheel install
    return dirs


def bundled_names():
    """Names of the bundled datasets that can be found."""
    return sorted({p.stem for d in data_dirs() if d.is_dir() for p in d.glob("*.h5")})


def resolve(spec):
    """An existing file path for ``--data``: a path, or a bundled dataset's name (arrays pass through)."""
    if isinstance(spec, ArrayData):
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.suffix == "" and os.sep not in spec:
        for directory in data_dirs():
            candidate = directory / f"{spec}.h5"
            if candidate.is_file():
                return candidate
        names = ", ".join(bundled_names()) or "none found"
        raise UsageError(f"--data {spec!r}: no such file, and no bundled dataset of that name (bundled: {names})")
    raise UsageError(f"--data {spec}: no such file")


@dataclasses.dataclass
class DatasetInfo:
    """What a dataset file declares, checked against the layout."""

    path: Path      # or the ArrayData given in Python
    name: str
    num_classes: int
    source: str
    sample_shape: tuple
    sizes: dict  # split -> number of samples
    target_width: int = 1
    #: standardisation statistics where the file has them (float64 arrays of the sample shape):
    #: :class:`Shard` returns ``(x - mean) / std``
    mean: object = dataclasses.field(default=None, repr=False, compare=False)
    std: object = dataclasses.field(default=None, repr=False, compare=False)
    #: one name per class, control characters escaped, where the file names them
    class_names: tuple = None
    #: splits carved out of another (``--val-fraction``): name -> (the file's split, its sorted row numbers)
    carved: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def rows_of(self, split):
        """``(the file's split, its row numbers or None for all)`` that make up ``split``."""
        return self.carved.get(split, (split, None))

    @property
    def outputs(self):
        """Model outputs: one per class, or the target width for regression."""
        return self.num_classes if self.num_classes > 0 else self.target_width


def carve_validation(info, fraction, seed):
    """``info`` with a ``val`` split of ``ceil(fraction x train)`` rows carved from ``train``, chosen by ``seed``.

    The rows are drawn without replacement from a generator seeded by
    ``(seed, VAL_SEED)``: the same split on every rank and in every resumed run
    with the same seed; ``train`` keeps the others.  Both keep file order.
    """
    n = info.sizes["train"]
    count = math.ceil(fraction * n)
    if "val" in info.sizes:
        raise UsageError(f"--val-fraction {fraction}: dataset {info.name!r} ({info.path}) has a val/ split of "
                         "its own, used for validation; drop --val-fraction")
    if not 0 < count < n:
        raise UsageError(f"--val-fraction {fraction} of the {n} training samples leaves "
                         f"{'no validation samples' if count == 0 else 'no training samples'}")
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng([seed, VAL_SEED]).choice(n, size=count, replace=False)] = True
    carved = {"train": ("train", np.flatnonzero(~chosen)), "val": ("train", np.flatnonzero(chosen))}
    sizes = dict(info.sizes, train=n - count, val=count)
    return dataclasses.replace(info, sizes=sizes, carved=carved)


def open_source(path):
    """An HDF5 file, or an :class:`~mpidist.arrays.ArrayData`'s image, open for reading."""
    return path.open() if isinstance(path, ArrayData) else h5py.File(path, "r")


def inspect(path, allow_external=False):
    """Open ``path``, check the layout, and describe it (reads no sample data).

    The file is untrusted: every item is checked before it is used (type,
    shape, dtype, range), links that leave the file (external links, virtual
    datasets) are refused unless ``allow_external`` (``--allow-external``),
    and a broken file gives one message naming the file and the item.
    """
    path = path if isinstance(path, ArrayData) else Path(path)
    with here().doing("io", f"reading dataset {path}"):
        try:
            handle = open_source(path)
        except OSError as err:
            raise UsageError(f"{path}: not a readable HDF5 file ({printable(err)})") from None
        with handle:
            try:
                return _describe(path, handle, allow_external)
            except (KeyError, RuntimeError, OSError, ValueError, TypeError) as err:   # links that loop, a
                raise UsageError(f"{path}: not a readable dataset ({printable(err)})") from None   # bad header


def _describe(path, handle, allow_external):
    items = {}
    splits = SPLITS + tuple(split for split in OPTIONAL_SPLITS if _present(handle, split))
    for split in splits:
        for key in ("x", "y"):
            items[split, key] = _item(path, handle, f"{split}/{key}", allow_external)
    num_classes = _num_classes(path, handle.attrs)
    sizes, shapes, widths = {}, set(), set()
    for split in splits:
        x, y = items[split, "x"], items[split, "y"]
        for key, item in (("x", x), ("y", y)):
            if item.dtype.kind not in "biuf":
                raise UsageError(f"{path}: {split}/{key} has dtype {item.dtype}; it must be numeric")
        if x.ndim < 2:
            raise UsageError(f"{path}: {split}/x has shape {x.shape}; it needs samples first and "
                             "at least one feature axis")
        if 0 in x.shape[1:]:
            raise UsageError(f"{path}: {split}/x has shape {x.shape}: samples of no features")
        if y.ndim == 0:
            raise UsageError(f"{path}: {split}/y is a single value; it needs one target per sample")
        if y.shape[0] != x.shape[0]:
            raise UsageError(f"{path}: {split}/x has {x.shape[0]} samples but {split}/y has {y.shape[0]}")
        if x.shape[0] == 0:
            raise UsageError(f"{path}: the {split} split is empty; training and evaluation need samples in "
                             "both (`python -m mpidist ingest --test-fraction` splits a source)")
        if num_classes > 0 and (y.ndim != 1 or y.dtype.kind not in "biu"):
            raise UsageError(f"{path}: {split}/y must be 1-D integer class labels for num_classes = "
                             f"{num_classes}, got shape {y.shape} dtype {y.dtype}")
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
    mean, std = _stats(path, handle, sample_shape, allow_external)
    return DatasetInfo(path=path, name=_text(handle.attrs.get("name"), path.stem), num_classes=num_classes,
                       source=_text(handle.attrs.get("source"), ""), sample_shape=sample_shape, sizes=sizes,
                       target_width=widths.pop(), mean=mean, std=std,
                       class_names=_class_names(path, handle, num_classes, allow_external))


def _present(handle, name):
    """Whether the file has a link ``name`` (a broken one counts: reading it names the problem)."""
    try:
        return handle.get(name, getlink=True) is not None
    except (KeyError, RuntimeError, OSError, ValueError, TypeError):
        return True


def _stats(path, handle, sample_shape, allow_external):
    """``(mean, std)``: float64 arrays of the sample shape, checked; ``(None, None)`` where the file has none."""
    if not _present(handle, "stats"):
        return None, None
    found = []
    for key in ("mean", "std"):
        name = f"stats/{key}"
        if not _present(handle, name):
            raise UsageError(f"{path}: has 'stats' but no dataset '{name}': standardisation statistics are "
                             f"stats/mean and stats/std, both of the sample shape {tuple(sample_shape)}")
        item = _item(path, handle, name, allow_external)
        if item.dtype.kind != "f":
            raise UsageError(f"{path}: {name} has dtype {item.dtype}; standardisation statistics must be floats")
        if tuple(item.shape) != tuple(sample_shape):
            raise UsageError(f"{path}: {name} has shape {tuple(item.shape)}; it must be the sample shape "
                             f"{tuple(sample_shape)}")
        value = np.asarray(item[()], dtype=np.float64)
        bad = ~np.isfinite(value) if key == "mean" else ~(np.isfinite(value) & (value > 0))
        if bad.any():
            index = np.unravel_index(int(np.flatnonzero(bad)[0]), value.shape)
            raise UsageError(f"{path}: {name}[{', '.join(map(str, index))}] is {value[index]}; " + (
                "standardisation statistics must be finite" if key == "mean" else
                "standard deviations must be finite and greater than 0 (ingest stores 1 for a constant feature)"))
        found.append(value)
    return tuple(found)


def _class_names(path, handle, num_classes, allow_external):
    """The ``class_names`` item as a tuple of printable strings, checked; None where the file has none."""
    if not _present(handle, "class_names"):
        return None
    item = _item(path, handle, "class_names", allow_external)
    if num_classes == 0:
        raise UsageError(f"{path}: has class_names but num_classes = 0 (regression): names need classes")
    if h5py.check_string_dtype(item.dtype) is None:
        raise UsageError(f"{path}: class_names has dtype {item.dtype}; it must hold text (UTF-8 strings)")
    if tuple(item.shape) != (num_classes,):
        raise UsageError(f"{path}: class_names has shape {tuple(item.shape)}; it needs one name per class, "
                         f"shape ({num_classes},)")
    try:
        values = item.asstr()[()]
    except UnicodeDecodeError:
        raise UsageError(f"{path}: class_names holds bytes that are not UTF-8 text") from None
    names, seen = [], {}
    for index, value in enumerate(values):
        name = str(value)
        if not name.strip():
            raise UsageError(f"{path}: class_names[{index}] is empty; every class needs a name")
        if len(name) > MAX_NAME:
            raise UsageError(f"{path}: class_names[{index}] is {len(name):,} characters long; a class name has "
                             f"at most {MAX_NAME}")
        if name in seen:
            raise UsageError(f"{path}: class_names[{index}] repeats class_names[{seen[name]}] "
                             f"({printable(repr(name))}); every class needs a name of its own")
        seen[name] = index
        names.append(printable(name))
    return tuple(names)


def _item(path, handle, name, allow_external):
    """The dataset ``name`` (``train/x``), checked to be one, and to live in this file unless allowed."""
    node, parts = handle, name.split("/")
    for depth, part in enumerate(parts):
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise UsageError(f"{path}: missing dataset '{name}' (the layout needs train/x, train/y, test/x, "
                             "test/y; `python -m mpidist ingest` writes it)")
        if isinstance(link, h5py.ExternalLink) and not allow_external:
            raise UsageError(f"{path}: '{'/'.join(parts[:depth + 1])}' is an external link to "
                             f"{printable(link.filename)!r}: refused, as it reads another file "
                             "(--allow-external follows such links)")
        try:
            node = node[part]
        except (KeyError, RuntimeError, OSError, ValueError) as err:   # a soft link that loops or dangles
            raise UsageError(f"{path}: '{'/'.join(parts[:depth + 1])}' cannot be read ({printable(err)})") from None
    if not isinstance(node, h5py.Dataset):
        raise UsageError(f"{path}: '{name}' is not a dataset (the layout needs train/x, train/y, test/x, test/y)")
    if node.is_virtual and not allow_external:
        raise UsageError(f"{path}: '{name}' is a virtual dataset, which reads other files: refused "
                         "(--allow-external allows it)")
    return node


def _num_classes(path, attrs):
    """The ``num_classes`` attribute, checked: an integer, 0 (regression) or 2 to MAX_CLASSES."""
    if "num_classes" not in attrs:
        raise UsageError(f"{path}: missing file attribute 'num_classes' (0 for regression)")
    value = attrs["num_classes"]
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(())[()]
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if isinstance(value, (float, np.floating)) and np.isfinite(value) and float(value).is_integer():
        integral, value = True, int(value)
    if not integral:
        raise UsageError(f"{path}: num_classes = {shown(value)} is not an integer (0 for regression, "
                         "or the number of classes)")
    value = int(value)
    if value < 0 or value == 1 or value > MAX_CLASSES:
        raise UsageError(f"{path}: num_classes = {value}; use 0 for regression or 2 to {MAX_CLASSES:,} classes")
    return value


def _text(value, default):
    """An attribute shown to users: text with control characters escaped."""
    if value is None:
        return default
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return printable(value)


def shard_size(n, num_workers, worker):
    """Rows ``worker, worker + W, ...`` below ``n``."""
    return len(range(worker, n, num_workers))


def local_batch_size(global_batch, num_workers, worker):
    """This worker's part of the global batch (the first ``B % W`` take one more)."""
    return global_batch // num_workers + (1 if worker < global_batch % num_workers else 0)


def steps_per_epoch(n, global_batch, num_workers):
    """Steps every worker can take per epoch: the same on all, from sizes alone."""
    if global_batch < num_workers:
        raise UsageError(f"--batch-size {global_batch} is smaller than the number of workers ({num_workers}): "
                         "every worker needs at least one sample per step")
    return min(shard_size(n, num_workers, w) // local_batch_size(global_batch, num_workers, w)
               for w in range(num_workers))


class Shard:
    """One split's rows for one worker, read once and checked.

    Args:
        info: the dataset's :class:`DatasetInfo`.
        split: "train" or "test".
        worker, num_workers: this worker's index and the worker count.
        input_shape: per-sample shape the model is fed (may add a channel axis).
        dtype: floating dtype of the samples.
        rows: a slice of the split's rows to read in place of the strided shard (``predict``
            reads a contiguous block per rank); ``worker`` and ``num_workers`` are then unused.
    """

    def __init__(self, info, split, worker, num_workers, input_shape, dtype, rows=None):
        rows = slice(worker, None, num_workers) if rows is None else rows
        group, picked = info.rows_of(split)   # a carved split: rows of another one
        where = f"{info.path}: {group}"
        dtype = np.dtype(dtype)
        with open_source(info.path) as handle, here().doing("io", f"reading {where}"):
            x, y = handle[f"{group}/x"], handle[f"{group}/y"]
            numbers = (range(x.shape[0]) if picked is None else picked)[rows]   # the file's row numbers, for messages
            count = len(numbers)
            sample = int(np.prod(x.shape[1:]))
            # the file's row count decides the size: checked before anything is read
            check_fits(count * sample * (x.dtype.itemsize + dtype.itemsize + (8 if standardizer(info) else 0))
                       + count * 16,
                       f"{where} ({count:,} rows of {sample:,} values for this worker)")
            x, y = (x[rows], y[rows]) if picked is None else (_read_rows(x, numbers), _read_rows(y, numbers))
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = numbers[int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])]
            raise UsageError(f"{where}/x holds NaN or Inf (first at sample {bad})")
        if info.num_classes > 0:
            out = (y < 0) | (y >= info.num_classes)
            if out.any():
                bad = int(np.flatnonzero(out)[0])
                raise UsageError(f"{where}/y has label {int(y[bad])} at sample {numbers[bad]}, "
                                 f"outside [0, {info.num_classes}) (num_classes = {info.num_classes})")
            self.y = y.astype(np.int64)
        else:
            if y.dtype.kind == "f" and not np.isfinite(y).all():
                raise UsageError(f"{where}/y holds NaN or Inf")
            self.y = _converted(y, dtype, f"{where}/y").reshape(len(y), -1)
        transform = standardizer(info)
        if transform is not None:     # checked again: statistics that do not fit the data can give Inf
            x = transform(x)
            if not np.isfinite(x).all():
                bad = numbers[int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])]
                raise UsageError(f"{where}/x standardised with the file's stats/mean and stats/std holds Inf "
                                 f"(first at sample {bad}): the statistics do not fit the data")
        self.x = _converted(x, dtype, f"{where}/x" + (" (standardised)" if transform else "")).reshape(
            (len(x),) + tuple(input_shape))

    def __len__(self):
        return len(self.y)


def _read_rows(item, numbers, block_bytes=64 << 20):
    """Rows ``numbers`` (increasing) of the HDF5 dataset ``item``, read a block of the file (64 MiB) at a time."""
    out = np.empty((len(numbers),) + item.shape[1:], dtype=item.dtype)
    block = max(1, block_bytes // max(out[:1].nbytes, 1))
    done = 0
    for lo in range(0, item.shape[0], block):
        upto = int(np.searchsorted(numbers, lo + block))
        if upto > done:
            out[done:upto] = item[lo:min(lo + block, item.shape[0])][numbers[done:upto] - lo]
            done = upto
    return out


def standardizer(info):
    """What :class:`Shard` does to the samples of dataset ``info`` besides checking them, or None.

    For a file with standardisation statistics: a function of samples (any shape
    holding the sample's number of values per row) giving ``(x - mean) / std``
    in float64, shaped as given.
    """
    if getattr(info, "mean", None) is None:
        return None
    mean, std = info.mean.reshape(-1), info.std.reshape(-1)

    def standardize(x):
        x = np.asarray(x)
        with np.errstate(over="ignore", invalid="ignore"):     # an Inf made here is refused by the caller
            out = x.reshape(len(x), mean.size) - mean          # float64, as mean is
            out /= std
        return out.reshape(x.shape)

    return standardize


def _converted(array, dtype, where):
    """``array`` as ``dtype``, refused if finite values overflow it (1e300 is Inf in float32)."""
    converted = array.astype(dtype, copy=False)
    if converted is not array and not np.isfinite(converted).all():
        largest = float(np.max(np.abs(array)))
        raise UsageError(f"{where} holds values up to {largest:.3g}, beyond the range of --dtype {dtype} "
                         "(they would become Inf): scale the data, or train with --dtype float64")
    return converted


class Prefetcher:
    """Iterate ``source`` in a background thread, ``depth`` items ahead.

    An exception in the thread is re-raised in the consumer; :meth:`close`
    stops the thread early (e.g. when ``--steps`` ends an epoch midway).
    """

    _END = object()

    def __init__(self, source, depth=2):
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(source),), daemon=True, name="mpidist-prefetch")
        self._thread.start()

    def _run(self, iterator):
        try:
            for item in iterator:
                if self._stop.is_set():
                    return
                self._put(item)
        except BaseException as err:  # handed to the consumer, which raises it with its traceback
            self._put(err)
            return
        self._put(self._END)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self._stop.set()
        self._thread.join()


def epoch_order(shard_len, seed, epoch, worker):
    """This worker's sample order for ``epoch``: reproducible from the seed."""
    return np.random.default_rng([seed, epoch, worker]).permutation(shard_len)


def train_batches(shard, local_batch, steps, seed, epoch, worker, skip=0):
    """The ``(x, y)`` batches of one epoch from step ``skip`` on, prefetched."""
    order = epoch_order(len(shard), seed, epoch, worker)

    def batches():
        for step in range(skip, steps):
            index = order[step * local_batch:(step + 1) * local_batch]
            yield shard.x[index], shard.y[index]

    return Prefetcher(batches())


def global_batches(split, global_batch, steps, seed, epoch, skip=0):
    """In-graph replication, on the chief: whole global batches of one epoch, prefetched.

    The order is the one a single process would use (``worker`` 0 of 1), so
    in-graph training on any number of workers sees the same global batches.
    """
    order = epoch_order(len(split), seed, epoch, 0)

    def batches():
        for step in range(skip, steps):
            index = order[step * global_batch:(step + 1) * global_batch]
            yield split.x[index], split.y[index]

    return Prefetcher(batches())


class ScatteredBatches:
    """In-graph replication: the chief's global batches, cut and sent to each worker.

    Every worker iterates this; the chief (worker 0 of ``comm``) reads, the
    others only receive (one ``Scatterv`` for samples, one for targets).
    """

    def __init__(self, comm, source, global_batch, sample_shape, y_shape, x_dtype, y_dtype, steps):
        from . import comm as mpi
        self._mpi, self.comm, self.source, self.steps = mpi, comm, source, steps
        workers, worker = comm.Get_size(), comm.Get_rank()
        sizes = [local_batch_size(global_batch, workers, w) for w in range(workers)]
        starts = np.cumsum([0] + sizes[:-1])
        x_each, y_each = int(np.prod(sample_shape)), int(np.prod(y_shape))
        self.x_counts, self.x_displs = [s * x_each for s in sizes], [int(o) * x_each for o in starts]
        self.y_counts, self.y_displs = [s * y_each for s in sizes], [int(o) * y_each for o in starts]
        self.x = np.empty((sizes[worker],) + tuple(sample_shape), dtype=x_dtype)
        self.y = np.empty((sizes[worker],) + tuple(y_shape), dtype=y_dtype)

    def __iter__(self):
        for _ in range(self.steps):
            gx = gy = None
            if self.source is not None:
                gx, gy = next(self.source)
                gx, gy = np.ascontiguousarray(gx, self.x.dtype), np.ascontiguousarray(gy, self.y.dtype)
            self._mpi.scatterv(self.comm, gx, self.x, self.x_counts, self.x_displs, root=0)
            self._mpi.scatterv(self.comm, gy, self.y, self.y_counts, self.y_displs, root=0)
            yield self.x, self.y

    def close(self):
        if self.source is not None:
            self.source.close()


def eval_batches(shard, size=1024):
    """The whole shard in order, in chunks of ``size``."""
    for lo in range(0, len(shard), size):
        yield shard.x[lo:lo + size], shard.y[lo:lo + size]
