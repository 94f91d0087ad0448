"""A stream's blocks and what a stream holds: chunk-aligned cuts, the training order's units, buffer sizes,
bytes checked against the budget.

An evaluation's stream reads its rows in blocks cut at multiples of each
file's block length: whole HDF5 chunks, about :data:`BLOCK_BYTES` of them, so a
block is one read call and no chunk is decompressed twice.  Where whole chunks
do not fit the memory budget (:func:`stream_bytes`, :mod:`mpidist.data.budget`),
a chunk larger than a block is read in slices (``sliced``), one after the
other from a cache of that chunk.  A training stream reads the units of the
data order instead (:func:`order_units`), whose size is the run's, never the
files': the order may not depend on how the rows are stored.
"""

import numpy as np

from ..nn.tensor import part_range
from .direct import HUGE_PAGE

BLOCK_BYTES = 4 << 20  # one read call: a few of a parallel file system's stripes
BUFFER_BYTES = 64 << 20  # the default shuffle buffer: this many bytes of samples in the model's dtype
WINDOWS = 2  # windows a lane holds at once: the one its batches come from, the next (read ahead)
EVAL_BLOCKS = 3  # blocks an evaluation holds: being cut into batches, read ahead, being read
SEGMENT_BYTES = 4 << 20  # batches gathered in one go: at most about this many bytes (one batch at least)
SEGMENTS = 4  # gathered segments alive at once: being gathered, two queued, one training
UNITS_A_WINDOW = 4  # a window's units, at least: a lane's window draws from that many places of the lane
PIECE = 1 << 16  # a carved split's rows computed at once where many are asked for: small temporaries


def worker_range(n, workers, worker):
    """``(lo, hi)``: worker ``worker``'s contiguous rows of ``n``, balanced (the first ``n % workers`` one
    more)."""
    return part_range(n, worker, workers)


def block_cuts(source, lo, hi, block_bytes=BLOCK_BYTES, sliced=False):
    """Sorted row numbers of :class:`SplitRows` ``source`` cutting ``[lo, hi)`` into blocks.

    A file's blocks start at multiples of its block length: whole chunks of
    ``x``, about ``block_bytes`` of them (one chunk at least); with ``sliced``,
    a chunk larger than that is cut in equal slices from its start.  Files are
    never read in one block together.  Only the cuts inside ``[lo, hi)`` are
    made: the rows a rank reads decide their cost, never the split's size.
    """
    if source.picked is not None:
        return _picked_cuts(source, lo, hi, block_bytes, sliced)
    cuts = [np.array([lo, hi], dtype=np.int64)]
    for index, member in enumerate(source.files):
        length = block_length(member, source.group, block_bytes, sliced)
        rows, chunk = member.sizes[source.group], max(1, member.chunk_rows.get(source.group, 1))
        begin, end = max(lo - int(source.starts[index]), 0), min(hi - int(source.starts[index]), rows)
        if end <= begin:
            continue
        if length < chunk:  # slices of each chunk
            starts = (
                np.arange(begin // chunk * chunk, end, chunk, dtype=np.int64)[:, None]
                + np.arange(0, chunk, length)
            ).ravel()
        else:
            starts = np.arange(-(-begin // length) * length, end, length, dtype=np.int64)
        starts = source.starts[index] + starts[starts < rows]
        cuts.append(starts[(starts > lo) & (starts < hi)])
    return np.unique(np.concatenate(cuts))


def _picked_cuts(source, lo, hi, block_bytes, sliced):
    """:func:`block_cuts` of a split that picks rows of the file's (``--val-fraction``, ``--eval-samples``):
    where its rows ``[lo, hi)`` pass from one of the file's blocks to another, :data:`PIECE` rows at a time
    (what the rank reads decides the cost: a carved split's rows may be far apart)."""
    cuts, previous = [np.array([lo, hi], dtype=np.int64)], None
    for start in range(lo, hi, PIECE):
        numbers = np.arange(start, min(hi, start + PIECE), dtype=np.int64)
        firsts = _block_firsts(source, source.group_rows(numbers), block_bytes, sliced)
        if previous is not None and firsts[0] != previous:
            cuts.append(numbers[:1])
        cuts.append(numbers[1:][np.diff(firsts) != 0])
        previous = firsts[-1]
    return np.unique(np.concatenate(cuts))


def _block_firsts(source, rows, block_bytes, sliced):
    """The first row of the block holding each of the group's ``rows`` (of :class:`SplitRows` ``source``)."""
    files = np.searchsorted(source.starts, rows, "right") - 1
    firsts = np.empty_like(rows)
    for index in np.unique(files).tolist():
        member, mine = source.files[index], files == index
        length = block_length(member, source.group, block_bytes, sliced)
        chunk = max(1, member.chunk_rows.get(source.group, 1))
        local = rows[mine] - source.starts[index]
        if length < chunk:  # (slices of each chunk)
            local = local // chunk * chunk + local % chunk // length * length
        else:
            local = local // length * length
        firsts[mine] = source.starts[index] + local
    return firsts


def block_length(member, group, block_bytes=BLOCK_BYTES, sliced=False):
    """Rows of a block of ``group`` in file ``member``: whole chunks of ``x``, about ``block_bytes`` (one
    chunk at least); with ``sliced``, a chunk larger than ``block_bytes`` is read in equal slices of at most
    about that."""
    return _length(member.chunk_rows.get(group, 1), member.row_bytes.get(group, 1), block_bytes, sliced)


def _length(chunk, row, block_bytes, sliced):
    chunk, row = max(1, chunk), max(1, row)
    if sliced and chunk * row > block_bytes:
        pieces = -(-chunk * row // block_bytes)
        return -(-chunk // pieces)
    return max(chunk, block_bytes // row // chunk * chunk)


def lane_share(buffer, n, lanes):
    """Samples a lane's window holds at least: its share of a shuffle buffer of ``buffer`` samples over
    ``lanes`` (the global batch), the buffer at most the split's ``n`` rows (a larger one orders the lanes
    alike)."""
    return max(1, -(-min(int(buffer), max(int(n), 1)) // lanes))


def order_units(rows, buffer, input_shape, total):
    """``(unit, window)``: the rows of a unit of the training order (:mod:`mpidist.data.order`) of a split of
    ``rows`` rows for a shuffle buffer of ``buffer`` samples over ``total`` lanes, and the units of a window.

    A unit is a quarter of a lane's share of the buffer (:data:`UNITS_A_WINDOW` to a window), at most
    :data:`BLOCK_BYTES` of the sample's values in float32 (one read call), a lane's rows at most and one row
    at least; a window is as many units as hold the share.  The arguments are all it depends on: never the
    files' chunks, compression or boundaries (a unit reads whatever chunks it touches, decompressing a
    compressed one whole, as HDF5 must), the worker count, the data mode, the memory budget or the model's
    dtype, so the same rows stored in any way train in the same order.
    """
    share, lane = lane_share(buffer, rows, total), -(-int(rows) // total)
    sample = int(np.prod(input_shape)) * np.dtype(np.float32).itemsize
    unit = max(1, min(share // UNITS_A_WINDOW, BLOCK_BYTES // max(1, sample), lane))
    return unit, -(-share // unit)


def segment_steps(share, batch_bytes):
    """Steps whose batches a stream gathers in one go: :data:`SEGMENT_BYTES` of them, at most a quarter of a
    lane's window (``share`` samples), one at least."""
    return max(1, min(SEGMENT_BYTES // max(1, batch_bytes), share // 4))


def stream_bytes(info, split, buffer, input_shape, dtype, sliced=False, lanes=None):
    """Bytes a :class:`Stream` of ``split`` holds at most: a training stream's with ``lanes`` (its
    :class:`~mpidist.data.lanes.Lanes`), else an evaluation's.

    Training: :data:`WINDOWS` windows of each of its lanes (a lane's share of
    ``buffer`` samples, and a block), the index of the windows' samples, and
    the batches it gathers ahead (:data:`SEGMENTS` segments); an evaluation:
    :data:`EVAL_BLOCKS` blocks.  Both: a block being read (as stored,
    standardised where the file says so, converted; read around the page
    cache into a huge page where it takes an eighth of one or more), and the
    chunk cache of a file whose compressed chunks are larger than HDF5's (a
    chunk of ``x`` and of ``y`` decompressed, and the compressed one read).
    """
    group = info.rows_of(split)[0]
    values = int(np.prod(input_shape))
    sample = values * np.dtype(dtype).itemsize + info.target_width * 8
    kinds = {
        (m.chunk_rows.get(group, 1), m.row_bytes.get(group, 0), m.cache_bytes(group)) for m in info.files
    }
    if lanes is None:
        rows = max(
            _length(chunk, row, block_bytes_for(buffer, input_shape, dtype), sliced)
            for chunk, row, _ in kinds
        )
    else:
        share = lane_share(buffer, info.sizes[split], lanes.total)
        rows, units = order_units(info.sizes[split], buffer, input_shape, lanes.total)
    stored = max(r for _, r, _ in kinds) + 8 + (8 * values if info.mean is not None else 0)
    cache = max(cache for _, _, cache in kinds)  # (one file's: a stream holds one such file open at a time)
    read = rows * max(r for _, r, _ in kinds)  # a direct read's buffer: a huge page where a block is near one
    cache += HUGE_PAGE - read if HUGE_PAGE // 8 <= read < HUGE_PAGE else 0
    if lanes is None:
        held = EVAL_BLOCKS * rows * sample
    else:
        window = min(rows * units, -(-info.sizes[split] // lanes.total))
        batch = lanes.count * sample
        held = lanes.count * window * (WINDOWS * sample + 8) + SEGMENTS * segment_steps(share, batch) * batch
    return held + rows * (stored + sample) + cache


def block_bytes_for(buffer, input_shape, dtype):
    """Bytes of a block for windows of ``buffer`` samples: :data:`BLOCK_BYTES`, or a quarter of a small
    window.

    A window then holds four blocks at least (where the chunks allow), drawn
    from anywhere in its lane.
    """
    return min(BLOCK_BYTES, max(1, buffer * int(np.prod(input_shape)) * np.dtype(dtype).itemsize // 4))


def default_buffer(input_shape, dtype, budget=None):
    """Samples in the default shuffle buffer: :data:`BUFFER_BYTES` of them, less in a small ``budget``; one at
    least.

    The buffer is shared by the global batch's lanes: a worker holds its
    lanes' part of it, twice (:data:`WINDOWS`).  With a budget, the buffer is
    at most an eighth of it, so one worker holding every lane's windows takes
    a quarter.
    """
    size = BUFFER_BYTES if budget is None else min(BUFFER_BYTES, budget // 8)
    return max(1, size // (int(np.prod(input_shape)) * np.dtype(dtype).itemsize))
