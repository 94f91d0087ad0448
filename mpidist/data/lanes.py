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

* In memory (:class:`~mpidist.data.Shard`) lane ``l`` holds rows ``l, l + B,
  l + 2B, ...``: strided, so every lane sees every class in a file sorted by
  label; its order is a permutation.
* Streamed (:class:`~mpidist.data.Stream`) lane ``l`` is a contiguous,
  balanced range of rows, so a worker's lanes are one contiguous range; its
  order is made of blocks and windows (:mod:`mpidist.data.windows`).

The random numbers are counter-based: :func:`keys` hashes ``(seed, epoch,
lane, ...)`` and a counter with SplitMix64's finaliser, so the orders of any
set of lanes come from a few array operations, the same on any worker.
"""

import dataclasses

import numpy as np

from .batches import local_batch_size

MASK = (1 << 64) - 1
GOLDEN = np.uint64(0x9E3779B97F4A7C15)     # SplitMix64's increment
MEMORY = 0x4C414E45                         # mixed into a shard in memory's lane orders ("LANE")


@dataclasses.dataclass(frozen=True)
class Lanes:
    """Lanes ``[first, first + count)`` of ``total`` (the global batch): one worker's, or all of them (in-graph)."""

    total: int
    first: int
    count: int

    @classmethod
    def of(cls, global_batch, workers, worker):
        """Worker ``worker`` of ``workers``'s lanes: as many as its local batch, after the earlier workers'."""
        first = worker * (global_batch // workers) + min(worker, global_batch % workers)
        return cls(int(global_batch), int(first), local_batch_size(global_batch, workers, worker))

    @property
    def ids(self):
        """The lanes' numbers, in order."""
        return np.arange(self.first, self.first + self.count, dtype=np.int64)

    def sizes(self, n):
        """Rows of each of these lanes of a split of ``n`` rows (the first ``n mod B`` lanes hold one more)."""
        return n // self.total + (self.ids < n % self.total)

    def rows(self, n):
        """Rows these lanes hold of a split of ``n`` rows."""
        return int(self.sizes(n).sum())


def _mix(z):
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
    """The uint64 hash of ``words`` (integers or integer arrays, broadcast together): one stream's seed each."""
    with np.errstate(over="ignore"):
        out = np.uint64(0x6D70696469737421)      # "mpidist!"
        for word in words:
            out = _mix(out + GOLDEN + _word(word))
        return np.asarray(out, dtype=np.uint64)


def numbers(streams, counters):
    """Number ``counter`` (from 0) of the SplitMix64 stream seeded with ``stream``, element by element (broadcast)."""
    with np.errstate(over="ignore"):
        return _mix(np.asarray(streams, dtype=np.uint64) + GOLDEN * (np.asarray(counters).astype(np.uint64) + 1))


def keys(streams, counts):
    """``(len(streams), counts)`` uint64 random keys: row ``i`` is the first ``counts`` numbers of stream ``i``."""
    return numbers(np.asarray(streams, dtype=np.uint64).reshape(-1, 1), np.arange(counts)[None, :])


def orders(streams, counts):
    """One random permutation of ``range(counts)`` per stream of ``streams``: the argsort of its :func:`keys`."""
    return np.argsort(keys(streams, counts), axis=1, kind="stable")


def memory_rows(n, lanes):
    """The row numbers a worker with ``lanes`` holds in memory, increasing: rows ``q * B + l`` of its lanes ``l``.

    Position ``q * count + (l - first)`` holds lane ``l``'s ``q``-th row
    (the last ``q`` only for lanes that have one: the lowest, so positions
    stay dense).
    """
    q, extra = divmod(n, lanes.total)
    full = (np.arange(q, dtype=np.int64)[:, None] * lanes.total + lanes.ids[None, :]).ravel()
    last = max(lanes.first, min(extra, lanes.first + lanes.count))     # lanes below n mod B have a last row
    tail = q * lanes.total + np.arange(lanes.first, last, dtype=np.int64)
    return np.concatenate([full, tail])


def memory_positions(n, lanes, seed, epoch, skip=0):
    """``(steps - skip, count)``: the positions in :func:`memory_rows` of each step's batch from step ``skip`` on.

    Lane ``l``'s order is a permutation of its rows drawn from ``(seed,
    epoch, l)``; a lane of ``n // B + 1`` rows drops the last of its order.
    """
    steps = n // lanes.total
    if steps <= skip:
        return np.empty((0, lanes.count), dtype=np.int64)
    drawn = keys(seeds(seed, epoch, lanes.ids, MEMORY), steps + 1)
    drawn[lanes.sizes(n) <= steps, steps] = np.iinfo(np.uint64).max     # lanes without a last row: last
    order = np.argsort(drawn, axis=1, kind="stable")[:, skip:steps]
    return np.ascontiguousarray((order * lanes.count + np.arange(lanes.count)[:, None]).T)


def stream_bounds(n, total):
    """``total + 1`` row numbers: lane ``l`` of a stream of ``n`` rows is ``[bounds[l], bounds[l + 1])``, balanced."""
    lanes = np.arange(total + 1, dtype=np.int64)
    return lanes * (n // total) + np.minimum(lanes, n % total)
