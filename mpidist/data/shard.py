"""A worker's part of a split read whole into memory (small datasets: the default below ``--memory-budget``).

Training: worker ``w`` of ``W`` holds its lanes (:mod:`mpidist.data.lanes`),
contiguous ranges of rows, and gives the order a stream of the same lanes
gives (:mod:`mpidist.data.order`): step ``s`` takes sample ``s`` of each of
its lanes.  The global batch of a step is the same on any number of workers,
in memory or streamed, and a run resumed (or shrunk) at step ``s`` of an
epoch, on any number of workers and in either mode, continues every lane there.

Evaluation: worker ``w`` of ``W`` holds rows ``w, w+W, w+2W, ...`` of the
split, evaluated whole.
"""

import numpy as np

from ..runtime.memory import check_fits
from .batches import Prefetcher
from .blocks import default_buffer
from .order import order_for
from .rows import SplitRows
from .samples import footprint


SEGMENT = 256  # steps whose rows are computed at once


class Shard:
    """One split's rows for one worker, read once and checked.

    Args:
        info: the dataset's :class:`~mpidist.data.DatasetInfo`.
        split: "train", "test" or "val".
        worker, num_workers: this worker's index and the worker count (an evaluation's strided shard).
        input_shape: per-sample shape the model is fed (may add a channel axis).
        dtype: floating dtype of the samples.
        rows: a slice of the split's rows to read in place of the strided shard (``predict``
            reads a contiguous block per rank); ``worker`` and ``num_workers`` are then unused.
        lanes: the worker's :class:`~mpidist.data.lanes.Lanes` of the training split: the rows it holds and
            the batches it gives (``worker`` and ``num_workers`` unused).
        buffer: the run's shuffle buffer, in samples (0: :func:`~mpidist.data.blocks.default_buffer`): it
            fixes
            the order's windows, as a stream's.
    """

    mode = "memory"

    def __init__(self, info, split, worker, num_workers, input_shape, dtype, rows=None, lanes=None, buffer=0):
        source = SplitRows(info, split, input_shape, dtype)
        self.lanes, self.count = lanes, source.count
        if lanes is not None:
            buffer = max(1, min(int(buffer) or default_buffer(input_shape, dtype), source.count))
            self.order = order_for(info, split, buffer, input_shape, lanes.total)
            self.first, end = lanes.span(source.count)  # (first: the row the shard's position 0 holds)
            numbers = np.arange(self.first, end, dtype=np.int64)
        else:
            # (made from the range's bounds: an index of the whole split would grow with it, not the read)
            picked = slice(worker, None, num_workers) if rows is None else rows
            numbers = np.arange(*picked.indices(source.count), dtype=np.int64)
        # the file's row counts decide the size: checked before anything is read
        check_fits(
            footprint(len(numbers), info, source.group, dtype),
            f"{info.path}: {source.group} ({len(numbers):,} rows of {int(np.prod(info.sample_shape)):,} "
            "values for this worker)",
        )
        self.x, self.y = source.read(numbers)

    def __len__(self):
        return len(self.y)

    def prime(self, seed, epoch, step):
        """Nothing to read ahead: the shard is in memory (a :class:`~mpidist.data.Stream` reads its first
        windows)."""

    def batches(self, steps, seed, epoch, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of steps ``skip..steps-1`` of ``epoch``, prefetched (``last_epoch``: for a
        stream).

        Batch ``s`` is sample ``s`` of each lane's order, in lane order.
        """

        def batches():
            for lo in range(skip, steps, SEGMENT):  # (the rows of a few steps at a time: O(1) memory)
                at = np.arange(lo, min(steps, lo + SEGMENT))[:, None]
                for index in self.order.rows(self.lanes.ids[None, :], at, seed, epoch) - self.first:
                    yield self.x[index], self.y[index]

        return Prefetcher(batches())

    def eval_batches(self, size=1024):
        """The whole shard in order, in chunks of ``size``."""
        for lo in range(0, len(self), size):
            yield self.x[lo : lo + size], self.y[lo : lo + size]
