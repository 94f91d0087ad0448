"""A worker's shard read whole into memory (small datasets: the default below ``--memory-budget``).

Worker ``w`` of ``W`` holds rows ``w, w+W, w+2W, ...`` of a split: a strided
shard, so every worker sees every class even when a file is stored sorted by
label.  Each epoch it permutes its shard with a generator seeded by ``(seed,
epoch, worker)``: the order is reproducible, so a resumed run continues
exactly where it stopped.
"""

import numpy as np

from ..runtime.memory import check_fits
from .batches import Prefetcher, epoch_order
from .rows import SplitRows
from .samples import footprint


class Shard:
    """One split's rows for one worker, read once and checked.

    Args:
        info: the dataset's :class:`~mpidist.data.DatasetInfo`.
        split: "train", "test" or "val".
        worker, num_workers: this worker's index and the worker count.
        input_shape: per-sample shape the model is fed (may add a channel axis).
        dtype: floating dtype of the samples.
        rows: a slice of the split's rows to read in place of the strided shard (``predict``
            reads a contiguous block per rank); ``worker`` and ``num_workers`` are then unused.
    """

    mode = "memory"

    def __init__(self, info, split, worker, num_workers, input_shape, dtype, rows=None):
        source = SplitRows(info, split, input_shape, dtype)
        numbers = np.arange(source.count, dtype=np.int64)[slice(worker, None, num_workers) if rows is None else rows]
        # the file's row counts decide the size: checked before anything is read
        check_fits(footprint(len(numbers), info, source.group, dtype),
                   f"{info.path}: {source.group} ({len(numbers):,} rows of {int(np.prod(info.sample_shape)):,} "
                   "values for this worker)")
        self.x, self.y = source.read(numbers)

    def __len__(self):
        return len(self.y)

    def prime(self, seed, epoch, worker, first):
        """Nothing to read ahead: the shard is in memory (a :class:`~mpidist.data.Stream` reads its first window)."""

    def batches(self, local_batch, steps, seed, epoch, worker, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of one epoch from step ``skip`` on, prefetched (``last_epoch``: for a stream)."""
        order = epoch_order(len(self), seed, epoch, worker)

        def batches():
            for step in range(skip, steps):
                index = order[step * local_batch:(step + 1) * local_batch]
                yield self.x[index], self.y[index]

        return Prefetcher(batches())

    def eval_batches(self, size=1024):
        """The whole shard in order, in chunks of ``size``."""
        for lo in range(0, len(self), size):
            yield self.x[lo:lo + size], self.y[lo:lo + size]
