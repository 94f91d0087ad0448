"""What ``predict`` reads: a split of a dataset, or plain samples, checked as they are read by blocks of rows.

* a split of a dataset in the mpidist layout, one file or a directory (or a
  glob) of files as ``train`` reads them (``test`` by default; ``train``,
  or ``val`` where the file has one, or where the run carved one with
  ``--val-fraction``), read through :class:`mpidist.data.Shard`, so samples are
  checked and transformed exactly as training and ``eval`` read them; the model
  is built for that dataset, as ``eval`` builds it;
* plain samples: an HDF5 file with a dataset ``x``, a ``.npy`` array, an
  ``.npz`` file with an array ``x`` (both read with ``allow_pickle=False``:
  a file never runs code), a CSV file (parsed as ``ingest`` parses one; which
  columns are the model's features is :mod:`mpidist.tools.csv_columns`'), or,
  in Python, a numpy array (the same on every rank).  Plain samples say
  nothing of the task, so the model is built for the dataset the checkpoint
  trained on (its settings' ``data``), which must be
  readable; the samples must have its sample shape, and are fed as stored
  (standardised with that dataset's statistics where it has them, as Shard does).
  Each rank reads only its rows of an HDF5 or ``.npy`` file; an ``.npz``
  member is compressed whole, so every rank reads all of it.

Everything read is untrusted: dtypes must be numeric, shapes must fit the
model, values finite and within the model's dtype, sizes within the memory
free (:func:`mpidist.runtime.memory.check_fits`) before anything is allocated.

A reader (:func:`reader_for`) learns which dataset the model is built for from
the checkpoint's settings (:meth:`DatasetSplit.dataset_for`, which
:func:`mpidist.api.load_trained` calls), then reads rows ``[lo, hi)``.
"""

import os
import tokenize
import zlib
from pathlib import Path

import h5py
import numpy as np

from .. import data as datasets
from ..data.fingerprint import recorded
from ..runtime.errors import UsageError
from ..runtime.memory import check_fits
from ..runtime.reads import HDF5_ERRORS, reading
from ..runtime.text import printable
from ..runtime.whereabouts import here
from ..store import contained
from .npy_rows import MemberRows, npy_header

SPLITS = datasets.SPLITS + datasets.OPTIONAL_SPLITS
#: what numpy raises reading a broken .npy or .npz: a compressed member that is not deflate data raises
#: zlib's error, a header cut in a bracket tokenize's (besides zipfile's BadZipFile, imported where used)
NUMPY_FILE_ERRORS = (OSError, ValueError, EOFError, zlib.error, tokenize.TokenError)
KINDS = {
    "U": "text",
    "S": "bytes",
    "O": "Python objects",
    "c": "complex numbers",
    "M": "dates",
    "m": "time spans",
    "V": "records",
}


def reader_for(data, split):
    """A :class:`DatasetSplit` of a dataset, or :class:`PlainSamples`, for ``data``.

    Args:
        data: a dataset (a path, a bundled name or an ArrayData), plain samples (an HDF5 file
            with a dataset ``x``, a ``.npy`` or ``.npz`` file, a numpy array), or None: the
            dataset the checkpoint trained on.
        split: ``"test"``, ``"train"`` or ``"val"``: the split of a dataset.
    """
    if split not in SPLITS:
        raise UsageError(f"split {split!r}: choose from {', '.join(SPLITS)}")
    if data is None or isinstance(data, datasets.ArrayData):
        return DatasetSplit(data, split, data)
    if isinstance(data, (np.ndarray, list, tuple)):
        return PlainSamples(ArraySamples(np.asarray(data)), split)
    if not isinstance(data, (str, os.PathLike)):
        raise UsageError(
            f"data: give a file, a bundled dataset's name, an ArrayData or a numpy array, not "
            f"{type(data).__name__}"
        )
    if os.fspath(data).lower().endswith(".csv"):
        return PlainSamples(CsvSamples(Path(os.fspath(data))), split)
    path = datasets.resolve(os.fspath(data))
    # a directory (or a glob) of files: a dataset in the mpidist layout, as train reads
    if not path.is_file():
        return DatasetSplit(path, split, data)
    if path.suffix.lower() in (".npy", ".npz"):
        return PlainSamples(NumpyFile(path), split)
    try:
        with h5py.File(path, "r") as handle:
            plain = "x" in handle and not any(name in handle for name in SPLITS)
    except (OSError, RuntimeError, ValueError) as err:
        raise UsageError(f"{path}: not a readable HDF5, .npy or .npz file ({printable(err)})") from None
    return PlainSamples(HDF5Samples(path), split) if plain else DatasetSplit(path, split, data)


class DatasetSplit:
    """A split of a dataset in the mpidist layout, read through :class:`mpidist.data.Shard`.

    Until :meth:`dataset_for` has told it which dataset, it knows only what was given.
    """

    notes = ()  # (read as training reads it: nothing to tell)

    def __init__(self, resolved, split, named):
        # resolved: a path or an ArrayData, or None for the dataset the checkpoint trained on;
        # named: what the caller named, to tell the run's own dataset (whose carved val split is carved again)
        self.resolved, self.split, self.named = resolved, split, named
        self.given = named is not None  # (else the checkpoint's own: it must be the dataset it recorded)

    def dataset_for(self, settings):
        """The dataset read, given the checkpoint's ``settings``; the model is built for it.

        A run that carved its validation split (``--val-fraction``) has it carved
        again from its own dataset, the same rows, for ``val``.
        """
        own = self.named is None or recorded(self.named) == settings.data
        source = datasets.resolve(settings.data) if self.resolved is None else self.resolved
        self.info = datasets.inspect(source)
        if self.split == "val" and "val" not in self.info.sizes and own and settings.val_fraction:
            self.info = datasets.carve_validation(self.info, settings.val_fraction, settings.seed)
        if self.split not in self.info.sizes:
            raise UsageError(
                f"{self.info.path}: has no {self.split} split (it has {', '.join(self.info.sizes)})"
            )
        self.samples = self.info.sizes[self.split]
        self.where = f"{self.info.path}: {self.split}"
        self.source = f"{self.info.name!r} ({self.info.path}), {self.split} split"
        self.data = recorded(self.info.path)
        self.files = (
            []
            if isinstance(source, datasets.ArrayData)
            else [self.info.path] + [member.path for member in self.info.files]
        )
        return self.info

    def check_shape(self, net):
        pass  # the model was built for this dataset's samples

    def read(self, lo, hi, net):
        shard = datasets.Shard(self.info, self.split, 0, 1, net.input_shape, net.dtype, rows=slice(lo, hi))
        return shard.x, shard.y


class PlainSamples:
    """Plain samples: the model is built for the dataset the checkpoint trained on (they carry no task).

    ``notes``: what the samples' reader tells the user, once :meth:`check_shape` has fitted them to the
    model (a CSV file's columns left out).
    """

    def __init__(self, samples, split):
        if split != "test":
            raise UsageError(f"{samples.where}: holds plain samples, which have no splits (split {split!r})")
        self.samples_in, self.split, self.where = samples, None, samples.where
        self.samples, self.source, self.data = samples.count, samples.where, samples.data
        self.given = False  # the task comes from the dataset the checkpoint recorded

    def dataset_for(self, settings):
        """The dataset the checkpoint trained on (``settings.data``): its task, shape and statistics are
        theirs."""
        try:
            self.info = datasets.inspect(datasets.resolve(settings.data))
        except UsageError as err:
            raise UsageError(
                f"{self.where}: plain samples say nothing of the task; it comes from the dataset the "
                f"checkpoint trained on, which cannot be read ({err}): predict a dataset in the "
                "mpidist layout instead"
            ) from None
        # (x - mean) / std with the statistics of the dataset's file where it has them, as Shard reads it
        self.transform = datasets.standardizer(self.info)
        self.files = [p for p in (self.samples_in.path, self.info.path) if isinstance(p, Path)] + [
            member.path for member in self.info.files if isinstance(member.path, Path)
        ]
        return self.info

    def check_shape(self, net):
        self.samples_in.fit(self.info)
        self.notes = self.samples_in.notes
        shape = self.samples_in.shape[1:]
        if shape not in (tuple(self.info.sample_shape), tuple(net.input_shape)):
            raise UsageError(
                f"{self.where}: x holds samples of shape {shape}, but the model takes samples of shape "
                f"{tuple(self.info.sample_shape)} (as in {self.info.name!r}, the dataset it trained on)"
            )

    def read(self, lo, hi, net):
        x = self.samples_in.read(lo, hi, net.dtype)
        if self.transform is not None:
            x = self.transform(x)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = lo + int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])
            raise UsageError(f"{self.where}: x holds NaN or Inf (first at sample {bad})")
        with np.errstate(over="ignore"):  # (an overflow is refused in words below)
            converted = x.astype(net.dtype, copy=False)
        if converted is not x and not np.isfinite(converted).all():
            raise UsageError(
                f"{self.where}: x holds values up to {float(np.max(np.abs(x))):.3g}, beyond the "
                f"range of the model's dtype {net.dtype}"
            )
        return converted.reshape((len(x),) + tuple(net.input_shape)), None


def _checked_layout(where, dtype, shape):
    """Refuse arrays that are not numbers with samples first and at least one feature axis."""
    if dtype.kind not in "biuf":
        raise UsageError(
            f"{where}: x has dtype {dtype} ({KINDS.get(dtype.kind, 'not numbers')}); predict needs numbers"
        )
    if any(size < 0 for size in shape):  # (a .npy header may say so: numpy reads it without a word)
        raise UsageError(f"{where}: x has shape {tuple(shape)}, with a negative size")
    if len(shape) < 2 or 0 in shape[1:]:
        raise UsageError(
            f"{where}: x has shape {tuple(shape)}; it needs samples first and at least one feature "
            "axis, shape (N, features...) (one feature per sample is (N, 1))"
        )
    if shape[0] == 0:
        raise UsageError(f"{where}: x holds no samples")


class Samples:
    """An array of samples, read by blocks of rows: ``where``, ``path`` (or None), ``data``, ``shape``,
    ``count``."""

    path = None

    def __init__(self, where, dtype, shape):
        if shape is None:  # (an HDF5 dataset of an empty dataspace: no shape at all)
            raise UsageError(f"{where}: x holds no array (an HDF5 dataset with an empty dataspace)")
        self.where, self.dtype, self.shape = where, np.dtype(dtype), tuple(int(d) for d in shape)
        _checked_layout(where, self.dtype, self.shape)
        # (what a predictions file records: a path absolute, to be found from anywhere)
        self.count, self.data = (
            self.shape[0],
            os.path.abspath(where) if isinstance(where, Path) else str(where),
        )

    notes = ()  # what the reader told the user of the samples (a CSV file's columns left out)

    def fit(self, info):
        """Told the dataset the model trained on: a CSV file takes the model's features of its columns."""

    def fits(self, rows, dtype, whole=False):
        values = (self.count if whole else rows) * int(np.prod(self.shape[1:]))
        check_fits(
            values * (self.dtype.itemsize + np.dtype(dtype).itemsize),
            f"{self.where}: x ({rows:,} rows of {int(np.prod(self.shape[1:])):,} values for this rank)",
        )


class ArraySamples(Samples):
    def __init__(self, array):
        super().__init__("the numpy array given", array.dtype, array.shape)
        self.array, self.data = array, "numpy array in memory"

    def read(self, lo, hi, dtype):
        return self.array[lo:hi]


class CsvSamples(Samples):
    """Rows of a CSV file, parsed as ``ingest`` parses them (delimiter and header detected, every cell
    checked, an unnamed index column dropped); each rank reads the whole file.

    Which of its columns are the model's features (by the names ``ingest``
    stored, or by count; a label column after them and pandas' index before
    them left out, with a note) is :mod:`mpidist.tools.csv_columns`'.
    """

    def __init__(self, path):
        from .csv_cells import counts_columns
        from .csv_table import PREDICT, read_csv

        self.path = path
        table = read_csv(path, needs=PREDICT)  # (the last column as labels: numbers, or class names left out)
        self.labelled = table.class_names is not None
        self.array = table.x if self.labelled else np.column_stack([table.x, table.y])
        self.names = (
            None if table.names is None else table.names + (() if self.labelled else (table.label_name,))
        )
        self.notes = [f"{path}: {table.index_note}"] if table.index_dropped else []
        if table.names is not None and counts_columns(table.names + (table.label_name or "",)):
            self.notes.append(
                f"{path}: line {table.header_line} counts the columns (0, 1, 2 ...): read as their names, "
                "not as a sample"
            )
        super().__init__(path, self.array.dtype, self.array.shape)

    def fit(self, info):
        from .csv_columns import Model, choose

        model = Model(
            int(np.prod(info.sample_shape)),
            getattr(info, "feature_names", None),
            info.num_classes,
            f"{printable(repr(info.name), 60)}, the dataset it trained on",
        )
        chosen = choose(self.path, self.array, model, self.names, self.labelled)
        # (a row holds a sample's values in row-major order: 64 columns are a sample of shape (8, 8))
        self.array = self.array[:, chosen.features].reshape((self.count,) + tuple(info.sample_shape))
        self.shape, self.notes = self.array.shape, self.notes + list(chosen.notes)

    def read(self, lo, hi, dtype):
        return self.array[lo:hi]


class HDF5Samples(Samples):
    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as handle:
            link = handle.get("x", getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise UsageError(
                    f"{path}: 'x' is an external link to {printable(link.filename)!r}: refused, as it "
                    "reads another file"
                )
            try:
                item = handle["x"]
            except (KeyError, RuntimeError, OSError, ValueError) as err:
                raise UsageError(f"{path}: 'x' cannot be read ({printable(err)})") from None
            if not isinstance(item, h5py.Dataset) or item.is_virtual:
                raise UsageError(f"{path}: 'x' is not a dataset stored in this file")
            if contained.other_file(handle, item):  # (a soft link through an external link)
                raise UsageError(
                    f"{path}: 'x' leads through its links to {printable(item.file.filename)!r}: "
                    f"{contained.REFUSED}"
                )
            stored_elsewhere = contained.elsewhere(item)  # (external storage)
            if stored_elsewhere:
                raise UsageError(f"{path}: 'x' {stored_elsewhere}: {contained.REFUSED}")
            super().__init__(path, item.dtype, item.shape)

    def read(self, lo, hi, dtype):
        self.fits(hi - lo, dtype)
        with (
            reading(f"{self.path}: x", f"at samples {lo}..{hi - 1}", errors=(*HDF5_ERRORS, KeyError)),
            h5py.File(self.path, "r") as handle,
            here().doing("io", f"reading {self.path}: x"),
        ):
            return handle["x"][lo:hi]


class NumpyFile(Samples):
    """A ``.npy`` array, or the array ``x`` of an ``.npz``: headers read first, never unpickled."""

    def __init__(self, path):
        import zipfile

        self.path, self.npz = path, path.suffix.lower() == ".npz"
        try:
            if self.npz:
                with zipfile.ZipFile(path) as archive:
                    names = archive.namelist()
                    if "x.npy" not in names:
                        arrays = sorted(n[:-4] for n in names if n.endswith(".npy"))
                        raise UsageError(f"{path}: needs an array x; has {', '.join(arrays) or 'none'}")
                    with archive.open("x.npy") as handle:
                        shape, fortran, dtype = npy_header(handle)
            else:
                with open(path, "rb") as handle:
                    shape, fortran, dtype = npy_header(handle)
        except (*NUMPY_FILE_ERRORS, zipfile.BadZipFile) as err:
            raise UsageError(
                f"{path}: not a readable {path.suffix} file of plain arrays ({printable(err)})"
            ) from None
        super().__init__(path, dtype, shape)
        # (an .npz member in C order is read a block at a time, on from where the last block ended)
        self.member = MemberRows(path, "x.npy", self.dtype, self.shape) if self.npz and not fortran else None

    def read(self, lo, hi, dtype):
        import zipfile

        self.fits(hi - lo, dtype, whole=self.npz and self.member is None)  # (a Fortran-order member: whole)
        try:
            with here().doing("io", f"reading {self.path}: x"):
                if self.member is not None:
                    return self.member.read(lo, hi)
                if self.npz:
                    with np.load(self.path, allow_pickle=False) as arrays:
                        return arrays["x"][lo:hi].copy()
                return np.array(np.load(self.path, mmap_mode="r", allow_pickle=False)[lo:hi])
        except (*NUMPY_FILE_ERRORS, zipfile.BadZipFile) as err:
            raise UsageError(
                f"{self.path}: not a readable {self.path.suffix} file of plain arrays ({printable(err)})"
            ) from None
