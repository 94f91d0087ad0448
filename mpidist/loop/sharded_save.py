"""A sharded checkpoint, written by the ranks that hold the model: no rank gathers it whole.

Collective over the ranks that train.  The chief names a fresh parts folder
(:func:`mpidist.store.sharded.parts_folder`); every rank that writes regions
of the model (:class:`~mpidist.nn.placement.Placement`: the first replica's
stages, the first tensor group's parts) writes its part file there; the ranks
agree that every part is on disk (one failure fails the checkpoint on every
rank, and the chief removes the folder); then the chief writes the index and
renames it into place, prunes, and removes the parts folders no index names.
A rank killed mid-write leaves no index under a checkpoint's name: the
previous checkpoint stays the newest, and the folder is removed at the next
start.
"""

import os
import secrets
from pathlib import Path

import numpy as np
from ..runtime import comm as mpi
from ..runtime.errors import RunError
from ..store import checkpoint, sharded
from ..store.lineage import CheckpointDir, file_name


def parameters(whole):
    """The whole model's ``(name, shape, offset)`` in entry order, as the index stores them."""
    return [(sharded.parameter_name(entry, type(layer).__name__, name), tuple(shape), int(offset))
            for entry, (layer, name, offset, shape, _) in enumerate(whole.entries)]


def write_sharded(checkpointer, comm, placement, arrays, optimizer_steps, where, root, best=None):
    """Collective over ``comm``: write the checkpoint of ``where`` (``(step, epoch, epoch_step, workers)``)
    from each rank's ``arrays`` (``"params"`` and ``"optimizer/<name>"``: the rank's host buffers, ordered as
    ``placement``); the index's path on the chief (rank ``root`` of ``comm``), None elsewhere.

    A part that cannot be written raises :class:`RunError` on every rank, naming the rank and the reason.
    """
    step, epoch, epoch_step, workers = where
    config, chief = checkpointer.config, comm.Get_rank() == root
    directory = config.checkpoint_dir
    index = Path(directory) / file_name(step, checkpointer.lineage)
    folder = sharded.parts_folder(index, mpi.bcast_text(comm, secrets.token_hex(8) if chief else "", root))
    rows = placement.describe()
    reason = ""
    try:
        if chief:
            folder.mkdir()
        comm.Barrier()   # (the folder exists before any rank writes into it)
        record = None
        if rows.size:
            part = folder / sharded.part_name(comm.Get_rank())
            record = sharded.write_part(part, rows, {key: placement.pieces(array) for key, array in arrays.items()})
    except OSError as err:
        reason = f"rank {comm.Get_rank()}: {os.strerror(err.errno) if err.errno else err}"
    failed = mpi.allreduce_max(comm, np.array([1 if reason else 0], dtype=np.int64))   # (any rank's, everywhere)
    reasons = [text for text in comm.allgather(reason) if text] if failed[0] else []
    if reasons:
        if chief and folder.is_dir():
            sharded.remove_parts(folder)
        raise RunError(f"checkpoint of step {step} not written to {directory}: {'; '.join(reasons)} (the "
                       "checkpoints written before it are intact)")
    # (small: a file name, a few integers a region, a checksum; pickled, as nothing here was read from a file)
    written = comm.gather((folder.name + "/" + sharded.part_name(comm.Get_rank()), rows, record), root=root)
    if not chief:
        return None
    parts = [part for part in written if part[2] is not None]
    attrs = checkpoint.attributes(step, epoch, epoch_step, config.to_json(), config.seed, workers,
                                  checkpointer.lineage, checkpointer.parent, best, checkpointer.run_time(),
                                  checkpointer.dataset_fingerprint or "")
    dtype = next(iter(arrays.values())).dtype
    try:
        sharded.write_index(index, parameters(placement.whole), parts, list(arrays), dtype,
                            {**attrs, "optimizer": {"steps": int(optimizer_steps)}})
    except OSError as err:
        sharded.remove_parts(folder)
        raise RunError(f"checkpoint of step {step} not written to {directory}: "
                       f"{os.strerror(err.errno) if err.errno else err}") from None
    CheckpointDir(directory).prune(checkpointer.lineage, config.keep, newest=index)
    sharded.remove_unnamed_folders(directory)
    return index
