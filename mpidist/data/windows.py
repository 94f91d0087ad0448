"""A stream's lanes epoch by epoch: blocks in an order of their own, grouped into windows, each window permuted.

Lane ``l`` of a stream is a contiguous range of rows
(:func:`~mpidist.data.lanes.stream_bounds`), cut into blocks at multiples of
each file's block length (:func:`~mpidist.data.blocks.block_cuts`).  Each
epoch, for each lane:

1. its blocks are put in an order drawn from ``(seed, epoch, l)`` (blocks
   that slice one compressed chunk stay together, in an order of their own);
2. consecutive blocks of that order form windows of at least ``buffer``
   samples, the lane's share of the shuffle buffer (the last may hold less);
3. each window's samples are permuted, drawn from ``(seed, epoch, l, window)``.

The lane's order is its windows' samples in turn, and step ``s`` of the epoch
takes its sample ``s``.  Nothing here depends on the worker count: a worker
computes the windows of its own lanes only, and gets the very windows any
other layout of the lanes would.
"""

import dataclasses

import numpy as np

from .lanes import numbers, orders, seeds

STREAM = 0x5354          # mixed into the seeds: a stream's orders are not a shard in memory's
GROUPS, BLOCKS, SAMPLES = 1, 2, 3    # which draw of a lane's epoch a seed is for


@dataclasses.dataclass(frozen=True)
class Window:
    """Window ``index`` of local lane ``lane`` (of a stream's lanes) in an epoch: lane positions
    ``[start, start + rows)``, made of ``blocks`` (indices into the stream's blocks), read in that order."""

    lane: int
    index: int
    start: int
    rows: int
    blocks: tuple


def block_order(lane_of, lane_ids, seed, epoch, groups=None):
    """Every block (index), lane by lane, each lane's in its order of ``epoch``.

    ``lane_of``: the local lane of each block (non-decreasing); ``lane_ids``:
    the lanes' numbers; ``groups`` (:func:`~mpidist.data.blocks.block_groups`,
    never across lanes): blocks of one group stay together, in an order of
    their own, and groups are ordered as blocks are without them.
    """
    lane_of = np.asarray(lane_of, dtype=np.int64)
    index = np.arange(len(lane_of), dtype=np.int64)
    firsts = np.searchsorted(lane_of, np.arange(len(lane_ids)))[lane_of]     # each block's lane's first block
    group = index if groups is None else np.asarray(groups, dtype=np.int64)
    lane = np.asarray(lane_ids, dtype=np.int64)[lane_of]
    within = group - group[firsts]        # a group's number in its lane: the same on any worker
    group_key = numbers(seeds(seed, epoch, lane, STREAM, GROUPS), within)
    block_key = numbers(seeds(seed, epoch, lane, STREAM, BLOCKS), index - firsts)
    return np.lexsort((block_key, within, group_key, lane_of))


def epoch_windows(sizes, lane_of, lane_ids, buffer, seed, epoch, groups=None):
    """For each local lane, its windows of ``epoch``: arrays of block indices, in order.

    A window closes as soon as it holds ``buffer`` samples (``sizes``: each
    block's rows); the lane's last one may hold fewer.
    """
    order = block_order(lane_of, lane_ids, seed, epoch, groups)
    ends = np.searchsorted(np.asarray(lane_of)[order], np.arange(len(lane_ids)), side="right")
    windows, lo = [], 0
    for hi in ends.tolist():
        windows.append(_cut(order[lo:hi], np.asarray(sizes), buffer))
        lo = hi
    return windows


def _cut(blocks, sizes, buffer):
    """``blocks`` (in order) cut into windows of at least ``buffer`` rows, the last one perhaps fewer."""
    total = np.cumsum(sizes[blocks])
    windows, lo, before = [], 0, 0
    while lo < len(blocks):
        hi = min(int(np.searchsorted(total, before + buffer, side="left")), len(blocks) - 1) + 1
        windows.append(blocks[lo:hi])
        lo, before = hi, int(total[hi - 1])
    return windows


def schedule(sizes, lane_of, lane_ids, buffer, seed, epoch, first, last, groups=None):
    """The :class:`Window`\\ s of ``epoch`` that hold lane positions in ``[first, last)``, by start then lane.

    The order in which a stream needs them: a window is read before the step it starts at.
    """
    sizes = np.asarray(sizes)
    found = []
    for lane, windows in enumerate(epoch_windows(sizes, lane_of, lane_ids, buffer, seed, epoch, groups)):
        start = 0
        for index, blocks in enumerate(windows):
            rows = int(sizes[blocks].sum())
            if start < last and start + rows > first:
                found.append(Window(lane, index, start, rows, tuple(blocks.tolist())))
            start += rows
            if start >= last:
                break
    return sorted(found, key=lambda window: (window.start, window.lane))


def window_order(rows, seed, epoch, lane, window):
    """The permutation of the ``rows`` samples of window ``window`` of lane ``lane`` (its number) in ``epoch``."""
    return orders(seeds(seed, epoch, lane, STREAM, SAMPLES, window), rows)[0]
