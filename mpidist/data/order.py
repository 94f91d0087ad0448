"""An epoch's order of the training rows: any position of any lane in O(1), in memory and streamed alike.

Lane ``l`` of a global batch ``B`` holds the contiguous rows ``[b_l, b_l +
m_l)`` of the split (:func:`~mpidist.data.lanes.stream_bounds`).  Its rows are
cut into *units* of ``U`` rows (the last one ``d`` rows short), and each epoch:

1. its units are put in an order of their own: a permutation ``σ`` of ``[0,
   u)`` drawn from ``(seed, epoch, l)``;
2. each ``K`` consecutive units of that order form a window (the last may
   hold fewer units; the one holding the short unit ``d`` rows fewer);
3. each window's samples are permuted, drawn from ``(seed, epoch, l, window)``.

Step ``s`` takes sample ``s`` of each lane.  ``U`` and ``K`` come from the
run's shuffle buffer, the split's rows, the lanes and the sample's size
(:func:`order_for`): nothing of the worker count, the data mode, the memory
budget or how the files store the rows (their chunks, compression, or a
split's cut into files), so a run resumed or shrunk on another layout,
streamed or in memory, or on the same rows rewritten, continues the very
order.

Both permutations are keyed Feistel networks over the next power of four
with cycle-walking (:func:`permute`): a position's row costs a few integer
operations and no table, so the order of a split of 10^11 rows takes the
memory of one of 10^6 (a stream holds the windows it reads, a shard in
memory the rows of its lanes, and nothing else grows with the split).
"""

import dataclasses
import heapq

import numpy as np

from .blocks import order_units
from .lanes import lane_starts, mix, seeds

ORDER = 0x4F524452  # mixed into the seeds ("ORDR")
UNITS, SAMPLES = 1, 2  # which permutation of a lane's epoch a seed is for
ROUNDS = 4  # a Feistel network's rounds: four make a pseudo-random permutation (Luby-Rackoff)


def _bits(values):
    """Bits of each of the non-negative int64 ``values`` (``int.bit_length``), element by element."""
    values = np.asarray(values, dtype=np.int64)
    bits = np.zeros(values.shape, dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):  # (a binary search of the highest bit: exact where floats are not)
        high = (values >> (bits + shift)) > 0
        bits = np.where(high, bits + shift, bits)
    return bits + (values > 0)


def _rounds(x, half, keys, inverse):
    """One pass of the Feistel network of halves of ``half`` bits keyed by ``keys`` over ``x`` (uint64
    arrays)."""
    mask = (np.uint64(1) << half.astype(np.uint64)) - np.uint64(1)
    shift = half.astype(np.uint64)
    left, right = x >> shift, x & mask
    steps = range(ROUNDS - 1, -1, -1) if inverse else range(ROUNDS)
    with np.errstate(over="ignore"):
        for step in steps:
            key = mix(keys + np.uint64(step + 1) * np.uint64(0x9E3779B97F4A7C15))
            if inverse:
                left, right = right ^ (mix(left ^ key) & mask), left
            else:
                left, right = right, left ^ (mix(right ^ key) & mask)
    return (left << shift) | right


def permute(index, size, keys, inverse=False):
    """Element by element, ``index``'s place in the permutation of ``[0, size)`` keyed by ``keys`` (uint64),
    or with ``inverse`` the index at that place.  Arrays broadcast together; every index must be below its
    size.

    A Feistel network permutes ``[0, 4^h)``, the first power of four not
    below ``size``; a value it sends past ``size`` is sent through again
    until it falls inside (cycle-walking: a permutation of ``[0, size)``,
    about two passes on average, four at most on average).
    """
    index, size, keys = np.broadcast_arrays(
        np.asarray(index, dtype=np.int64), np.asarray(size, dtype=np.int64), np.asarray(keys, dtype=np.uint64)
    )
    half = np.maximum(1, (_bits(np.maximum(size - 1, 0)) + 1) // 2)
    out = _rounds(index.astype(np.uint64).ravel(), half.ravel(), keys.ravel(), inverse)
    limit = size.ravel().astype(np.uint64)
    outside = np.flatnonzero(out >= limit)
    while outside.size:
        out[outside] = _rounds(out[outside], half.ravel()[outside], keys.ravel()[outside], inverse)
        outside = outside[out[outside] >= limit[outside]]
    return out.astype(np.int64).reshape(index.shape)


@dataclasses.dataclass(frozen=True)
class Window:
    """Window ``index`` of a lane (``lane``: its place among the lanes asked for) in an epoch: lane positions
    ``[start, start + rows)``, made of ``units`` (``(lo, hi)`` split rows each), read in that order."""

    lane: int
    index: int
    start: int
    rows: int
    units: tuple


@dataclasses.dataclass(frozen=True)
class LaneOrder:
    """The order of ``n`` rows cut into ``total`` lanes, units of ``unit`` rows, windows of ``window``
    units."""

    n: int
    total: int
    unit: int
    window: int

    def _lanes(self, lanes, seed, epoch):
        """Per lane (an int64 array): its first row, rows, units, rows its last unit lacks, the units' key,
        and the place of the short unit in the units' order (past the last window where none is short)."""
        lanes = np.asarray(lanes, dtype=np.int64)
        first = lane_starts(self.n, self.total, lanes)
        rows = lane_starts(self.n, self.total, lanes + 1) - first
        units = np.maximum(1, -(-rows // self.unit))
        short = units * self.unit - rows
        key = seeds(seed, epoch, lanes, ORDER, UNITS)
        place = self._unit(units - 1, units, key, inverse=True)
        return first, rows, units, short, key, np.where(short > 0, place, units * self.window)

    def _unit(self, place, units, key, inverse=False):
        """The unit at ``place`` of a lane's order of ``units`` units (with ``inverse``, the place of a unit).

        A lane of one window keeps its units in their order: its window's
        permutation then orders its rows alone, so that the unit's size changes
        nothing in a lane that fits the share (any small dataset's), and a
        stream reads such a lane front to back (a compressed chunk two units
        share is decompressed once, from HDF5's cache).
        """
        return np.where(units <= self.window, place, permute(place, units, key, inverse))

    def rows(self, lanes, positions, seed, epoch):
        """The split rows at ``positions`` (each below its lane's rows) of ``lanes``, broadcast together."""
        lanes, positions = np.broadcast_arrays(
            np.asarray(lanes, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        )
        first, _, units, short, key, place = self._lanes(lanes, seed, epoch)
        span = self.unit * self.window
        shorts = place // self.window  # (the window holding the short unit)
        after = positions >= (shorts + 1) * span - short  # past the window with the short unit
        index = np.where(after, (positions + short) // span, positions // span)
        offset = positions - index * span + np.where(after, short, 0)
        held = np.minimum(self.window, units - index * self.window) * self.unit - np.where(
            index == shorts, short, 0
        )
        offset = permute(offset, held, seeds(seed, epoch, lanes, ORDER, SAMPLES, index))
        # (in the window holding the short unit, the offsets past it are its rows short of a whole unit)
        gap = (index == shorts) & (offset >= (place - index * self.window + 1) * self.unit - short)
        offset = offset + np.where(gap, short, 0)
        unit = self._unit(index * self.window + offset // self.unit, units, key)
        return first + unit * self.unit + offset % self.unit

    def windows(self, lanes, seed, epoch, first, last):
        """The :class:`Window`\\ s of ``lanes`` holding positions ``[first, last)``, by start then lane: the
        order in which a stream needs them (a window is read before the step it starts at).  A generator: an
        epoch of a large split has many windows, and each is made as it is needed."""
        lanes = np.asarray(lanes, dtype=np.int64)
        return heapq.merge(
            *(
                self._lane_windows(place, lanes[place : place + 1], seed, epoch, first, last)
                for place in range(len(lanes))
            ),
            key=lambda window: (window.start, window.lane),
        )

    def _lane_windows(self, place, lane, seed, epoch, first, last):
        """The windows of lane ``lane`` (an array of one; ``place``: its place among those asked for) holding
        positions ``[first, last)``, in turn."""
        starts, rows, units, short, key, places = (v[0] for v in self._lanes(lane, seed, epoch))
        starts, rows, units, short, places = (int(v) for v in (starts, rows, units, short, places))
        span, shorts = self.unit * self.window, places // self.window
        top = min(int(last), rows)
        if top <= first:
            return
        lowest, highest = (self.window_of(position, span, short, shorts) for position in (first, top - 1))
        for index in range(lowest, highest + 1):
            count = min(self.window, units - index * self.window)
            order = self._unit(index * self.window + np.arange(count), units, key).tolist()
            cut = tuple((starts + u * self.unit, starts + min((u + 1) * self.unit, rows)) for u in order)
            start = index * span - (short if index > shorts else 0)
            yield Window(place, index, start, sum(hi - lo for lo, hi in cut), cut)

    @staticmethod
    def window_of(position, span, short, shorts):
        """The window holding lane ``position``: windows span ``span`` rows, window ``shorts`` ``short``
        fewer."""
        return (position + short) // span if position >= (shorts + 1) * span - short else position // span

    def window_order(self, rows, seed, epoch, lane, window):
        """Where in its window (as read: its units in turn) each of the ``rows`` positions of window
        ``window`` of lane ``lane`` (its number) takes its sample from."""
        return permute(np.arange(rows), rows, seeds(seed, epoch, lane, ORDER, SAMPLES, window))


def order_for(info, split, buffer, input_shape, total):
    """The :class:`LaneOrder` of ``split`` of ``info`` for a shuffle buffer of ``buffer`` samples over
    ``total`` lanes (:func:`~mpidist.data.blocks.order_units`)."""
    rows = int(info.sizes[split])
    return LaneOrder(rows, int(total), *(int(v) for v in order_units(rows, buffer, input_shape, total)))
