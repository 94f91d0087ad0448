"""HDF5 checkpoints: written aside and renamed, so a crash never corrupts one.

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
"""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np

from ..runtime.errors import RunError, UsageError
from ..runtime.memory import check_fits
from ..runtime.reads import reading
from ..runtime.text import printable, shown
from ..runtime.whereabouts import here
from . import atomic, bulk, sharded, slices
from . import lineage as lineages
from .outputs import is_regular_file, special_input

FORMAT = "mpidist-checkpoint-1"
#: what each optimizer keeps, one flat array per name (a checkpoint's optimizer/ group)
OPTIMIZER_STATE = {"adam": ("m", "v"), "sgd": ("velocity",)}
FLOATS = (np.dtype("float32"), np.dtype("float64"))
LARGEST = 2**62  # step counts and seeds above this cannot be honest
FINGERPRINT = re.compile(
    r"[0-9a-z-]{1,16}:[0-9a-f]{64}"
)  # "<scheme>:<hex digest>" (mpidist.data.fingerprint)


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
    # what each worker holds of its own where workers differ (local-sgd's parameters and optimizer state between
    # averages, --compress's residuals): name -> (workers, params.size), row w worker w's; None where they agree
    per_worker: dict = None
    dataset_fingerprint: str = ""  # its dataset's content (mpidist.data.fingerprint); "" where unknown
    num_params: int = 0  # the whole model's parameters, and their dtype, known before any array is read
    dtype: np.dtype = None

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
        """Check the checksums of ``share`` ``(i, n)`` of a sharded checkpoint's parts (see :func:`sharded.verify`:
        ``n`` ranks that each check a share read the parts once between them); this checkpoint."""
        if self.params is None:
            _check_parts(self, share)
        return self

    def restore(self, placement, buffers):
        """Fill ``buffers`` (``"params"`` and optimizer state names -> this rank's flat arrays, host or device, in
        ``placement``'s order) with ``placement``'s slices (a :class:`mpidist.nn.placement.Placement`), one array
        at a time: taken from the whole arrays held, or read from the file as hyperslabs, into the buffers
        themselves where they are host arrays.  Only the arrays the checkpoint holds are filled."""
        held = {"params": self.params, **self.optimizer_state}
        names = [name for name in held if name in buffers]
        if self.params is not None:
            for name in names:
                _fill(buffers[name], placement.take(np.asarray(held[name])))
        else:
            _restore_slices(self, placement, {name: buffers[name] for name in names})


PER_WORKER = "workers"  # the group of each worker's own state
MAX_WORKERS = 1 << 20  # rows of per-worker state a checkpoint may claim

DATA_ORDER = (
    "lanes of the global batch as contiguous ranges, each ordered per epoch in windows of units by keyed "
    "Feistel permutations of (seed, epoch, lane) and the settings' shuffle_buffer; step s takes sample s of each"
)
RNG = "counter-based: dropout reseeded each step from (seed, worker, step)"


def save(
    directory,
    params,
    optimizer_state,
    optimizer_steps,
    step,
    epoch,
    epoch_step,
    config_json,
    seed,
    workers,
    lineage="",
    parent="",
    best=None,
    elapsed=0.0,
    per_worker=None,
    dataset_fingerprint="",
):
    """Write ``ckpt-<step>-<lineage>.h5`` in ``directory`` atomically; returns its path.

    ``seed`` and the position fix the data order, and with ``workers`` the random streams (see the module text).
    ``per_worker``: each worker's own state where the workers' differ (name ->
    ``(workers, params.size)`` array), written in the group ``workers/``.
    ``dataset_fingerprint`` (:func:`mpidist.data.fingerprint.fingerprint`) tells the dataset it
    trained on from another under the same name.
    A write that fails (a full disk, a quota) raises :class:`RunError` with the
    reason; the file written aside is removed and every older checkpoint is intact.
    """
    directory = Path(directory)
    final = directory / lineages.file_name(step, lineage)
    try:
        with atomic.replacing(final) as aside:
            places = []
            with bulk.open_aligned(aside) as handle:
                _structure(
                    handle,
                    places,
                    params,
                    optimizer_state,
                    optimizer_steps,
                    step,
                    epoch,
                    epoch_step,
                    config_json,
                    seed,
                    workers,
                    lineage,
                    parent,
                    best,
                    elapsed,
                    per_worker,
                    dataset_fingerprint,
                )
            bulk.fill(aside, places)  # (the arrays' bytes, without holding Python's lock)
    except OSError as err:  # h5py wraps errno in a long message: say the reason, and what is kept
        reason = os.strerror(err.errno) if err.errno else str(err)
        kept = ", ".join(e.path.name for e in lineages.CheckpointDir(directory).entries()) or "none"
        raise RunError(
            f"checkpoint of step {step} not written to {directory}: {reason} (checkpoints there, "
            f"intact: {kept})"
        ) from None
    return final


def _structure(
    handle,
    places,
    params,
    optimizer_state,
    optimizer_steps,
    step,
    epoch,
    epoch_step,
    config_json,
    seed,
    workers,
    lineage,
    parent,
    best,
    elapsed,
    per_worker,
    dataset_fingerprint,
):
    """A checkpoint's groups, attributes and (empty, allocated) datasets; their ``(offset, array)`` in ``places``."""
    bulk.allocate(handle, "params", params, places)
    group = handle.create_group("optimizer")
    group.attrs["steps"] = int(optimizer_steps)
    for name, array in optimizer_state.items():
        bulk.allocate(group, name, array, places)
    handle.attrs.update(
        attributes(
            step,
            epoch,
            epoch_step,
            config_json,
            seed,
            workers,
            lineage,
            parent,
            best,
            elapsed,
            dataset_fingerprint,
        )
    )
    handle.attrs["format"] = FORMAT
    if per_worker:
        rows = handle.create_group(PER_WORKER)
        for name, array in per_worker.items():
            bulk.allocate(rows, name, array, places)


def attributes(
    step,
    epoch,
    epoch_step,
    config_json,
    seed,
    workers,
    lineage="",
    parent="",
    best=None,
    elapsed=0.0,
    dataset_fingerprint="",
):
    """A checkpoint's attributes beside its format, in either format: its position, settings, random streams."""
    attrs = {
        "step": int(step),
        "epoch": int(epoch),
        "epoch_step": int(epoch_step),
        "config": config_json,
        "lineage": lineage,
        "parent": parent or "",
        "elapsed": float(elapsed),
        "data_order": json.dumps(
            {
                "seed": int(seed),
                "epoch": int(epoch),
                "epoch_step": int(epoch_step),
                "workers": int(workers),
                "scheme": DATA_ORDER,
            }
        ),
        "rng": json.dumps({"seed": int(seed), "step": int(step), "scheme": RNG}),
    }
    if best:  # (a resumed run goes on judging against it)
        attrs["best"] = json.dumps(best)
    if dataset_fingerprint:
        attrs["dataset_fingerprint"] = dataset_fingerprint
    return attrs


def keep_as(path, name):
    """Keep checkpoint ``path`` also as ``name`` in its directory (replacing an older one atomically); the new path.

    A hard link costs no space and survives the pruning of ``path``; where the
    file system has no hard links, a copy.  Either goes aside first (a name
    pruning and ``--resume auto`` ignore), then is renamed into place.
    """
    path = Path(path)
    final = path.parent / name
    try:
        with atomic.replacing(final) as aside:
            aside.unlink(missing_ok=True)
            try:
                os.link(path, aside)
            except OSError:
                shutil.copyfile(path, aside)
    except OSError as err:
        raise RunError(
            f"best checkpoint {final} not kept: {os.strerror(err.errno) if err.errno else err}"
        ) from None
    return final


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


def _read(path, handle, read_arrays=True):
    def bad(item, problem):
        return UsageError(f"{path}: {item} {problem}")

    virtual = handle.attrs.get("format") == sharded.FORMAT  # (an index over part files)
    if handle.attrs.get("format") != FORMAT and not virtual:
        raise UsageError(f"{path}: not an mpidist checkpoint (no format attribute {FORMAT!r})")
    _verified(path, handle, share=(0, 1) if read_arrays else (0, 0))
    params = _array(handle, "params", bad, virtual=virtual)
    if params.ndim != 1 or params.dtype not in FLOATS:
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
        array = _array(group, name, bad, prefix="optimizer/", virtual=virtual)
        if array.shape != params.shape or array.dtype not in FLOATS:
            raise bad(
                f"optimizer/{printable(name)}",
                f"has shape {array.shape} and dtype {array.dtype}; it must "
                f"be flat like params {params.shape}",
            )
        arrays[name] = array
    rows = _per_worker_arrays(handle, params, bad)
    header = _header(path, handle, group, bad)
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
        _check_finite(path, item, array)
    return Checkpoint(
        path=path,
        params=loaded.pop("params"),
        optimizer_state=loaded,
        per_worker=per_worker or None,
        **header,
    )


def _check_finite(path, item, array, whose=""):
    """Refuse ``array`` (``item``: "params", an optimizer array's name, or a per-worker one) holding NaN or Inf."""
    if not np.isfinite(array).all():
        item = item if item == "params" or item.startswith(PER_WORKER) else f"optimizer/{printable(item)}"
        raise UsageError(
            f"{path}: {printable(item)} holds NaN or Inf ({int(np.count_nonzero(~np.isfinite(array)))} "
            f"of {whose}{array.size} values): it cannot be trained or evaluated from; resume an earlier "
            "checkpoint"
        )


def _header(path, handle, group, bad):
    """The checkpoint's attributes, checked: everything but its arrays, as :class:`Checkpoint`'s fields."""
    params = handle["params"]
    values = {name: _count(handle.attrs, name, bad) for name in ("step", "epoch", "epoch_step")}
    optimizer_steps = _count(group.attrs, "steps", bad, prefix="optimizer/")
    config = _json(handle.attrs, "config", bad)
    rng = _json(handle.attrs, "rng", bad) if "rng" in handle.attrs else {}
    seed = rng.get("seed", config.get("seed", 0))
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < LARGEST:
        raise bad("rng seed", f"is {shown(seed)}; it must be an integer from 0")
    lineage, parent = (_text(handle.attrs, name, bad) for name in ("lineage", "parent"))
    best = _best(_json(handle.attrs, "best", bad), values["step"], bad) if "best" in handle.attrs else None
    elapsed = handle.attrs.get("elapsed", 0.0)  # (older checkpoints have none: time starts again)
    if not isinstance(elapsed, (float, np.floating)) or not 0 <= elapsed < 1e12:
        raise bad("elapsed", f"is {shown(elapsed)}; it must be seconds, from 0")
    fingerprint = handle.attrs.get("dataset_fingerprint", "")  # (older checkpoints have none)
    if isinstance(fingerprint, bytes):
        fingerprint = fingerprint.decode("ascii", "replace")
    if not isinstance(fingerprint, str) or (fingerprint and not FINGERPRINT.fullmatch(fingerprint)):
        raise bad(
            "attribute dataset_fingerprint", f"is {shown(fingerprint)}; it must be a scheme and 64 hex digits"
        )
    return dict(
        optimizer_steps=optimizer_steps,
        config=config,
        seed=int(seed),
        lineage=lineage,
        parent=parent,
        best=best,
        elapsed=float(elapsed),
        dataset_fingerprint=fingerprint,
        num_params=params.size,
        dtype=params.dtype,
        **values,
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
    """Refuse a sharded checkpoint (``handle``, open, at ``path``) whose parts :func:`sharded.verify` finds wrong,
    their checksums read for ``share``; a checkpoint of one file passes."""
    problem = sharded.verify(path, handle, share) if handle.attrs.get("format") == sharded.FORMAT else None
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
            header = _header(
                path, handle, handle["optimizer"], lambda item, why: UsageError(f"{path}: {item} {why}")
            )
            _same(loaded, Checkpoint(path=path, params=None, optimizer_state={}, **header))
            for name, buffer in buffers.items():
                key = name if name == "params" else f"optimizer/{name}"
                host = isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous
                with reading(f"{path}: {key}"):
                    values = slices.read(
                        handle[key], placement, loaded.dtype, out=buffer[: placement.size] if host else None
                    )
                _check_finite(
                    path, name, values, whose="" if placement.size == loaded.num_params else "this rank's "
                )
                if not host:
                    _fill(buffer, values)
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as err:
        raise UsageError(f"{path}: not a readable checkpoint ({printable(err)})") from None


def _per_worker_arrays(handle, params, bad):
    """The ``workers/`` group's datasets, checked (not read): ``{name: dataset}``, every one ``(W, params.size)``."""
    if PER_WORKER not in handle:
        return {}
    if handle.get(PER_WORKER, getclass=True) is not h5py.Group:
        raise bad(PER_WORKER, "is not a group")
    rows, workers = {}, set()
    for name in handle[PER_WORKER]:
        array = _array(handle[PER_WORKER], name, bad, prefix=PER_WORKER + "/")
        if (
            array.ndim != 2
            or array.shape[1] != params.size
            or not 1 <= array.shape[0] <= MAX_WORKERS
            or array.dtype != params.dtype
        ):
            raise bad(
                f"{PER_WORKER}/{printable(name)}",
                f"has shape {array.shape} and dtype {array.dtype}; it must "
                f"hold one row like params {params.shape} {params.dtype} "
                "per worker",
            )
        rows[name] = array
        workers.add(array.shape[0])
    if len(workers) > 1:
        raise bad(PER_WORKER, f"holds rows for different worker counts ({sorted(workers)})")
    return rows


def _best(table, step, bad):
    """The ``best`` attribute, checked: a figure's name, a finite value, and a step no later than the checkpoint's."""
    figure, value, at = table.get("figure"), table.get("value"), table.get("step")
    if not (isinstance(figure, str) and 0 < len(figure) <= 64 and figure.isidentifier()):
        raise bad("attribute best", f"names figure {shown(figure)}; it must be a figure's name")
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)):
        raise bad("attribute best", f"has value {shown(value)}; it must be a finite number")
    if not (isinstance(at, int) and not isinstance(at, bool) and 0 <= at <= step):
        raise bad(
            "attribute best", f"has step {shown(at)}; it must be an integer from 0 to the checkpoint's {step}"
        )
    return {"figure": figure, "value": float(value), "step": at}


def _array(group, name, bad, prefix="", virtual=False):
    """The dataset ``name`` of ``group`` (not read yet), checked to be a plain numeric array in this file, or with
    ``virtual`` a virtual one (a sharded checkpoint's, whose sources :func:`sharded.verify` checked)."""
    link = group.get(name, getlink=True)
    if link is None:
        raise bad(prefix + printable(name), "is missing")
    if not isinstance(link, h5py.HardLink):
        raise bad(prefix + printable(name), "is a link to elsewhere; a checkpoint holds its arrays itself")
    item = group[name]
    if not isinstance(item, h5py.Dataset) or item.is_virtual != virtual or item.dtype.kind != "f":
        raise bad(prefix + printable(name), "is not an array of floats stored in this file")
    return item


def _count(attrs, name, bad, prefix=""):
    """A non-negative integer attribute."""
    value = attrs.get(name)
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if (
        isinstance(value, (np.integer, int))
        and not isinstance(value, (bool, np.bool_))
        and 0 <= value < LARGEST
    ):
        return int(value)
    raise bad(f"attribute {prefix}{name}", f"is {shown(value)}; it must be an integer from 0")


def _json(attrs, name, bad):
    value = attrs.get(name)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    try:
        table = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        table = None
    if not isinstance(table, dict):
        raise bad(f"attribute {name}", "is not a JSON object")
    return table


def _text(attrs, name, bad):
    value = attrs.get(name, "")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or (value and not lineages.LINEAGE.fullmatch(value)):
        raise bad(f"attribute {name}", f"is {shown(value)}; a lineage id is 8 hex digits")
    return value


def settings_of(path):
    """The settings checkpoint ``path`` was written with (its ``config`` attribute, read alone), or None where
    they cannot be read (the file is untrusted: :func:`load` checks the whole of it)."""
    if not is_regular_file(path):
        return None
    try:
        with h5py.File(path, "r") as handle:
            return _json(handle.attrs, "config", lambda item, why: ValueError(why))
    except (OSError, ValueError, RuntimeError, KeyError, TypeError):
        return None


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


def prepare_directory(directory):
    """Create ``directory`` if needed and check it is writable (chief, at start-up)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--checkpoint-dir {directory}: cannot create ({err.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--checkpoint-dir {directory}: not writable")
