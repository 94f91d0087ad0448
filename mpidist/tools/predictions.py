"""``predict``: a trained model's outputs on new samples, spread over the ranks, written in input order.

What is predicted (``data``):

* a split of a dataset in the mpidist layout (``test`` by default; ``train``,
  or ``val`` where the file has one), read through :class:`mpidist.data.Shard`,
  so samples are checked and transformed exactly as training and ``eval`` read
  them; the model is built for that dataset, as ``eval`` builds it;
* plain samples: an HDF5 file with a dataset ``x``, a ``.npy`` array, an
  ``.npz`` file with an array ``x`` (both read with ``allow_pickle=False``:
  a file never runs code), or, in Python, a numpy array (the same on every
  rank).  Plain samples say nothing of the task, so the model is built for the
  dataset the checkpoint trained on (its settings' ``data``), which must be
  readable; the samples must have its sample shape, and are fed as stored
  (standardised with that dataset's statistics where it has them, as Shard does).
  Each rank reads only its rows of an HDF5 or ``.npy`` file; an ``.npz``
  member is compressed whole, so every rank reads all of it.

Everything read is untrusted: dtypes must be numeric, shapes must fit the
model, values finite and within the model's dtype, sizes within the memory
free (:func:`mpidist.runtime.memory.check_fits`) before anything is allocated.  Bad
input is agreed on by every rank (:func:`mpidist.runtime.agreement.agreed`): one message,
exit code 2, nobody left waiting.

Rank ``r`` of ``W`` reads one contiguous block of rows (the first ``N % W``
ranks one more), runs ``model.forward(training=False)`` over it in batches of
:data:`BATCH`, and the outputs are gathered to rank 0 with one ``Gatherv``
(:func:`mpidist.runtime.comm.gatherv`: buffers, no pickle), in input order.  Rank 0
writes the output file aside and renames it into place
(:func:`mpidist.store.outputs.claimed`), so an existing file is replaced only by a
whole new one.  The file holds, for classification, ``class`` (int64, the
highest output, first on ties: as ``eval`` counts) and ``probabilities``
(softmax, float32); for regression ``values`` (``(N, W)``, the model's
dtype); and attributes ``format``, ``checkpoint``, ``step``, ``model``,
``data``, ``split``, ``task``, ``samples`` and ``class_names`` where the
dataset names its classes.
"""

import contextlib
import dataclasses
import os
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from ..store import checkpoint
from ..runtime import comm as mpi
from .. import data as datasets
from ..runtime.agreement import agreed
from ..runtime.errors import UsageError
from ..runtime.memory import check_fits
from ..runtime.text import printable
from ..runtime.whereabouts import here

FORMAT = "mpidist-predictions-1"
SPLITS = datasets.SPLITS + datasets.OPTIONAL_SPLITS
#: Samples per forward pass (``eval`` uses the same).
BATCH = 1024
PART_BYTES = 64 << 20   # samples read and predicted at once on a rank (as float64): memory bounded by this
#: Most values one ``Gatherv`` may carry (MPI counts are C ints).
GATHER_LIMIT = 2 ** 31 - 1
KINDS = {"U": "text", "S": "bytes", "O": "Python objects", "c": "complex numbers", "M": "dates",
         "m": "time spans", "V": "records"}


@dataclasses.dataclass
class Predictions:
    """What :func:`predict` returns on every rank; the arrays on rank 0 only (None elsewhere).

    Attributes:
        samples: how many samples were predicted.
        output: the file written, or None where ``output=None``.
        task: ``"classification"`` or ``"regression"``.
        step: the checkpoint's step.
        model: the model's spec.
        source: what was predicted, in words (``"'digits' (digits.h5), test split"``).
        classes: ``(N,)`` int64, the class of the highest output (first on ties), for classification.
        probabilities: ``(N, K)`` float32 softmax of the outputs, for classification.
        values: ``(N, W)`` outputs in the model's dtype, for regression.
        class_names: the dataset's class names, where it has them.
        figures: for a dataset split (it has labels): ``{"accuracy": ...}`` (classification, the
            fraction ``eval`` reports as ``test_accuracy`` on the test split) or ``{"mse": ...}``
            (regression); ``{}`` for plain samples.  On every rank.
    """

    samples: int
    output: Path
    task: str
    step: int
    model: str
    source: str
    classes: np.ndarray = None
    probabilities: np.ndarray = None
    values: np.ndarray = None
    class_names: list = None
    figures: dict = dataclasses.field(default_factory=dict)

    def summary(self):
        """One line: what was predicted, where it was written, and the figure of a labelled split."""
        line = f"mpidist predict: {self.samples} samples of {self.source} (step {self.step}, model {self.model})"
        line += f" -> {self.output}" if self.output is not None else " (not written)"
        if "accuracy" in self.figures:
            line += f", accuracy {100 * self.figures['accuracy']:.2f}%"
        elif "mse" in self.figures:
            line += f", MSE {self.figures['mse']:#.4g}"
        return line


def predict(checkpoint_path, data=None, output=None, *, model=None, comm=None, split="test"):
    """Predict with a checkpoint on new samples, each rank its own block, and write the predictions in input order.

    Every rank calls it with the same arguments.

    Args:
        checkpoint_path: a checkpoint file (``ckpt-*.h5``).
        data: a dataset in the mpidist layout (a path, a bundled name or an
            :class:`~mpidist.data.arrays.ArrayData`: its ``split`` is predicted), or plain samples: an
            HDF5 file with a dataset ``x``, a ``.npy`` file, an ``.npz`` file with an array ``x``,
            or a numpy array (the same on every rank); default: the dataset the checkpoint trained on.
        output: the HDF5 file rank 0 writes (replaced only by a whole new one); None: write nothing.
        model: the model, where its checkpoint cannot name it; default: the spec the checkpoint stores.
        comm: the communicator whose ranks predict together (default ``MPI.COMM_WORLD``).
        split: the split of a dataset: ``"test"``, ``"train"`` or ``"val"`` (where the file has one).

    Returns:
        :class:`Predictions` on every rank, its arrays on rank 0.  Bad input raises
        ``SystemExit(2)`` on every rank, after one message.
    """
    from ..settings.config import Settings
    from ..observe.stall import LocalWatch
    from ..runtime.threads import limit_blas_threads

    limit_blas_threads()
    world = MPI.COMM_WORLD if comm is None else comm
    here().enter("setup", 0)
    with LocalWatch(here(), Settings.stall_timeout, world.Get_rank()):
        return _predict(world, checkpoint_path, data, output, model, split)


def _predict(world, checkpoint_path, data, output, model, split):
    from ..api import _ends_the_job_on_error, _stored_settings
    from ..loop.setup import Inputs, build_model_for
    from ..store.outputs import claimed
    from ..runtime.xp import select_device

    rank, size = world.Get_rank(), world.Get_size()
    claiming = contextlib.ExitStack()   # rank 0's file written aside, removed unless renamed into place
    with claiming:
        with agreed(world):
            saved = checkpoint.load(checkpoint_path)
            config = _stored_settings(saved)
            inputs = Inputs.of(config, model, None)
            # (a validation split carved by the run is carved again only from the run's own dataset)
            own = data is None or str(data) == config.data
            reader = _reader(data if data is not None else config.data, split, config.data, config if own else None)
            xp, _ = select_device(config.device, 0)
            net = build_model_for(config, inputs, reader.info, xp)
            if net.num_params != saved.params.size:
                raise UsageError(f"{checkpoint_path}: holds {saved.params.size} parameters, but model "
                                 f"{inputs.model.spec} on {reader.info.name!r} has {net.num_params}")
            reader.check_shape(net)
            counts, starts = blocks(reader.samples, size)
            width = int(np.prod(net.output_shape, dtype=np.int64))
            if reader.samples * width > GATHER_LIMIT:
                raise UsageError(f"{reader.where}: {reader.samples:,} samples of {width:,} outputs are more values "
                                 f"than one gather carries ({GATHER_LIMIT:,}): predict them in parts")
            target = None if output is None else Path(output)
            if target is not None:
                _refuse_an_input(target, [checkpoint_path] + reader.files)
            if rank == 0:
                check_fits(reader.samples * width * (net.dtype.itemsize + 4) + reader.samples * 8,
                           f"the predictions of {reader.samples:,} samples ({width:,} outputs each) on rank 0")
                if target is not None:
                    claim = claiming.enter_context(claimed(target, "the predictions"))   # unwritable: fails now
        _agree_on_sizes(world, reader.samples, width)
        net.params[...] = xp.asarray(saved.params)
        # rows are read and predicted a part at a time (the memory of a part, whatever the input's size); every
        # rank takes as many parts, so each read is agreed on: bad rows end every rank cleanly, output untouched
        part = max(1, PART_BYTES // (8 * int(np.prod(reader.info.sample_shape))))
        outputs, targets = [], []
        for lo in range(0, max(counts) or 1, part):
            with agreed(world):
                begin, end = starts[rank] + min(lo, counts[rank]), starts[rank] + min(lo + part, counts[rank])
                x, y = reader.read(begin, end, net)
            with _ends_the_job_on_error(world):
                outputs.append(_forward(net, x, width))
                targets.append(y)
        with _ends_the_job_on_error(world):
            mine = np.concatenate(outputs)
            classification = reader.info.num_classes > 0
            y = None if targets[0] is None else np.concatenate(targets)
            figures = _figures(world, mine, y, classification) if y is not None else {}
            here().enter("gather")
            gathered = np.empty((reader.samples, width), dtype=mine.dtype) if rank == 0 else None
            mpi.gatherv(world, mine, gathered, [c * width for c in counts], [s * width for s in starts], root=0)
        result = Predictions(samples=reader.samples, output=target, model=inputs.model.spec, step=saved.step,
                             task="classification" if classification else "regression", source=reader.source,
                             class_names=_names(reader.info), figures=figures)
        if rank == 0:
            if classification:
                result.classes, result.probabilities = gathered.argmax(axis=1).astype(np.int64), softmax(gathered)
            else:
                result.values = gathered
        with agreed(world):   # every rank learns whether the file was written
            if rank == 0 and target is not None:
                here().enter("write")
                claim.write(lambda aside: _write(aside, result, checkpoint_path, reader))
    return result


def blocks(samples, ranks):
    """``(counts, starts)``: contiguous blocks of rows, one per rank, the first ``samples % ranks`` one longer."""
    counts = [samples // ranks + (1 if r < samples % ranks else 0) for r in range(ranks)]
    return counts, [int(s) for s in np.cumsum([0] + counts[:-1])]


def softmax(outputs):
    """Softmax over the last axis, computed in float64 in chunks, as float32."""
    out = np.empty(outputs.shape, dtype=np.float32)
    for lo in range(0, len(outputs), BATCH * 16):
        part = outputs[lo:lo + BATCH * 16].astype(np.float64)
        part = np.exp(part - part.max(axis=1, keepdims=True))
        out[lo:lo + len(part)] = part / part.sum(axis=1, keepdims=True)
    return out


def _forward(net, x, width):
    """``net``'s outputs on ``x`` in batches, as a host array ``(len(x), width)``."""
    from ..runtime.xp import to_host

    xp = net.xp
    here().enter("compute")
    out = np.empty((len(x), width), dtype=net.dtype)
    for lo in range(0, len(x), BATCH):
        out[lo:lo + BATCH] = to_host(net.forward(xp.asarray(x[lo:lo + BATCH]), training=False)).reshape(-1, width)
    return out


def _figures(world, outputs, y, classification):
    """Accuracy or MSE over every rank's rows, as ``eval`` computes it (a ratio of summed counts)."""
    if classification:
        correct = float((outputs.argmax(axis=1) == y.reshape(-1)).sum()) if len(outputs) else 0.0
        total, count = mpi.sum_float64(world, [correct, len(outputs)])
        return {"accuracy": float(total / int(count))}
    error = outputs.astype(np.float64) - y.reshape(outputs.shape).astype(np.float64)
    total, count = mpi.sum_float64(world, [float((error * error).sum()), error.size])
    return {"mse": float(total / int(count))}


def _agree_on_sizes(world, samples, width):
    """Every rank must see the same samples (a numpy array differing between ranks would scramble the gather)."""
    mine = np.array([samples, width], dtype=np.int64)
    every = np.empty((world.Get_size(), 2), dtype=np.int64)
    world.Allgather(mine, every)
    with agreed(world):
        if (every != mine).any():
            raise UsageError(f"the ranks were given different samples: {every[:, 0].tolist()} samples of "
                             f"{every[:, 1].tolist()} outputs; pass the same data on every rank")


def _names(info):
    names = getattr(info, "class_names", None)
    if names is None:
        return None
    return [name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name) for name in names]


def _refuse_an_input(target, inputs):
    """Refuse an output that is a file this run reads: it would be replaced by what is read from it."""
    for source in inputs:
        source = Path(source)
        same = target.resolve() == source.resolve()
        with contextlib.suppress(OSError):
            same = same or (target.exists() and os.path.samefile(target, source))
        if same:
            raise UsageError(f"--output {target}: is {source}, an input of this run; write the predictions elsewhere")


def _write(aside, result, checkpoint_path, reader):
    """Rank 0: the predictions into the file ``aside`` (its claim renames it into place once whole)."""
    with h5py.File(aside, "w") as handle:
        if result.task == "classification":
            handle.create_dataset("class", data=result.classes)
            handle.create_dataset("probabilities", data=result.probabilities)
        else:
            handle.create_dataset("values", data=result.values)
        handle.attrs.update({"format": FORMAT, "checkpoint": str(Path(checkpoint_path).resolve()),
                             "step": int(result.step), "model": result.model, "data": reader.data,
                             "split": reader.split or "", "task": result.task, "samples": int(result.samples)})
        if result.class_names is not None:
            handle.attrs["class_names"] = np.array(result.class_names, dtype=h5py.string_dtype())


# -- what is predicted ---------------------------------------------------------------------------------------
def _reader(data, split, trained_on, config=None):
    """A :class:`_Split` of a dataset, or :class:`_Plain` samples, for ``data``.

    ``config``: the checkpoint's settings; a run that carved its validation
    split (``--val-fraction``) has it carved again, the same rows, for ``val``.
    """
    if split not in SPLITS:
        raise UsageError(f"split {split!r}: choose from {', '.join(SPLITS)}")
    if isinstance(data, (np.ndarray, list, tuple)):
        return _Plain(_ArraySamples(np.asarray(data)), split, trained_on)
    if isinstance(data, datasets.ArrayData):
        return _Split(data, split, config)
    if not isinstance(data, (str, os.PathLike)):
        raise UsageError(f"data: give a file, a bundled dataset's name, an ArrayData or a numpy array, not "
                         f"{type(data).__name__}")
    path = datasets.resolve(os.fspath(data))
    if path.suffix.lower() in (".npy", ".npz"):
        return _Plain(_NumpyFile(path), split, trained_on)
    try:
        with h5py.File(path, "r") as handle:
            plain = "x" in handle and not any(name in handle for name in SPLITS)
    except (OSError, RuntimeError, ValueError) as err:
        raise UsageError(f"{path}: not a readable HDF5, .npy or .npz file ({printable(err)})") from None
    return _Plain(_HDF5Samples(path), split, trained_on) if plain else _Split(path, split, config)


class _Split:
    """A split of a dataset in the mpidist layout, read through :class:`mpidist.data.Shard`."""

    def __init__(self, source, split, config=None):
        self.info = datasets.inspect(source)
        if split == "val" and "val" not in self.info.sizes and config is not None and config.val_fraction:
            self.info = datasets.carve_validation(self.info, config.val_fraction, config.seed)
        if split not in self.info.sizes:
            raise UsageError(f"{self.info.path}: has no {split} split (it has {', '.join(self.info.sizes)})")
        self.split, self.samples = split, self.info.sizes[split]
        self.where = f"{self.info.path}: {split}"
        self.source = f"{self.info.name!r} ({self.info.path}), {split} split"
        self.data = str(self.info.path)
        self.files = [] if isinstance(source, datasets.ArrayData) else [self.info.path]

    def check_shape(self, net):
        pass   # the model was built for this dataset's samples

    def read(self, lo, hi, net):
        shard = datasets.Shard(self.info, self.split, 0, 1, net.input_shape, net.dtype, rows=slice(lo, hi))
        return shard.x, shard.y


class _Plain:
    """Plain samples: the model is built for the dataset the checkpoint trained on (they carry no task)."""

    def __init__(self, samples, split, trained_on):
        if split != "test":
            raise UsageError(f"{samples.where}: holds plain samples, which have no splits (split {split!r})")
        self.samples_in, self.split, self.where = samples, None, samples.where
        self.samples, self.source, self.data = samples.count, samples.where, samples.data
        try:
            self.info = datasets.inspect(datasets.resolve(trained_on))
        except UsageError as err:
            raise UsageError(f"{samples.where}: plain samples say nothing of the task; it comes from the dataset the "
                             f"checkpoint trained on, which cannot be read ({err}): predict a dataset in the "
                             "mpidist layout instead") from None
        self.transform = _transform(self.info)
        self.files = [p for p in (samples.path, self.info.path) if isinstance(p, Path)]

    def check_shape(self, net):
        shape = self.samples_in.shape[1:]
        if shape not in (tuple(self.info.sample_shape), tuple(net.input_shape)):
            raise UsageError(f"{self.where}: x holds samples of shape {shape}, but the model takes samples of shape "
                             f"{tuple(self.info.sample_shape)} (as in {self.info.name!r}, the dataset it trained on)")

    def read(self, lo, hi, net):
        x = self.samples_in.read(lo, hi, net.dtype)
        if self.transform is not None:
            x = self.transform(x)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            bad = lo + int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])
            raise UsageError(f"{self.where}: x holds NaN or Inf (first at sample {bad})")
        converted = x.astype(net.dtype, copy=False)
        if converted is not x and not np.isfinite(converted).all():
            raise UsageError(f"{self.where}: x holds values up to {float(np.max(np.abs(x))):.3g}, beyond the "
                             f"range of the model's dtype {net.dtype}")
        return converted.reshape((len(x),) + tuple(net.input_shape)), None


def _transform(info):
    """What :class:`mpidist.data.Shard` does to the samples of dataset ``info`` besides checking them, or None.

    Plain samples of a model trained on ``info`` get the same: ``(x - mean) / std`` with
    the statistics of ``info``'s file where it has them (:func:`mpidist.data.standardizer`).
    """
    return datasets.standardizer(info)


def _checked_layout(where, dtype, shape):
    """Refuse arrays that are not numbers with samples first and at least one feature axis."""
    if dtype.kind not in "biuf":
        raise UsageError(f"{where}: x has dtype {dtype} ({KINDS.get(dtype.kind, 'not numbers')}); predict needs "
                         "numbers")
    if len(shape) < 2 or 0 in shape[1:]:
        raise UsageError(f"{where}: x has shape {tuple(shape)}; it needs samples first and at least one feature "
                         "axis, shape (N, features...) (one feature per sample is (N, 1))")
    if shape[0] == 0:
        raise UsageError(f"{where}: x holds no samples")


class _Samples:
    """An array of samples, read by blocks of rows: ``where``, ``path`` (or None), ``data``, ``shape``, ``count``."""

    path = None

    def __init__(self, where, dtype, shape):
        self.where, self.dtype, self.shape = where, np.dtype(dtype), tuple(int(d) for d in shape)
        _checked_layout(where, self.dtype, self.shape)
        self.count, self.data = self.shape[0], str(where)

    def fits(self, rows, dtype, whole=False):
        values = (self.count if whole else rows) * int(np.prod(self.shape[1:]))
        check_fits(values * (self.dtype.itemsize + np.dtype(dtype).itemsize),
                   f"{self.where}: x ({rows:,} rows of {int(np.prod(self.shape[1:])):,} values for this rank)")


class _ArraySamples(_Samples):
    def __init__(self, array):
        super().__init__("the numpy array given", array.dtype, array.shape)
        self.array, self.data = array, "numpy array in memory"

    def read(self, lo, hi, dtype):
        return self.array[lo:hi]


class _HDF5Samples(_Samples):
    def __init__(self, path):
        self.path = path
        with h5py.File(path, "r") as handle:
            link = handle.get("x", getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise UsageError(f"{path}: 'x' is an external link to {printable(link.filename)!r}: refused, as it "
                                 "reads another file")
            try:
                item = handle["x"]
            except (KeyError, RuntimeError, OSError, ValueError) as err:
                raise UsageError(f"{path}: 'x' cannot be read ({printable(err)})") from None
            if not isinstance(item, h5py.Dataset) or item.is_virtual:
                raise UsageError(f"{path}: 'x' is not a dataset stored in this file")
            super().__init__(path, item.dtype, item.shape)

    def read(self, lo, hi, dtype):
        self.fits(hi - lo, dtype)
        with h5py.File(self.path, "r") as handle, here().doing("io", f"reading {self.path}: x"):
            return handle["x"][lo:hi]


class _NumpyFile(_Samples):
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
                        header = _npy_header(handle)
            else:
                with open(path, "rb") as handle:
                    header = _npy_header(handle)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise UsageError(f"{path}: not a readable {path.suffix} file of plain arrays ({printable(err)})") from None
        super().__init__(path, header[1], header[0])

    def read(self, lo, hi, dtype):
        import zipfile

        self.fits(hi - lo, dtype, whole=self.npz)   # an .npz member is read whole
        try:
            with here().doing("io", f"reading {self.path}: x"):
                if self.npz:
                    with np.load(self.path, allow_pickle=False) as arrays:
                        return arrays["x"][lo:hi].copy()
                return np.array(np.load(self.path, mmap_mode="r", allow_pickle=False)[lo:hi])
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise UsageError(f"{self.path}: not a readable {self.path.suffix} file of plain arrays "
                             f"({printable(err)})") from None


def _npy_header(handle):
    """``(shape, dtype)`` of the ``.npy`` stream ``handle``, from its header alone."""
    fmt = np.lib.format
    version = fmt.read_magic(handle)
    if version == (1, 0):
        shape, _, dtype = fmt.read_array_header_1_0(handle)
    elif version == (2, 0):
        shape, _, dtype = fmt.read_array_header_2_0(handle)
    else:
        raise ValueError(f".npy format version {version} is not one of plain numbers (1.0 or 2.0)")
    return shape, dtype
