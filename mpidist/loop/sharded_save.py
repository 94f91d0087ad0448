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
writes the index (:class:`ShardedIndex`: what it says is fixed when the
checkpoint begins) and renames it into place, prunes, and removes the parts
folders pruning left unnamed -- behind training too, where asked.  A rank
killed mid-write leaves no index under a checkpoint's name: the previous
checkpoint stays the newest, and the folder is removed at the next start.
"""

import os
import secrets
import time

import numpy as np
from ..runtime import comm as mpi
from ..runtime.errors import RunError
from ..store import atomic, parts_debris, sharded
from .writer import BehindWrite


def parameters(whole):
    """The whole model's ``(name, shape, offset)`` in entry order, as every checkpoint stores them under
    ``parameters/`` (:meth:`~mpidist.nn.parameter_map.ParameterMap.parameter_names`)."""
    return [
        (name, tuple(shape), int(offset))
        for name, (_, _, offset, shape, _) in zip(whole.parameter_names(), whole.entries)
    ]


def _reason(err, rank):
    return f"rank {rank}: {os.strerror(err.errno) if err.errno else err}"


class ShardedIndex:
    """What a sharded checkpoint's index says, fixed when the checkpoint begins, and where it goes: the chief
    writes it over the parts once every rank's is on disk.

    Args:
        path: the index's file (the checkpoint's name).
        placement: this rank's :class:`~mpidist.nn.placement.Placement` (the whole model's parameters).
        placed: this rank's :class:`~mpidist.parallel.saved_state.PlacedState` (the state's keys and dtype,
            the optimizer's steps).
        attrs: what the checkpoint stores beside the state
            (:meth:`~mpidist.loop.checkpoint_files.CheckpointFiles.attributes`).
    """

    def __init__(self, path, placement, placed, attrs):
        arrays = placed.arrays
        self.path, self.whole = path, placement.whole
        self.keys, self.dtype = list(arrays), next(iter(arrays.values())).dtype
        self.attrs = {**attrs, "optimizer": {"steps": int(placed.steps)}}

    def write(self, parts):
        """The index over ``parts`` (each ``(file, rows, record)``), renamed into place."""
        sharded.write_index(self.path, parameters(self.whole), parts, self.keys, self.dtype, self.attrs)


class ShardedWrite:
    """One sharded checkpoint, begun (collective over ``comm``) when made; :meth:`complete` ends it.

    Args:
        files: the run lineage's :class:`~mpidist.loop.checkpoint_files.CheckpointFiles` (where the index
            goes, what it stores beside the state, pruning).
        comm, root: the ranks that train, and the chief's rank among them.
        placement: this rank's :class:`~mpidist.nn.placement.Placement`.
        placed: this rank's :class:`~mpidist.parallel.saved_state.PlacedState` (its buffers, as
            ``placement``).
        where, best: ``(step, epoch, epoch_step, workers)`` and the ``--keep-best`` record, stored in the
            index.
        behind: sync the parts and write the index in threads, while training goes on.
        elapsed: the run's time so far, stored in the index.
    """

    def __init__(self, files, comm, placement, placed, where, root, best=None, behind=False, elapsed=0.0):
        self.files, self.comm, self.root, self.where = files, comm, root, where
        self.chief, self.behind = comm.Get_rank() == root, behind
        path = files.path(where[0])
        token = mpi.bcast_text(comm, secrets.token_hex(8) if self.chief else "", root)
        self.folder = sharded.parts_folder(path, token)
        arrays = placed.arrays
        self.rows = placement.describe()
        self.index = ShardedIndex(path, placement, placed, files.attributes(where, best, elapsed))
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
        """Collective over ``comm``: agree that every part is on disk and write the index (on the chief).
        Returns the index's path on the chief, or (behind training) the :class:`BehindWrite` writing it; None
        elsewhere.

        A part that could not be written raises :class:`RunError` on every rank, naming the rank and the
        reason."""
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
                parts_debris.remove_parts(self.folder)
            raise RunError(
                f"checkpoint of step {self.where[0]} not written to {self.index.path.parent}: "
                f"{'; '.join(reasons)} (the checkpoints written before it are intact)"
            )
        # (small: a file name, a few integers a region, a checksum; pickled, as nothing here was read from a
        # file)
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
        """Chief: the index over ``parts``, renamed into place; prune; the folders pruning left unnamed
        removed."""
        index = self.index.path
        directory = index.parent
        try:
            self.index.write(parts)
        except OSError as err:
            parts_debris.remove_parts(self.folder)
            raise RunError(
                f"checkpoint of step {self.where[0]} not written to {directory}: "
                f"{os.strerror(err.errno) if err.errno else err}"
            ) from None
        pruned = self.files.prune(index)
        # (its folder: known here)
        parts_debris.remove_replaced_folders(directory, index, self.folder, pruned)
        return index
