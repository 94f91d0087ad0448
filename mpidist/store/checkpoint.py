"""HDF5 checkpoints: what one holds, and loading it back (:class:`Checkpoint`), every item checked.

A checkpoint holds the flat parameters, the optimizer's flat state arrays
and step count, the global step, the epoch and step within it, the data-order
and RNG state, and the run's config as JSON.  Parameters are stored flat, so a
checkpoint does not depend on how many workers wrote it.

mpidist's random streams are counter-based, so their state is small: the
data order of an epoch is each lane's order, drawn from ``(seed, epoch,
lane)`` (:mod:`mpidist.data.lanes`: the global batch's lanes, the same on any
number of workers), and dropout masks come from ``(seed, worker, step)``.  The
checkpoint records the seed and the position (epoch, step in it) that fix
them, so a resumed run, on any number of workers, trains the rest of the epoch
on exactly the samples the interrupted one had left, and draws the very
numbers it would have (dropout's with the same worker count).

Three modules share a checkpoint file: this one reads it (whole, or one
rank's slices) into a :class:`Checkpoint`; :mod:`~mpidist.store.checkpoint_save`
writes it, aside and renamed, so a crash never corrupts one; and
:mod:`~mpidist.store.checkpoint_checks` holds the checks every item of a file
read back goes through, since a file on disk is untrusted.
"""

import dataclasses
from pathlib import Path

import h5py
import numpy as np

from ..runtime.errors import UsageError
from ..runtime.memory import check_fits
from ..runtime.reads import reading
from ..runtime.text import printable
from ..runtime.whereabouts import here
from . import checkpoint_checks as checks
from . import lineage as lineages
from . import bounded, contained, sharded, slices
from .checkpoint_save import DATA_ORDER, FORMAT, PER_WORKER

# (re-exported: the tests that write a checkpoint to read it back do both through this module)
from .checkpoint_save import attributes as attributes
from .checkpoint_save import save as save
from .outputs import is_regular_file, special_input


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint (host arrays)."""

    path: Path
    params: np.ndarray
    optimizer_state: dict
    optimizer_steps: int
    step: int
    epoch: int
    epoch_step: int
    config: dict
    seed: int = 0  # the seed of the data order and random streams
    lineage: str = ""  # the run lineage that wrote it (see mpidist.store.lineage)
    parent: str = ""  # the lineage it branched from, if it did
    best: dict = None  # --keep-best: {"figure", "value", "step"} of the best validation so far
    elapsed: float = 0.0  # seconds the run had trained when it was written (its metrics' time)
    # what each worker holds of its own where workers differ (local-sgd's parameters and optimizer state
    # between averages, --compress's residuals): name -> (workers, params.size), row w worker w's; None where
    # they agree
    per_worker: dict = None
    dataset_fingerprint: str = ""  # its dataset's content (mpidist.data.fingerprint); "" where unknown
    # the data order its position is in (checkpoint_save.DATA_ORDER when written now; "" where it says none)
    data_order: str = DATA_ORDER
    num_params: int = 0  # the whole model's parameters, and their dtype, known before any array is read
    dtype: np.dtype = None
    #: ``(name, shape)`` of each parameter, in name order, as its ``parameters/`` group names them (None: an
    #: older checkpoint names none): what :func:`refuse_another_model` compares a model with
    named: tuple = None

    def __post_init__(self):
        if self.params is not None:  # (arrays read, or made in memory: the survivors' state)
            self.num_params, self.dtype = self.params.size, self.params.dtype

    def whole(self):
        """This checkpoint with its arrays read whole (a :func:`load` with ``arrays=False`` read none), every
        part of a sharded one checked first."""
        if self.params is not None:
            return self
        whole = load(self.path)
        _same(self, whole)
        return dataclasses.replace(
            whole, optimizer_state={name: whole.optimizer_state[name] for name in self.optimizer_state}
        )

    def check_parts(self, share):
        """Check the checksums of ``share`` ``(i, n)`` of a sharded checkpoint's parts (see
        :func:`sharded.verify`: ``n`` ranks that each check a share read the parts once between them); this
        checkpoint."""
        if self.params is None:
            _check_parts(self, share)
        return self

    def restore(self, placement, buffers):
        """Fill ``buffers`` (``"params"`` and optimizer state names -> this rank's flat arrays, host or
        device, in ``placement``'s order) with ``placement``'s slices (a
        :class:`mpidist.nn.placement.Placement`), one array at a time: taken from the whole arrays held, or
        read from the file as hyperslabs, into the buffers themselves where they are host arrays.  Only the
        arrays the checkpoint holds are filled."""
        held = {"params": self.params, **self.optimizer_state}
        names = [name for name in held if name in buffers]
        if self.params is not None:
            for name in names:
                _fill(buffers[name], placement.take(np.asarray(held[name])))
        else:
            _restore_slices(self, placement, {name: buffers[name] for name in names})


def load(path, arrays=True):
    """Read a checkpoint file and check everything in it; a missing or bad one is a :class:`UsageError`.

    The file is untrusted: its arrays' shapes and dtypes are checked before
    they are read (and their size against the memory free), their values for
    NaN and Inf, its attributes for type and range.  The message names the
    file, the item and the value.  With ``arrays`` False no array is read
    yet (nor a sharded checkpoint's checksums): :meth:`Checkpoint.whole` reads
    them whole, :meth:`Checkpoint.restore` one rank's slices, each checking
    what it reads.
    """
    path = Path(path)
    if not path.is_file():
        special = special_input(path) if path.exists() else None  # (a pipe would block the open forever)
        raise UsageError(f"{path}: {'cannot be read: ' + special if special else 'no such checkpoint file'}")
    try:
        with here().doing("io", f"reading checkpoint {path}"), h5py.File(path, "r") as handle:
            return _read(path, handle, arrays)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as err:
        raise UsageError(f"{path}: not a readable checkpoint ({printable(err)})") from None


def _refusal(path):
    """``bad(item, problem)`` for checkpoint ``path``: the :class:`UsageError` naming it."""
    return lambda item, problem: UsageError(f"{path}: {item} {problem}")


def _unread(item, problem):
    """``bad(item, problem)`` where a checkpoint's item is only looked at: the caller passes over it."""
    return ValueError(f"{item} {problem}")


def _read(path, handle, read_arrays=True):
    bad = _refusal(path)
    stated = bounded.Attributes(handle, bad).get("format")
    virtual = stated == sharded.FORMAT  # (an index over part files)
    if stated != FORMAT and not virtual:
        raise UsageError(f"{path}: not an mpidist checkpoint (no format attribute {FORMAT!r})")
    _verified(path, handle, share=(0, 1) if read_arrays else (0, 0))
    params = checks.float_array(handle, "params", bad, virtual=virtual)
    if params.ndim != 1 or params.dtype not in checks.FLOATS:
        raise bad(
            "params",
            f"has shape {params.shape} and dtype {params.dtype}; a checkpoint holds one flat "
            "float32 or float64 array",
        )
    group = handle.get("optimizer", getclass=True)
    if group is not h5py.Group:
        raise bad("optimizer", "is missing")
    group = handle["optimizer"]
    arrays = {}
    for name in group:
        array = checks.float_array(group, name, bad, prefix="optimizer/", virtual=virtual)
        if array.shape != params.shape or array.dtype not in checks.FLOATS:
            raise bad(
                f"optimizer/{printable(name)}",
                f"has shape {array.shape} and dtype {array.dtype}; it must "
                f"be flat like params {params.shape}",
            )
        arrays[name] = array
    rows = checks.per_worker_arrays(handle, params, bad)
    header = checks.header(path, handle, group, bad)
    header["named"] = checks.named_parameters(handle, params, bad)
    if not read_arrays:
        return Checkpoint(path=path, params=None, optimizer_state=dict.fromkeys(arrays), **header)
    check_fits(
        (1 + len(arrays) + sum(len(array) for array in rows.values())) * params.size * params.dtype.itemsize,
        f"checkpoint {path} ({params.size:,} parameters)",
    )
    loaded = {}
    for name, item in (("params", handle["params"]), *((name, group[name]) for name in arrays)):
        with reading(f"{path}: {name if name == 'params' else 'optimizer/' + printable(name)}"):
            loaded[name] = item[...]  # (a compressed chunk may not decode: the item is named)
    per_worker = {}
    for name in rows:
        with reading(f"{path}: {PER_WORKER}/{printable(name)}"):
            per_worker[name] = handle[PER_WORKER][name][...]
    for item, array in [
        *loaded.items(),
        *((f"{PER_WORKER}/{name}", array) for name, array in per_worker.items()),
    ]:
        checks.check_finite(path, item, array)
    return Checkpoint(
        path=path,
        params=loaded.pop("params"),
        optimizer_state=loaded,
        per_worker=per_worker or None,
        **header,
    )


def _same(loaded, again):
    """Refuse a checkpoint that is another file now than when its header was loaded (replaced in between)."""
    if (again.step, again.lineage, again.num_params, again.dtype) != (
        loaded.step,
        loaded.lineage,
        loaded.num_params,
        loaded.dtype,
    ):
        raise UsageError(f"{loaded.path}: the checkpoint changed while the run started (it was replaced)")


def _verified(path, handle, share):
    """Refuse a checkpoint (``handle``, open, at ``path``) that would read another file than its own, or
    decompress more than its arrays hold: a sharded one whose parts :func:`sharded.verify` finds wrong, their
    checksums and items checked for ``share``; one of a single file with an item that reads elsewhere
    (:func:`contained.outside`) or a chunk far larger than its array (:func:`bounded.oversized_chunks`)."""
    if bounded.Attributes(handle, _refusal(path)).get("format") == sharded.FORMAT:
        problem = sharded.verify(path, handle, share)
    else:
        problem = contained.outside(handle) or bounded.oversized_chunks(handle)
    if problem:
        raise UsageError(f"{path}: {problem}")


def _check_parts(loaded, share):
    """:meth:`Checkpoint.check_parts` of a checkpoint whose arrays are not read."""
    try:
        with h5py.File(loaded.path, "r") as handle:
            _verified(loaded.path, handle, share)
    except OSError as err:
        raise UsageError(f"{loaded.path}: not a readable checkpoint ({printable(err)})") from None


def _fill(buffer, values):
    """Copy host ``values`` into ``buffer`` (a host or device array)."""
    if isinstance(buffer, np.ndarray):
        buffer[...] = values
    else:
        buffer.set(np.ascontiguousarray(values, dtype=buffer.dtype))


def _restore_slices(loaded, placement, buffers):
    """:meth:`Checkpoint.restore` from the file: each array's slices read straight into a host buffer (HDF5
    converts the dtype), or through one host array of a slice's size into a device buffer."""
    path = loaded.path
    if not all(isinstance(buffer, np.ndarray) for buffer in buffers.values()):  # (a device buffer: staged)
        check_fits(
            placement.size * loaded.dtype.itemsize,
            f"a host copy of this rank's slices of checkpoint {path} ({placement.size:,} parameters)",
        )
    try:
        with here().doing("io", f"reading slices of checkpoint {path}"), h5py.File(path, "r") as handle:
            header = checks.header(path, handle, handle["optimizer"], _refusal(path))
            _same(loaded, Checkpoint(path=path, params=None, optimizer_state={}, **header))
            for name, buffer in buffers.items():
                key = name if name == "params" else f"optimizer/{name}"
                host = isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous
                with reading(f"{path}: {key}"):
                    values = slices.read(
                        handle[key], placement, loaded.dtype, out=buffer[: placement.size] if host else None
                    )
                checks.check_finite(
                    path, name, values, whose="" if placement.size == loaded.num_params else "this rank's "
                )
                if not host:
                    _fill(buffer, values)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as err:
        raise UsageError(f"{path}: not a readable checkpoint ({printable(err)})") from None


def settings_of(path):
    """The settings checkpoint ``path`` was written with (its ``config`` attribute, read alone), or None where
    they cannot be read (the file is untrusted: :func:`load` checks the whole of it)."""
    if not is_regular_file(path):
        return None
    try:
        with h5py.File(path, "r") as handle:
            return checks.json_attribute(bounded.Attributes(handle, _unread), "config", _unread)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError):
        return None


def newest_loadable(directory, refusal):
    """:func:`newest_valid` of ``directory`` (arrays unread), or a :class:`UsageError` ``refusal`` and, where
    checkpoints were passed over, how many and the newest's reason."""
    saved, skipped = newest_valid(directory, arrays=False)
    if saved is None:
        why = f" ({len(skipped)} unreadable, the newest {skipped[0][1]})" if skipped else ""
        raise UsageError(f"{refusal}{why}")
    return saved, skipped


def newest_valid(directory, arrays=True):
    """``(newest checkpoint that loads, [(path, reason) for newer ones that did not])``; its arrays unread
    without ``arrays`` (see :func:`load`).

    The newest of the lineage written last (see :mod:`mpidist.store.lineage`):
    another run's checkpoints in the same directory are never resumed by
    ``--resume auto``.  A run killed while writing leaves no half file under
    a checkpoint name (files are renamed into place), but a disk can still
    corrupt one: the previous checkpoint is used then, and the caller reports
    the skipped file.
    """
    place = lineages.CheckpointDir(directory)
    latest = place.latest_lineage()
    skipped = []
    for entry in reversed(place.entries(latest) if latest is not None else []):
        try:
            return load(entry.path, arrays), skipped
        except UsageError as err:
            skipped.append((entry.path, str(err)))
    return None, skipped


def refuse_another_model(saved, named, where):
    """Refuse checkpoint ``saved`` for a model whose parameters are ``named`` (``(name, shape)``, as
    :func:`mpidist.loop.sharded_save.parameters` gives them) where their shapes differ: the same number of
    values laid out as another model's would load without a word (``mlp:15`` and ``mlp:5,50`` both hold
    1,135).  ``where``: the model, in words, for the message."""
    if saved.named is None:  # (an older checkpoint: its count alone was compared)
        return
    theirs = sorted((str(name), tuple(shape)) for name, shape in named)
    for (name, shape), (their_name, their_shape) in zip(saved.named, theirs):
        if shape != their_shape:
            raise UsageError(
                f"{saved.path}: holds {printable(name)} of shape {shape}, where {where} has {their_name} of "
                f"shape {their_shape}: it was written by another model"
            )
    if len(saved.named) != len(theirs):
        raise UsageError(
            f"{saved.path}: holds {len(saved.named)} parameter arrays, where {where} has {len(theirs)}: it "
            "was written by another model"
        )
