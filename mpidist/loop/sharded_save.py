"""A sharded checkpoint, written by the ranks that hold the model: no rank gathers it whole.

Collective over the ranks that train, in two halves.  :class:`ShardedWrite`
begins it: the chief names a fresh parts folder
(:func:`mpidist.store.sharded.parts_folder`), and every rank that writes
regions of the model (:class:`~mpidist.nn.placement.Placement`: the first
replica's stages, the first tensor group's parts) hands its part's content to
the operating system, aside (a copy in the page cache, so training may change
its arrays at once).  Syncing the part to disk, renaming it into place and
checksumming it is slow (a disk's, not a step's, time), and a thread does it
where the checkpoint is written behind training.  :meth:`ShardedWrite.complete`
ends it: the ranks agree that every part is on disk (one failure fails the
checkpoint on every rank, and the chief removes the folder); then the chief
writes the index and renames it into place, prunes, and removes the parts
folders pruning left unnamed -- behind training too, where asked.  A rank
killed mid-write leaves no index under a checkpoint's name: the previous
checkpoint stays the newest, and the folder is removed at the next start.
"""

import os
import secrets
import time
from pathlib import Path

import numpy as np
from ..runtime import comm as mpi
from ..runtime.errors import RunError
from ..store import atomic, checkpoint_save, sharded
from ..store.lineage import CheckpointDir, file_name
from .writer import BehindWrite


def parameters(whole):
    """The whole model's ``(name, shape, offset)`` in entry order, as the index stores them."""
    return [
        (sharded.parameter_name(entry, type(layer).__name__, name), tuple(shape), int(offset))
        for entry, (layer, name, offset, shape, _) in enumerate(whole.entries)
    ]


def _reason(err, rank):
    return f"rank {rank}: {os.strerror(err.errno) if err.errno else err}"


class ShardedWrite:
    """One sharded checkpoint, begun (collective over ``comm``) when made; :meth:`complete` ends it.

    Args:
        checkpointer: the run's :class:`~mpidist.loop.checkpointer.Checkpointer` (its settings, lineage, clock).
        comm, root: the ranks that train, and the chief's rank among them.
        placement: this rank's :class:`~mpidist.nn.placement.Placement`.
        placed: this rank's :class:`~mpidist.parallel.saved_state.PlacedState` (its buffers, as ``placement``).
        where, best: ``(step, epoch, epoch_step, workers)`` and the ``--keep-best`` record, stored in the index.
        behind: sync the parts and write the index in threads, while training goes on.
    """

    def __init__(self, checkpointer, comm, placement, placed, where, root, best=None, behind=False):
        self.checkpointer, self.comm, self.root, self.where = checkpointer, comm, root, where
        self.chief, self.behind = comm.Get_rank() == root, behind
        directory = checkpointer.config.checkpoint_dir
        self.index = Path(directory) / file_name(where[0], checkpointer.lineage)
        token = mpi.bcast_text(comm, secrets.token_hex(8) if self.chief else "", root)
        self.folder = sharded.parts_folder(self.index, token)
        arrays = placed.arrays
        self.rows, self.keys = placement.describe(), list(arrays)
        self.dtype = next(iter(arrays.values())).dtype
        self.whole = placement.whole
        self.index_attrs = {
            **checkpoint_save.attributes(
                where[0],
                where[1],
                where[2],
                checkpointer.config.to_json(),
                checkpointer.config.seed,
                where[3],
                checkpointer.lineage,
                checkpointer.parent,
                best,
                checkpointer.run_time(),
                checkpointer.dataset_fingerprint or "",
            ),
            "optimizer": {"steps": int(placed.steps)},
        }
        self.reason, self.part = "", None
        try:
            if self.rows.size:
                self.folder.mkdir(exist_ok=True)  # (by each rank that writes: none waits for another)
                self._begin_part({key: placement.pieces(array) for key, array in arrays.items()})
        except OSError as err:
            self.reason = _reason(err, comm.Get_rank())

    def _begin_part(self, pieces):
        path = self.folder / sharded.part_name(self.comm.Get_rank())
        aside = atomic.fresh_aside(path)
        copying = time.thread_time()
        try:
            sharded.write_part_aside(aside, self.rows, pieces)
        except BaseException:
            atomic.remove_aside(aside)
            raise

        def commit():
            try:
                return sharded.commit_part(aside, path)
            finally:
                atomic.remove_aside(aside)

        if self.behind:
            self.part = BehindWrite(commit, self.where[:2], time.thread_time() - copying)
        else:
            self.part = commit()

    @property
    def writing(self):
        """Whether this rank's part is still being synced (a thread's work, behind training)."""
        return isinstance(self.part, BehindWrite) and self.part.is_alive()

    def complete(self):
        """Collective over ``comm``: agree that every part is on disk and write the index (on the chief). Returns
        the index's path on the chief, or (behind training) the :class:`BehindWrite` writing it; None elsewhere.

        A part that could not be written raises :class:`RunError` on every rank, naming the rank and the reason.
        """
        record, comm = self.part, self.comm
        if isinstance(record, BehindWrite):
            try:
                record = record.result()
            except OSError as err:
                self.reason = self.reason or _reason(err, comm.Get_rank())
                record = None
        failed = mpi.allreduce_max(comm, np.array([1 if self.reason else 0], dtype=np.int64))
        reasons = [text for text in comm.allgather(self.reason) if text] if failed[0] else []
        if reasons:
            if self.chief and self.folder.is_dir():
                sharded.remove_parts(self.folder)
            raise RunError(
                f"checkpoint of step {self.where[0]} not written to {self.index.parent}: "
                f"{'; '.join(reasons)} (the checkpoints written before it are intact)"
            )
        # (small: a file name, a few integers a region, a checksum; pickled, as nothing here was read from a file)
        written = comm.gather(
            (self.folder.name + "/" + sharded.part_name(comm.Get_rank()), self.rows, record), root=self.root
        )
        if not self.chief:
            return None
        parts = [part for part in written if part[2] is not None]
        if self.behind:
            return BehindWrite(lambda: self._write_index(parts), self.where[:2])
        return self._write_index(parts)

    def _write_index(self, parts):
        """Chief: the index over ``parts``, renamed into place; prune; the folders pruning left unnamed removed."""
        directory = self.index.parent
        try:
            sharded.write_index(
                self.index, parameters(self.whole), parts, self.keys, self.dtype, self.index_attrs
            )
        except OSError as err:
            sharded.remove_parts(self.folder)
            raise RunError(
                f"checkpoint of step {self.where[0]} not written to {directory}: "
                f"{os.strerror(err.errno) if err.errno else err}"
            ) from None
        config = self.checkpointer.config
        pruned = CheckpointDir(directory).prune(self.checkpointer.lineage, config.keep, newest=self.index)
        sharded.remove_replaced_folders(
            directory, self.index, self.folder, pruned
        )  # (its folder: known here)
        return self.index
