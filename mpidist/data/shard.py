"""A worker's part of a split read whole into memory (small datasets: the default below ``--memory-budget``).

Training: worker ``w`` of ``W`` holds its lanes (:mod:`mpidist.data.lanes`):
lane ``l`` of a global batch ``B`` is rows ``l, l+B, l+2B, ...``, strided, so
every lane sees every class even when a file is stored sorted by label.  Each
epoch each lane permutes its rows by ``(seed, epoch, lane)``, and step ``s``
takes sample ``s`` of each of the worker's lanes: the global batch of a step
is the same on any number of workers, and a run resumed (or shrunk) at step
``s`` of an epoch, on any number of workers, continues every lane there.

Evaluation: worker ``w`` of ``W`` holds rows ``w, w+W, w+2W, ...`` of the
split, evaluated whole.
"""

import numpy as np

from ..runtime.memory import check_fits
from .batches import Prefetcher
from .lanes import memory_positions, memory_rows
from .rows import SplitRows
from .samples import footprint


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
    """

    mode = "memory"

    def __init__(self, info, split, worker, num_workers, input_shape, dtype, rows=None, lanes=None):
        source = SplitRows(info, split, input_shape, dtype)
        self.lanes, self.count = lanes, source.count
        if lanes is not None:
            numbers = memory_rows(source.count, lanes)
        else:
            numbers = np.arange(source.count, dtype=np.int64)[slice(worker, None, num_workers) if rows is None
                                                              else rows]
        # the file's row counts decide the size: checked before anything is read
        check_fits(footprint(len(numbers), info, source.group, dtype),
                   f"{info.path}: {source.group} ({len(numbers):,} rows of {int(np.prod(info.sample_shape)):,} "
                   "values for this worker)")
        self.x, self.y = source.read(numbers)

    def __len__(self):
        return len(self.y)

    def prime(self, seed, epoch, step):
        """Nothing to read ahead: the shard is in memory (a :class:`~mpidist.data.Stream` reads its first windows)."""

    def batches(self, steps, seed, epoch, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of steps ``skip..steps-1`` of ``epoch``, prefetched (``last_epoch``: for a stream).

        Batch ``s`` is sample ``s`` of each lane's order, in lane order.
        """
        def batches():
            for index in memory_positions(self.count, self.lanes, seed, epoch, skip)[:max(0, steps - skip)]:
                yield self.x[index], self.y[index]

        return Prefetcher(batches())

    def eval_batches(self, size=1024):
        """The whole shard in order, in chunks of ``size``."""
        for lo in range(0, len(self), size):
            yield self.x[lo:lo + size], self.y[lo:lo + size]
