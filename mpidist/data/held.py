"""A worker's training samples held in memory, as whole virtual shards (:mod:`mpidist.data.virtual`).

Virtual shard ``v`` of ``V`` is the strided set of rows ``v, v+V, ...`` (every
class, even in a file sorted by label).  A worker holds the shards its piece
of the epoch touches, whole (a piece may begin and end inside a shard, whose
order changes every epoch): about ``n / W`` rows and at most two shards more.
It reads them at set-up, and again at an epoch's start only where its piece
touches other shards (the first epoch after the worker count changed).
"""

import numpy as np

from ..runtime.memory import check_fits
from . import virtual
from .batches import Prefetcher
from .rows import SplitRows
from .samples import footprint


class HeldShards:
    """The training split's virtual shards this worker needs, in memory.

    Args: as :class:`~mpidist.data.Shard`'s (``info``, ``split``, ``input_shape``, ``dtype``).
    """

    mode = "memory"

    def __init__(self, info, split, input_shape, dtype):
        self.info, self.source = info, SplitRows(info, split, input_shape, dtype)
        self.shard_sizes = virtual.memory_sizes(self.source.count)
        self.shards = ()                 # the virtual shards held, increasing
        self.rows = np.empty(0, dtype=np.int64)     # the split's rows held, increasing
        self.x = self.y = None

    def __len__(self):
        return len(self.rows)

    def hold(self, piece):
        """Hold the shards ``piece`` (this worker's intervals) touches, and only them; reads what is missing."""
        shards = tuple(sorted(set(piece[:, 0].tolist())))
        if shards == self.shards:
            return
        count = self.source.count
        rows = np.sort(np.concatenate([virtual.memory_rows(count, v) for v in shards] or [np.empty(0, np.int64)]))
        self.x = self.y = None      # (let go of the shards held before reading others)
        check_fits(footprint(len(rows), self.info, self.source.group, self.source.dtype),
                   f"{self.info.path}: {self.source.group} ({len(rows):,} rows of "
                   f"{int(np.prod(self.info.sample_shape)):,} values for this worker)")
        self.x, self.y = self.source.read(rows)
        self.shards, self.rows = shards, rows

    def sequence(self, piece, seed, epoch):
        """The split's row numbers of ``piece`` in the order they are trained on."""
        count, parts = self.source.count, []
        for shard, lo, hi in piece.tolist():
            rows = virtual.memory_rows(count, shard)
            parts.append(rows[virtual.shard_order(len(rows), seed, epoch, shard)[lo:hi]])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def batches(self, local_batch, piece, seed, epoch, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of ``piece`` from step ``skip`` on, prefetched (``last_epoch``: unused here)."""
        self.hold(piece)
        index = np.searchsorted(self.rows, self.sequence(piece, seed, epoch))
        steps = len(index) // local_batch

        def batches():
            for step in range(skip, steps):
                at = index[step * local_batch:(step + 1) * local_batch]
                yield self.x[at], self.y[at]

        return Prefetcher(batches())
