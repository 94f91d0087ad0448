"""Writing a checkpoint file (format 1): its groups and attributes, written aside and renamed, so a crash
never corrupts one.

What a checkpoint holds, and why its random streams need no more than a seed
and a position, is :mod:`mpidist.store.checkpoint`'s text; reading one back is
that module's too.  Writing is apart from reading because the two trust
differently: what a run writes it made itself, what it reads is an untrusted
file, every item checked (:mod:`mpidist.store.checkpoint_checks`).  The names
laid out here (:data:`FORMAT`, the ``optimizer/`` and ``workers/`` groups, the
attributes, which a sharded checkpoint's index shares) are the ones the
reading checks for.
"""

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from ..runtime.errors import RunError, UsageError
from . import atomic, bulk, removal, sharded
from . import lineage as lineages

FORMAT = "mpidist-checkpoint-1"
#: what each optimizer keeps, one flat array per name (a checkpoint's optimizer/ group)
OPTIMIZER_STATE = {"adam": ("m", "v"), "sgd": ("velocity",)}
PER_WORKER = "workers"  # the group of each worker's own state

#: the data order a checkpoint's position is a place in, and the rows --val-fraction holds out (its
#: ``data_order`` attribute's ``scheme``): a run resumed under another is told what that changes
DATA_ORDER = (
    "lanes of the global batch as contiguous ranges, each cut into units of a quarter of its share of the "
    "settings' shuffle_buffer (at most 4 MiB of the sample's values in float32, whatever the files' chunks) "
    "and ordered per epoch in windows of units by keyed Feistel permutations of (seed, epoch, lane); step s "
    "takes sample s of each; val_fraction holds out ceil(F n) of the n training rows, each block of 4096 "
    "rows its share, drawn by keyed Feistel permutations of (seed, block)"
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
    parameters=(),
):
    """Write ``ckpt-<step>-<lineage>.h5`` in ``directory`` atomically; returns its path.

    ``seed`` and the position fix the data order, and with ``workers`` the random streams (see
    :mod:`mpidist.store.checkpoint`).
    ``per_worker``: each worker's own state where the workers' differ (name ->
    ``(workers, params.size)`` array), written in the group ``workers/``.
    ``dataset_fingerprint`` (:func:`mpidist.data.fingerprint.fingerprint`) tells the dataset it
    trained on from another under the same name.  ``parameters``: the model's ``(name, shape, offset)``
    (:func:`mpidist.loop.sharded_save.parameters`), each read by name under ``parameters/`` as a view of
    ``params`` (:func:`~mpidist.store.sharded.name_parameters`).
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
                if parameters:  # (views of params: no bytes of their own)
                    sharded.name_parameters(handle, parameters, np.asarray(params).dtype, len(params))
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
    """A checkpoint's groups, attributes and (empty, allocated) datasets; their ``(offset, array)`` in
    ``places``."""
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
    """A checkpoint's attributes beside its format, in either format: its position, settings, random
    streams."""
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
    """Keep checkpoint ``path`` also as ``name`` in its directory (replacing an older one atomically); the new
    path.

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


def prepare_directory(directory):
    """Create ``directory`` if needed and check it is writable (chief, at start-up); returns the directories
    made, innermost first (:func:`remove_unused`)."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        broken = os.path.islink(directory) and not os.path.exists(directory)
        what = "a symbolic link to nothing" if broken else "not a directory"
        raise UsageError(f"--checkpoint-dir {directory}: exists and is {what}")
    try:
        made = removal.make_directories(directory)
    except OSError as err:
        raise UsageError(f"--checkpoint-dir {directory}: cannot create ({err.strerror})") from None
    if not os.access(directory, os.W_OK):
        raise UsageError(f"--checkpoint-dir {directory}: not writable")
    return made


def remove_unused(made):
    """Take back the checkpoint directories :func:`prepare_directory` made for a run refused at start-up:
    those that hold nothing but the directory's lock."""
    removal.remove_made(made, own=re.compile(re.escape(lineages.LOCK_NAME)))
