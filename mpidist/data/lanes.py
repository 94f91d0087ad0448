"""Lanes: the global batch's ``B`` places, each fed one sample a step from an order of its own.

A split's training rows are cut into ``B`` lanes (``B`` the global batch).
Each epoch every lane has its own order, drawn from ``(seed, epoch, lane)``
alone, and step ``s`` takes sample ``s`` of every lane's order: the global
batch of a step is the same set of samples whatever the number of workers,
an epoch has ``n // B`` steps (a lane's last sample, where it has ``n // B +
1``, is dropped, as one process drops the last ``n mod B`` samples), and a
run's position in the epoch is its step and nothing more.

Worker ``w`` of ``W`` holds the consecutive lanes ``[first, first + count)``,
``count`` its local batch (:func:`~mpidist.data.batches.local_batch_size`),
and its batch at step ``s`` is sample ``s`` of each of them, in lane order.
After a change of ``W`` at step ``s`` (an elastic shrink, a resume on another
count) the new workers continue every lane at ``s``: each sample of the epoch
is trained on once.

Lane ``l`` is a contiguous, balanced range of rows (:func:`stream_bounds`),
so a worker's lanes are one contiguous range, and its order is made of units
and windows (:mod:`mpidist.data.order`), the same in memory
(:class:`~mpidist.data.Shard`) and streamed (:class:`~mpidist.data.Stream`).
Every batch draws one sample from each of the ``B`` lanes, spread over the
whole split: a file stored sorted by label gives every batch its share of
each class.

The random numbers are counter-based: :func:`seeds` hashes ``(seed, epoch,
lane, ...)`` with SplitMix64's finaliser (:func:`mix`), so the orders of any
set of lanes come from a few array operations, the same on any worker.
"""

import dataclasses

import numpy as np

from ..nn.tensor import part_range
from .batches import local_batch_size

MASK = (1 << 64) - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment


@dataclasses.dataclass(frozen=True)
class Lanes:
    """Lanes ``[first, first + count)`` of ``total`` (the global batch): one worker's, or all of them
    (in-graph)."""

    total: int
    first: int
    count: int

    @classmethod
    def of(cls, global_batch, workers, worker):
        """Worker ``worker`` of ``workers``'s lanes: as many as its local batch, after the earlier
        workers'."""
        first, _ = part_range(global_batch, worker, workers)
        return cls(int(global_batch), int(first), local_batch_size(global_batch, workers, worker))

    @property
    def ids(self):
        """The lanes' numbers, in order."""
        return np.arange(self.first, self.first + self.count, dtype=np.int64)

    def sizes(self, n):
        """Rows of each of these lanes of a split of ``n`` rows (the first ``n mod B`` lanes hold one
        more)."""
        return n // self.total + (self.ids < n % self.total)

    def rows(self, n):
        """Rows these lanes hold of a split of ``n`` rows."""
        return int(self.sizes(n).sum())

    def span(self, n):
        """``(lo, hi)``: the contiguous rows these lanes hold of a split of ``n`` rows (two lanes' bounds
        computed, not every lane's)."""
        lo, hi = lane_starts(n, self.total, np.array([self.first, self.first + self.count], dtype=np.int64))
        return int(lo), int(hi)


def mix(z):
    """SplitMix64's finaliser of the uint64 array ``z`` (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _word(value):
    """``value`` (an integer, or an array of non-negative ones) as uint64."""
    if isinstance(value, (int, np.integer)):
        return np.uint64(int(value) & MASK)
    return np.asarray(value).astype(np.uint64)


def seeds(*words):
    """The uint64 hash of ``words`` (integers or integer arrays, broadcast together): one stream's seed
    each."""
    with np.errstate(over="ignore"):
        out = np.uint64(0x6D70696469737421)  # "mpidist!"
        for word in words:
            out = mix(out + GOLDEN + _word(word))
        return np.asarray(out, dtype=np.uint64)


def stream_bounds(n, total):
    """``total + 1`` row numbers: lane ``l`` of a stream of ``n`` rows is ``[bounds[l], bounds[l + 1])``,
    balanced."""
    return lane_starts(n, total, np.arange(total + 1, dtype=np.int64))


def lane_starts(n, total, lanes):
    """The first row of each of ``lanes`` (an int64 array; ``total`` gives the end) of ``n`` rows in ``total``
    balanced lanes: :func:`stream_bounds` at those lanes alone."""
    return lanes * (n // total) + np.minimum(lanes, n % total)
