"""The checks of a checkpoint file read back: every item of an untrusted file, before it is used.

A checkpoint may be damaged, truncated, from another program, or written by
hand, so nothing in it is taken on trust: its arrays' links, shapes and
dtypes are checked before they are read, their values for NaN and Inf after,
and its attributes for size before they are read
(:class:`~mpidist.store.bounded.Attributes`), for type and range after.  Each
check names the file, the item and the value; ``bad(item, problem)`` makes
the error (a :class:`UsageError` where a checkpoint is loaded).  Reading,
which calls these, is :mod:`mpidist.store.checkpoint`'s; the names checked
for are the ones :mod:`mpidist.store.checkpoint_save` writes.
"""

import json
import math
import re

import h5py
import numpy as np

from ..runtime.errors import UsageError
from ..runtime.text import printable, shown
from . import bounded
from . import lineage as lineages
from .checkpoint_save import PER_WORKER

FLOATS = (np.dtype("float32"), np.dtype("float64"))
LARGEST = 2**62  # step counts and seeds above this cannot be honest
# "<scheme>:<hex digest>" (mpidist.data.fingerprint)
FINGERPRINT = re.compile(r"[0-9a-z-]{1,16}:[0-9a-f]{64}")
MAX_WORKERS = 1 << 20  # rows of per-worker state a checkpoint may claim


FINITE_BLOCK = 1 << 20  # values checked at once: a whole array's mask would be as large as a model


def check_finite(path, item, array, whose=""):
    """Refuse ``array`` (``item``: "params", an optimizer array's name, or a per-worker one) holding NaN or
    Inf."""
    flat = array.reshape(-1)
    bad = sum(
        int(np.count_nonzero(~np.isfinite(flat[lo : lo + FINITE_BLOCK])))
        for lo in range(0, flat.size, FINITE_BLOCK)
    )
    if bad:
        item = item if item == "params" or item.startswith(PER_WORKER) else f"optimizer/{printable(item)}"
        raise UsageError(
            f"{path}: {printable(item)} holds NaN or Inf ({bad} of {whose}{array.size} values): it cannot be "
            "trained or evaluated from; resume an earlier checkpoint"
        )


def header(path, handle, group, bad):
    """The checkpoint's attributes, checked: everything but its arrays, as
    :class:`~mpidist.store.checkpoint.Checkpoint`'s fields."""
    params, attrs = handle["params"], bounded.Attributes(handle, bad)
    values = {name: count_attribute(attrs, name, bad) for name in ("step", "epoch", "epoch_step")}
    optimizer_steps = count_attribute(bounded.Attributes(group, bad), "steps", bad, prefix="optimizer/")
    config = json_attribute(attrs, "config", bad)
    rng = json_attribute(attrs, "rng", bad) if "rng" in attrs else {}
    seed = rng.get("seed", config.get("seed", 0))
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < LARGEST:
        raise bad("rng seed", f"is {shown(seed)}; it must be an integer from 0")
    lineage, parent = (lineage_attribute(attrs, name, bad) for name in ("lineage", "parent"))
    best = (
        best_attribute(json_attribute(attrs, "best", bad), values["step"], bad) if "best" in attrs else None
    )
    elapsed = attrs.get("elapsed", 0.0)  # (older checkpoints have none: time starts again)
    if not isinstance(elapsed, (float, np.floating)) or not 0 <= elapsed < 1e12:
        raise bad("elapsed", f"is {shown(elapsed)}; it must be seconds, from 0")
    order = json_attribute(attrs, "data_order", bad) if "data_order" in attrs else {}
    scheme = order.get("scheme", "")  # (the data order its position is in: "" where it says none)
    if not isinstance(scheme, str) or len(scheme) > 4096:
        raise bad("attribute data_order", f"has scheme {shown(scheme)}; it must be a text of the order")
    fingerprint = attrs.get("dataset_fingerprint", "")  # (older checkpoints have none)
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
        data_order=scheme,
        num_params=params.size,
        dtype=params.dtype,
        **values,
    )


def per_worker_arrays(handle, params, bad):
    """The ``workers/`` group's datasets, checked (not read): ``{name: dataset}``, every one ``(W,
    params.size)``."""
    if PER_WORKER not in handle:
        return {}
    if handle.get(PER_WORKER, getclass=True) is not h5py.Group:
        raise bad(PER_WORKER, "is not a group")
    rows, workers = {}, set()
    for name in handle[PER_WORKER]:
        array = float_array(handle[PER_WORKER], name, bad, prefix=PER_WORKER + "/")
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


def best_attribute(table, step, bad):
    """The ``best`` attribute, checked: a figure's name, a finite value, and a step no later than the
    checkpoint's."""
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


def float_array(group, name, bad, prefix="", virtual=False):
    """The dataset ``name`` of ``group`` (not read yet), checked to be a plain numeric array in this file, or
    with ``virtual`` a virtual one (a sharded checkpoint's, whose sources
    :func:`~mpidist.store.sharded.verify` checked)."""
    link = group.get(name, getlink=True)
    if link is None:
        raise bad(prefix + printable(name), "is missing")
    if not isinstance(link, h5py.HardLink):
        raise bad(prefix + printable(name), "is a link to elsewhere; a checkpoint holds its arrays itself")
    item = group[name]
    if not isinstance(item, h5py.Dataset) or item.is_virtual != virtual or item.dtype.kind != "f":
        raise bad(prefix + printable(name), "is not an array of floats stored in this file")
    return item


def count_attribute(attrs, name, bad, prefix=""):
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


def json_attribute(attrs, name, bad):
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


def lineage_attribute(attrs, name, bad):
    value = attrs.get(name, "")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str) or (value and not lineages.LINEAGE.fullmatch(value)):
        raise bad(f"attribute {name}", f"is {shown(value)}; a lineage id is 8 hex digits")
    return value


#: parameters a checkpoint's ``parameters/`` group may name (a model of more tensors is not one anyone trains)
MAX_NAMED = 1 << 20


def named_parameters(handle, params, bad):
    """The ``(name, shape)`` of each parameter a checkpoint's ``parameters/`` group names, in name order
    (its shapes only are read, never a value), or None where it has none (older checkpoints); refused where
    they are not the whole of ``params``."""
    group = handle.get("parameters", getclass=True)
    if group is None:
        return None
    if group is not h5py.Group:
        raise bad("parameters", "is not a group of the model's parameters")
    group = handle["parameters"]
    if len(group) > MAX_NAMED:
        raise bad("parameters", f"names {len(group):,} parameters, more than {MAX_NAMED:,}")
    named, total = [], 0
    for name in sorted(group):
        shape = group[name].shape if group.get(name, getclass=True) is h5py.Dataset else None
        if shape is None:
            raise bad(f"parameters/{printable(name)}", "is not a parameter's array")
        named.append((str(name), tuple(int(extent) for extent in shape)))
        total += math.prod(named[-1][1])  # (Python's integers: a crafted shape cannot wrap round)
    if total != params.size:
        raise bad("parameters", f"name {total:,} values in all, where params holds {params.size:,}")
    return tuple(named)
