"""HDF5 checkpoints: written aside and renamed, so a crash never corrupts one.

A checkpoint holds the flat parameters, the optimizer's flat state arrays
and step count, the global step, the epoch and step within it, the data-order
and RNG state, and the run's config as JSON.  Parameters are stored flat, so a
checkpoint does not depend on how many workers wrote it.

mpidist's random streams are counter-based, so their state is small: the
data order of an epoch is a permutation drawn from ``(seed, epoch, worker)``
and dropout masks come from ``(seed, worker, step)``.  The checkpoint records
the seed, position and worker count that fix them, so a resumed run draws the
very numbers the interrupted one would have (with the same worker count).
"""

import dataclasses
import json
import os
import re
from pathlib import Path

import h5py
import numpy as np

from .errors import RunError, UsageError

PATTERN = re.compile(r"^ckpt-(\d{8})\.h5$")


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
    seed: int = 0           # the seed of the data order and random streams


DATA_ORDER = "strided shards w::W, one permutation per epoch from (seed, epoch, worker)"
RNG = "counter-based: dropout reseeded each step from (seed, worker, step)"


def save(directory, params, optimizer_state, optimizer_steps, step, epoch, epoch_step, config_json, seed,
         workers):
    """Write ``ckpt-<step>.h5`` in ``directory`` atomically; returns its path.

    ``seed`` and ``workers`` fix the data order and random streams (see the module text).
    A write that fails (a full disk, a quota) raises :class:`RunError` with the
    reason; the file written aside is removed and every older checkpoint is intact.
    """
    directory = Path(directory)
    final = directory / f"ckpt-{step:08d}.h5"
    aside = directory / f".{final.name}.tmp-{os.getpid()}"
    try:
        with h5py.File(aside, "w") as handle:
            handle.create_dataset("params", data=params)
            group = handle.create_group("optimizer")
            group.attrs["steps"] = int(optimizer_steps)
            for name, array in optimizer_state.items():
                group.create_dataset(name, data=array)
            handle.attrs.update({"step": int(step), "epoch": int(epoch), "epoch_step": int(epoch_step),
                                 "config": config_json, "format": "mpidist-checkpoint-1",
                                 "data_order": json.dumps({"seed": int(seed), "epoch": int(epoch),
                                                           "epoch_step": int(epoch_step), "workers": int(workers),
                                                           "scheme": DATA_ORDER}),
                                 "rng": json.dumps({"seed": int(seed), "step": int(step), "scheme": RNG})})
        with open(aside, "rb+") as raw:  # data on disk before the rename makes it visible
            os.fsync(raw.fileno())
        os.replace(aside, final)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:   # h5py wraps errno in a long message: say the reason, and what is kept
        reason = os.strerror(err.errno) if err.errno else str(err)
        kept = ", ".join(p.name for p in listed(directory)) or "none"
        raise RunError(f"checkpoint of step {step} not written to {directory}: {reason} (checkpoints there, "
                       f"intact: {kept})") from None
    finally:
        if aside.exists():
            aside.unlink()
    return final


def load(path):
    """Read a checkpoint file; a missing or unreadable one is a :class:`UsageError`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such checkpoint file")
    try:
        with h5py.File(path, "r") as handle:
            if handle.attrs.get("format") != "mpidist-checkpoint-1":
                raise UsageError(f"{path}: not an mpidist checkpoint")
            group = handle["optimizer"]
            config = json.loads(handle.attrs["config"])
            rng = json.loads(handle.attrs.get("rng", "{}"))
            return Checkpoint(path=path, params=handle["params"][...],
                              optimizer_state={name: group[name][...] for name in group},
                              optimizer_steps=int(group.attrs["steps"]), step=int(handle.attrs["step"]),
                              epoch=int(handle.attrs["epoch"]), epoch_step=int(handle.attrs["epoch_step"]),
                              config=config, seed=int(rng.get("seed", config.get("seed", 0))))
    except (OSError, KeyError, ValueError) as err:
        raise UsageError(f"{path}: not a readable checkpoint ({err})") from None


def listed(directory):
    """Checkpoint files in ``directory``, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if PATTERN.match(p.name))


def newest(directory):
    """The newest checkpoint file in ``directory`` (by step), or None."""
    found = listed(directory)
    return found[-1] if found else None


def newest_valid(directory):
    """``(newest checkpoint that loads, [(path, reason) for newer ones that did not])``.

    A run killed while writing leaves no half file under a checkpoint name
    (files are renamed into place), but a disk can still corrupt one: the
    previous checkpoint is used then, and the caller reports the skipped file.
    """
    skipped = []
    for path in reversed(listed(directory)):
        try:
            return load(path), skipped
        except UsageError as err:
            skipped.append((path, str(err)))
    return None, skipped


def prune(directory, keep):
    """Delete all but the newest ``keep`` checkpoints; returns the paths removed."""
    old = listed(directory)[:-keep] if keep > 0 else []
    for path in old:
        path.unlink(missing_ok=True)
    return old


def prepare_directory(directory):
    """Create ``directory`` if needed and check it is writable (chief, at start-up)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--checkpoint-dir {directory}: cannot create ({err.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--checkpoint-dir {directory}: not writable")
