"""A worker's training samples streamed, as virtual shards of chunk-aligned blocks (:mod:`mpidist.data.virtual`).

The whole split is cut into blocks as a :class:`~mpidist.data.Stream` cuts a
part (whole chunks, about a block's bytes; slices of one compressed chunk stay
together), and block ``b`` goes to virtual shard ``b mod V``: a shard's blocks
are spread over the whole split (every class, even in a file sorted by
label).  ``V`` is :data:`~mpidist.data.virtual.VIRTUAL_SHARDS`, or fewer so
that every shard holds a shuffle buffer's worth of samples and a block: it
depends on the files and the buffer, never on the worker count.

Each epoch a shard's blocks are ordered and grouped into windows of at least
the buffer, and each window's samples permuted, as a stream's are, seeded by
``(seed, epoch, shard)``: that is the shard's order.  A worker reads the
windows its piece of the epoch covers, one after the other, with a stream's
bounded memory (:data:`~mpidist.data.stream.WINDOWS` windows); a window a
piece begins or ends in is read by the two workers whose pieces share it.
"""

import numpy as np

from . import virtual
from .batches import Prefetcher
from .stream import Stream, _close, _joined, epoch_windows, window_order


class StreamedShards(Stream):
    """The training split streamed as virtual shards.  Arguments as :class:`~mpidist.data.Stream`'s, less the worker."""

    def __init__(self, info, split, input_shape, dtype, buffer=0, direct=False, sliced=False):
        super().__init__(info, split, 0, 1, input_shape, dtype, buffer, direct, sliced)
        groups = self.groups if self.groups is not None else np.arange(len(self.sizes))
        count = max(1, min(virtual.VIRTUAL_SHARDS, int(groups[-1]) + 1 if len(groups) else 1,
                           len(self) // self.buffer))
        self.members = [np.flatnonzero(groups % count == v) for v in range(count)]   # each shard's blocks
        self.shard_sizes = np.array([int(self.sizes[blocks].sum()) for blocks in self.members], dtype=np.int64)

    def hold(self, piece):
        """Take the windows' memory now, at set-up (a shard in memory reads its rows here)."""
        self._allocate()

    def _windows(self, shard, seed, epoch):
        """``(windows as lists of blocks, each window's end in the shard's order)`` of ``shard`` in ``epoch``."""
        blocks = self.members[shard]
        groups = None if self.groups is None else self.groups[blocks]
        windows = [blocks[w] for w in epoch_windows(self.sizes[blocks], self.buffer, seed, epoch, shard, groups)]
        return windows, np.cumsum([int(self.sizes[w].sum()) for w in windows])

    def reads(self, piece, seed, epoch):
        """``[(shard, window, blocks, first, end)]``: the windows ``piece`` covers and the part of each it takes."""
        found, reads = {}, []
        for shard, lo, hi in piece.tolist():
            if shard not in found:
                found[shard] = self._windows(shard, seed, epoch)
            windows, ends = found[shard]
            first, last = (int(np.searchsorted(ends, row, side="right")) for row in (lo, hi - 1))
            for index in range(first, last + 1):
                begin = int(ends[index - 1]) if index else 0
                reads.append((shard, index, windows[index], max(lo - begin, 0), min(hi, int(ends[index])) - begin))
        return reads

    def batches(self, local_batch, piece, seed, epoch, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of ``piece`` from step ``skip`` on: windows read ahead, batches gathered ahead."""
        steps = virtual.length(piece) // local_batch
        reads = self.reads(virtual.take(piece, skip * local_batch, steps * local_batch), seed, epoch)

        def read():
            handles = {}
            try:
                for at, (_, _, blocks, _, _) in enumerate(reads):
                    for block in (reads[at + 1][2] if at + 1 < len(reads) else []):   # the next one: ahead
                        self.source.advise(int(self.cuts[block]), int(self.cuts[block + 1]), handles)
                    yield self._window(blocks, handles)
            finally:
                _close(handles)

        def gather():
            reader, window = Prefetcher(read(), depth=1), None
            xs, ys, have = [], [], 0
            try:
                for shard, index, _, first, end in reads:
                    x, y = next(reader)
                    window = x, y, None
                    order, at = window_order(len(x), seed, epoch, shard, index)[first:end], 0
                    while at < len(order):
                        rows = order[at:at + local_batch - have]
                        xs.append(x[rows])
                        ys.append(y[rows])
                        at, have = at + len(rows), have + len(rows)
                        if have == local_batch:
                            yield _joined(xs, ys)
                            xs, ys, have = [], [], 0
                    self._give_back(window)
                    window = None
            finally:
                reader.close()
                if window is not None:
                    self._give_back(window)

        return Prefetcher(gather())
