"""The dataset layout: what a file (or a directory of files) must hold, checked before anything is read.

Layout (contract): one HDF5 file with groups ``train/`` and ``test/``, each
holding ``x`` (samples first) and ``y`` (integer class labels, or float
targets; class labels may have a sequence axis, ``(N, L)``: one label per
position, for models that classify every position); file attributes ``name``, ``num_classes`` (0 for regression) and
``source``.  Optional: ``stats/mean`` and ``stats/std`` (floats of the sample
shape: standardisation statistics, applied when samples are read, so ``x``
stays as stored), ``class_names`` (text, one per class), ``feature_names``
(text, one per value of a sample of one axis: a CSV header's) and a ``val/``
group (the validation split, checked like the others).

A dataset may also be a directory (or a glob) of such files, taken in natural
name order (``part-2`` before ``part-10``): each split's rows are the
concatenation of that split's rows over the files.  The files must agree on
everything but their rows (attributes, sample shape, statistics, class
names); a file may hold no rows of a split, the dataset as a whole may not.
"""

import dataclasses
import glob
import math
import os
import re
import sys
from pathlib import Path

import h5py
import numpy as np

from ..runtime.errors import UsageError
from ..runtime.text import printable, shown
from ..runtime.whereabouts import here
from ..store.outputs import is_regular_file, special_kind
from .arrays import ArrayData

SPLITS = ("train", "test")
OPTIONAL_SPLITS = ("val",)  # a validation split a file may hold (else --val-fraction carves one from train)
VAL_SEED = 0x7661  # mixed into --seed for the carving, so it is not the data order's stream
MAX_CLASSES = 2**24  # more output units than any classifier here could train: a corrupt attribute
MAX_NAME = 200  # characters in a class name
MAX_FILES = 100_000  # files in one dataset: more is a wrong directory, and each is opened by every rank
SUFFIXES = (".h5", ".hdf5")
CHUNK_CACHE = 1 << 20  # HDF5's own chunk cache per dataset


def data_dirs():
    """Where bundled datasets are looked for, in order."""
    dirs = []
    if os.environ.get("MPIDIST_DATA_DIR"):
        dirs.append(Path(os.environ["MPIDIST_DATA_DIR"]))
    dirs.append(Path(__file__).resolve().parent.parent.parent / "data")  # a checkout / editable install
    dirs.append(Path(sys.prefix) / "share" / "mpidist" / "data")  # a wheel install
    return dirs


def bundled_names():
    """Names of the bundled datasets that can be found."""
    return sorted({p.stem for d in data_dirs() if d.is_dir() for p in d.glob("*.h5")})


def resolve(spec):
    """What ``--data`` names: a file, a directory or a glob of files, or a bundled dataset (arrays pass through)."""
    if isinstance(spec, ArrayData):
        return spec
    path = Path(spec).expanduser()
    if path.is_file() or path.is_dir():
        return path
    if glob.has_magic(str(spec)):
        return Path(os.path.expanduser(spec))  # expanded by members(): it must match files
    if path.suffix == "" and os.sep not in spec:
        for directory in data_dirs():
            candidate = directory / f"{spec}.h5"
            if candidate.is_file():
                return candidate
        names = ", ".join(bundled_names()) or "none found"
        raise UsageError(
            f"--data {spec!r}: no such file, and no bundled dataset of that name (bundled: {names})"
        )
    raise UsageError(f"--data {spec}: no such file")


def _natural(path):
    """Sort key: digits compare as numbers (``part-2`` before ``part-10``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", path.name)]


def members(path):
    """The files of dataset ``path`` in order: itself, a directory's ``*.h5``/``*.hdf5`` files, or a glob's matches."""
    if isinstance(path, ArrayData) or path.is_file():
        return [path]
    if path.is_dir():
        found = [p for p in path.iterdir() if p.suffix.lower() in SUFFIXES and not p.name.startswith(".")]
        what = f"{path}: a directory with no .h5 or .hdf5 files"
        odd = next((p for p in found if not is_regular_file(p)), None)
        if (
            odd is not None
        ):  # (refused, not passed over: training on fewer parts than given is silently wrong)
            raise UsageError(
                f"{path}: {odd.name} is {special_kind(odd) or 'a directory'}, not a file; the .h5 and "
                ".hdf5 files of a dataset directory are its parts, and opening it could wait forever"
            )
    else:
        found = [Path(p) for p in glob.glob(str(path)) if os.path.isfile(p)]
        what = f"--data {path}: matches no files"
    if not found:
        raise UsageError(what)
    if len(found) > MAX_FILES:
        raise UsageError(f"{path}: {len(found):,} files, more than one dataset may have ({MAX_FILES:,})")
    return sorted(found, key=_natural)


@dataclasses.dataclass(frozen=True)
class Member:
    """One file of a dataset: its rows per split, and how its ``x`` is stored (for reads aligned to its chunks)."""

    path: object  # a Path, or the ArrayData given in Python
    sizes: dict  # split -> rows in this file
    chunk_rows: dict  # split -> rows per HDF5 chunk of x (1 where x is not chunked)
    row_bytes: dict  # split -> bytes of one sample of x as stored
    #: split -> (x, y): bytes HDF5 decompresses to read any row of a compressed chunk (a chunk's rows, all
    #: their values), 0 where the item is not compressed
    spans: dict = dataclasses.field(default_factory=dict)

    def span(self, group):
        """Bytes of the larger of ``group``'s x and y decompressed chunk spans (0: neither is compressed)."""
        return max(self.spans.get(group, (0, 0)))

    def cache_bytes(self, group):
        """Bytes reading ``group`` holds for compressed chunks larger than HDF5's cache (0: none): a chunk span of
        x and of y decompressed, and the compressed one being read (as large, for data that does not compress)."""
        spans = self.spans.get(group, (0, 0))
        return sum(spans) + max(spans) if max(spans) > CHUNK_CACHE else 0


@dataclasses.dataclass
class DatasetInfo:
    """What a dataset file declares, checked against the layout."""

    path: Path  # or the ArrayData given in Python
    name: str
    num_classes: int
    source: str
    sample_shape: tuple
    sizes: dict  # split -> number of samples
    #: values of ``y`` per sample: regression targets, or class labels (``L`` for labels ``(N, L)``, one per position)
    target_width: int = 1
    #: standardisation statistics where the file has them (float64 arrays of the sample shape):
    #: :class:`Shard` returns ``(x - mean) / std``
    mean: object = dataclasses.field(default=None, repr=False, compare=False)
    std: object = dataclasses.field(default=None, repr=False, compare=False)
    #: one name per class, control characters escaped, where the file names them
    class_names: tuple = None
    feature_names: tuple = None  # a CSV header's names of a sample's values, where ingest stored them
    #: splits carved out of another (``--val-fraction``): name -> (the file's split, its sorted row numbers)
    carved: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: the files, in order (one for a single file): a split's rows are theirs, concatenated
    files: tuple = dataclasses.field(default=(), repr=False, compare=False)
    #: a split that ``--eval-samples`` limited: name -> the rows it has without the limit
    limited: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def rows_of(self, split):
        """``(the file's split, its row numbers or None for all)`` that make up ``split``."""
        return self.carved.get(split, (split, None))

    @property
    def target_shape(self):
        """One sample's ``y`` as read: ``()`` for a class label, ``(L,)`` for one per position, ``(W,)`` for targets."""
        return () if self.num_classes > 0 and self.target_width == 1 else (self.target_width,)

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
        raise UsageError(
            f"--val-fraction {fraction}: dataset {info.name!r} ({info.path}) has a val/ split of "
            "its own, used for validation; drop --val-fraction"
        )
    if not 0 < count < n:
        raise UsageError(
            f"--val-fraction {fraction} of the {n} training samples leaves "
            f"{'no validation samples' if count == 0 else 'no training samples'}"
        )
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng([seed, VAL_SEED]).choice(n, size=count, replace=False)] = True
    carved = {"train": ("train", np.flatnonzero(~chosen)), "val": ("train", np.flatnonzero(chosen))}
    sizes = dict(info.sizes, train=n - count, val=count)
    return dataclasses.replace(info, sizes=sizes, carved=carved)


def limit_evaluation(info, samples, splits=("test", "val")):
    """``info`` with each of ``splits`` longer than ``samples`` rows cut to ``samples`` evenly spread ones.

    Rows ``0, s, 2s, ...`` with ``s = rows // samples``: the same subset every
    time (it depends on nothing but the split's length), spread over the whole
    split (a file sorted by class keeps every class), and one evenly strided
    read per file.  A split carved by ``--val-fraction`` is cut among its own rows.
    """
    carved, sizes, limited = dict(info.carved), dict(info.sizes), dict(info.limited)
    for split in splits:
        rows = sizes.get(split, 0)
        if not samples or rows <= samples:
            continue
        group, picked = info.rows_of(split)
        every = np.arange(samples, dtype=np.int64) * (rows // samples)
        carved[split] = (group, every if picked is None else picked[every])
        sizes[split], limited[split] = samples, limited.get(split, rows)
    return dataclasses.replace(info, sizes=sizes, carved=carved, limited=limited)


def open_source(path, cache=0):
    """An HDF5 file, or an :class:`~mpidist.data.arrays.ArrayData`'s image, open for reading.

    ``cache``: bytes of a compressed chunk span reads must not decompress again and again (reading part of a
    compressed chunk decompresses all of it): each dataset's chunk cache holds one, where HDF5's is smaller.
    """
    if isinstance(path, ArrayData):
        return path.open()
    if cache > CHUNK_CACHE:
        return h5py.File(path, "r", rdcc_nbytes=cache + CHUNK_CACHE)
    return h5py.File(path, "r")


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


def _inspect_file(path, allow_external, part):
    with here().doing("io", f"reading dataset {path}"):
        try:
            handle = open_source(path)
        except OSError as err:
            raise UsageError(f"{path}: not a readable HDF5 file ({printable(err)})") from None
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
    mean, std = _stats(path, handle, sample_shape, allow_external)
    member = Member(
        path,
        sizes,
        chunk_rows={s: int(items[s, "x"].chunks[0]) if items[s, "x"].chunks else 1 for s in splits},
        row_bytes={s: int(np.prod(sample_shape)) * items[s, "x"].dtype.itemsize for s in splits},
        spans={s: (_span(items[s, "x"]), _span(items[s, "y"])) for s in splits},
    )
    return DatasetInfo(
        path=path,
        name=_text(handle.attrs.get("name"), path.stem),
        num_classes=num_classes,
        source=_text(handle.attrs.get("source"), ""),
        sample_shape=sample_shape,
        sizes=sizes,
        target_width=widths.pop(),
        mean=mean,
        std=std,
        class_names=_class_names(path, handle, num_classes, allow_external),
        feature_names=_feature_names(path, handle, sample_shape, allow_external),
        files=(member,),
    )


def _span(item):
    """Bytes HDF5 decompresses to read any row of a chunk of ``item``: its chunk rows' values; 0 if not filtered."""
    if item.chunks is None or not item.id.get_create_plist().get_nfilters():
        return 0
    return int(item.chunks[0]) * item.dtype.itemsize * int(np.prod(item.shape[1:], dtype=np.int64))


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
            raise UsageError(
                f"{path}: has 'stats' but no dataset '{name}': standardisation statistics are "
                f"stats/mean and stats/std, both of the sample shape {tuple(sample_shape)}"
            )
        item = _item(path, handle, name, allow_external)
        if item.dtype.kind != "f":
            raise UsageError(
                f"{path}: {name} has dtype {item.dtype}; standardisation statistics must be floats"
            )
        if tuple(item.shape) != tuple(sample_shape):
            raise UsageError(
                f"{path}: {name} has shape {tuple(item.shape)}; it must be the sample shape "
                f"{tuple(sample_shape)}"
            )
        value = np.asarray(item[()], dtype=np.float64)
        bad = ~np.isfinite(value) if key == "mean" else ~(np.isfinite(value) & (value > 0))
        if bad.any():
            index = np.unravel_index(int(np.flatnonzero(bad)[0]), value.shape)
            raise UsageError(
                f"{path}: {name}[{', '.join(map(str, index))}] is {value[index]}; "
                + (
                    "standardisation statistics must be finite"
                    if key == "mean"
                    else "standard deviations must be finite and greater than 0 (ingest stores 1 for a "
                    "constant feature)"
                )
            )
        found.append(value)
    return tuple(found)


def _class_names(path, handle, num_classes, allow_external):
    """The ``class_names`` item as a tuple of printable strings, checked; None where the file has none."""
    if _present(handle, "class_names") and num_classes == 0:
        raise UsageError(f"{path}: has class_names but num_classes = 0 (regression): names need classes")
    return _names(path, handle, "class_names", num_classes, "class", allow_external)


def _feature_names(path, handle, sample_shape, allow_external):
    """The ``feature_names`` item (a CSV header's names of a sample's values), checked; None where there is none."""
    if _present(handle, "feature_names") and len(sample_shape) != 1:
        raise UsageError(
            f"{path}: has feature_names but its samples have shape {sample_shape}: names are for "
            "samples of one axis"
        )
    return _names(
        path, handle, "feature_names", sample_shape[0] if sample_shape else 0, "feature", allow_external
    )


def _names(path, handle, key, count, what, allow_external):
    """Item ``key``: ``count`` distinct, non-empty, bounded UTF-8 names, as printable strings; None where absent."""
    if not _present(handle, key):
        return None
    item = _item(path, handle, key, allow_external)
    if h5py.check_string_dtype(item.dtype) is None:
        raise UsageError(f"{path}: {key} has dtype {item.dtype}; it must hold text (UTF-8 strings)")
    if tuple(item.shape) != (count,):
        raise UsageError(
            f"{path}: {key} has shape {tuple(item.shape)}; it needs one name per {what}, shape ({count},)"
        )
    try:
        values = item.asstr()[()]
    except UnicodeDecodeError:
        raise UsageError(f"{path}: {key} holds bytes that are not UTF-8 text") from None
    names, seen = [], {}
    for index, value in enumerate(values):
        name = str(value)
        if not name.strip():
            raise UsageError(f"{path}: {key}[{index}] is empty; every {what} needs a name")
        if len(name) > MAX_NAME:
            raise UsageError(
                f"{path}: {key}[{index}] is {len(name):,} characters long; a {what} name has "
                f"at most {MAX_NAME}"
            )
        if name in seen:
            raise UsageError(
                f"{path}: {key}[{index}] repeats {key}[{seen[name]}] "
                f"({printable(repr(name))}); every {what} needs a name of its own"
            )
        seen[name] = index
        names.append(printable(name))
    return tuple(names)


def _item(path, handle, name, allow_external):
    """The dataset ``name`` (``train/x``), checked to be one, and to live in this file unless allowed."""
    node, parts = handle, name.split("/")
    for depth, part in enumerate(parts):
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise UsageError(
                f"{path}: missing dataset '{name}' (the layout needs train/x, train/y, test/x, "
                "test/y; `python -m mpidist ingest` writes it)"
            )
        if isinstance(link, h5py.ExternalLink) and not allow_external:
            raise UsageError(
                f"{path}: '{'/'.join(parts[: depth + 1])}' is an external link to "
                f"{printable(link.filename)!r}: refused, as it reads another file "
                "(--allow-external follows such links)"
            )
        try:
            node = node[part]
        except (KeyError, RuntimeError, OSError, ValueError) as err:  # a soft link that loops or dangles
            raise UsageError(
                f"{path}: '{'/'.join(parts[: depth + 1])}' cannot be read ({printable(err)})"
            ) from None
    if not isinstance(node, h5py.Dataset):
        raise UsageError(
            f"{path}: '{name}' is not a dataset (the layout needs train/x, train/y, test/x, test/y)"
        )
    if node.is_virtual and not allow_external:
        raise UsageError(
            f"{path}: '{name}' is a virtual dataset, which reads other files: refused "
            "(--allow-external allows it)"
        )
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
