"""An epoch's training samples as virtual shards: who trains on which, and what is left of the epoch.

The training split is cut into ``V`` virtual shards, ``V`` independent of the
worker count (:func:`memory_sizes`; a stream's are sets of blocks, see
:mod:`mpidist.data.streamed`).  Each epoch every shard has an order of its
own, drawn from ``(seed, epoch, shard)``: a position ``i`` of shard ``v``
names one sample.  What is left of an epoch is a sequence of intervals of
those orders, ``remaining``: an ``(k, 3)`` array of rows ``(shard, lo, hi)``
(at the epoch's start, every shard whole: :func:`whole`).

A segment of the epoch with ``W`` workers cuts ``remaining`` into ``W``
contiguous pieces (:func:`split`): with local batches ``b_w`` summing to the
global batch ``B``, the segment has ``S = len // B`` steps and worker ``w``
takes the ``S * b_w`` positions after those of the workers before it; the
last ``len % B`` (fewer than a global batch) wait for a later segment or are
the epoch's dropped tail.  After ``s`` steps, :func:`advance` gives what is
left: each piece less its first ``s * b_w`` positions, then the tail.  Cutting
that again with the same local batches gives every worker the rest of its
own piece, so a run stopped and resumed on as many workers continues exactly;
on another number it is a fresh, balanced cut of the same samples: every
sample of the epoch is trained on exactly once, however often the worker
count changes, and an epoch always has ``n // B`` steps.

All of it is pure (no MPI, nothing read) and tested so.
"""

import numpy as np

#: the most virtual shards a split is cut into (fewer where it has fewer samples, or a stream fewer blocks)
VIRTUAL_SHARDS = 256
SHARD_SEED = 0x5653         # mixed into a shard's seed: its order is not a worker shard's permutation


def shard_count(rows):
    """Virtual shards of a split of ``rows`` samples in memory: :data:`VIRTUAL_SHARDS`, or one per sample."""
    return max(1, min(VIRTUAL_SHARDS, int(rows)))


def memory_sizes(rows):
    """Samples of each virtual shard of a split held in memory: shard ``v`` holds rows ``v, v+V, ...``."""
    count = shard_count(rows)
    return np.array([len(range(v, rows, count)) for v in range(count)], dtype=np.int64)


def memory_rows(rows, shard):
    """The split's row numbers in virtual shard ``shard`` (in memory), increasing."""
    return np.arange(shard, rows, shard_count(rows), dtype=np.int64)


def shard_order(length, seed, epoch, shard):
    """The order of virtual shard ``shard``'s ``length`` samples in ``epoch`` (a shard in memory's)."""
    return np.random.default_rng([seed, epoch, shard, SHARD_SEED]).permutation(length)


def whole(sizes):
    """``remaining`` at an epoch's start: every (non-empty) shard whole, in shard order."""
    sizes = np.asarray(sizes, dtype=np.int64)
    shards = np.flatnonzero(sizes > 0)
    return np.stack([shards, np.zeros_like(shards), sizes[shards]], axis=1).astype(np.int64).reshape(-1, 3)


def length(intervals):
    """Samples in ``intervals``."""
    return int((intervals[:, 2] - intervals[:, 1]).sum()) if len(intervals) else 0


def take(intervals, lo, hi):
    """Positions ``[lo, hi)`` of the sequence ``intervals`` describes, as intervals."""
    counts = intervals[:, 2] - intervals[:, 1]
    ends = np.cumsum(counts)
    starts = ends - counts
    keep = (ends > lo) & (starts < hi)
    out = intervals[keep].copy()
    out[:, 1] += np.maximum(lo - starts[keep], 0)
    out[:, 2] -= np.maximum(ends[keep] - hi, 0)
    return out.reshape(-1, 3)


def _joined(parts):
    """The intervals of ``parts`` in order, neighbours of one shard that meet made one."""
    rows = [row for part in parts for row in part.tolist() if row[2] > row[1]]
    out = []
    for row in rows:
        if out and out[-1][0] == row[0] and out[-1][2] == row[1]:
            out[-1][2] = row[2]
        else:
            out.append(row)
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def steps_left(intervals, global_batch):
    """Steps the rest of an epoch described by ``intervals`` has: whole global batches of it."""
    return length(intervals) // global_batch


def split(intervals, batch_sizes):
    """Each worker's piece of ``intervals`` (a list), worker ``w`` training ``batch_sizes[w]`` samples a step."""
    steps = steps_left(intervals, sum(batch_sizes))
    offsets = np.concatenate([[0], np.cumsum(batch_sizes)])
    return [take(intervals, steps * int(offsets[w]), steps * int(offsets[w + 1])) for w in range(len(batch_sizes))]


def advance(intervals, batch_sizes, steps):
    """What is left of ``intervals`` after ``steps`` steps of workers training ``batch_sizes`` samples each."""
    total = steps_left(intervals, sum(batch_sizes))
    steps = min(int(steps), total)
    pieces = split(intervals, batch_sizes)
    rests = [take(piece, steps * size, length(piece)) for piece, size in zip(pieces, batch_sizes)]
    return _joined(rests + [take(intervals, total * sum(batch_sizes), length(intervals))])
