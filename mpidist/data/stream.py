"""A worker's part of a split read as training goes: chunk-aligned blocks, a shuffle buffer, bounded memory.

Datasets larger than ``--memory-budget`` stream.  Worker ``w`` of ``W`` owns
a contiguous range of the split's rows (the first ``n % W`` workers one row
more: the counts of a strided shard, so steps per epoch do not change), cut
into blocks at multiples of each file's block length: whole HDF5 chunks, about
:data:`BLOCK_BYTES` of them, so a block is one read call and no chunk is
decompressed twice.  Where whole chunks do not fit the memory budget
(:func:`stream_bytes`, :mod:`mpidist.data.budget`), a chunk larger than a block
is read in slices (``sliced``); the slices of a compressed chunk are read one
after the other from a cache of that chunk (:func:`block_groups`).  Each epoch:

1. the blocks are put in an order drawn from ``(seed, epoch, worker)``;
2. consecutive blocks of that order form windows of at least ``buffer``
   samples (the shuffle buffer);
3. each window's samples are permuted (seeded by ``(seed, epoch, worker,
   window)``), and batches are cut from the windows in turn.

A background thread reads the windows, a window ahead, and another gathers
each batch's samples from them in the window's permuted order (a copy, as a
shard in memory's batches are), a batch ahead of training.  The order is a
function of the seed, the epoch, the worker and the worker count, the buffer
and the files' chunking (nothing read, nothing timed), so a resumed run
starts at the window holding its next sample and continues exactly.
Memory: :data:`WINDOWS` windows (the one being gathered, the one read next,
the one being read, and one that has just been gathered: batches may span
two), written at set-up and reused, whatever the dataset's size.

Compared with a shard in memory, which permutes all its rows every epoch, a
sample's neighbours in a batch come from the same window: random blocks of the
worker's range, not the whole range (``docs/datasets.rst`` has the figures).
"""

import os
import queue

import numpy as np

from .batches import Prefetcher
from .rows import SplitRows

STREAM_SEED = 0x5354          # mixed into the seed: the stream's order is not a shard's permutation
BLOCK_BYTES = 4 << 20         # one read call: a few of a parallel file system's stripes; a window draws 16
BUFFER_BYTES = 64 << 20       # the default shuffle buffer: this many bytes of samples in the model's dtype
WINDOWS = 4                   # windows a stream holds at once: training, the one before, read, being read
EVAL_BLOCKS = 3               # blocks an evaluation holds: being cut into batches, read ahead, being read


def worker_range(n, workers, worker):
    """``(lo, hi)``: worker ``worker``'s contiguous rows of ``n``, balanced (the first ``n % workers`` one more)."""
    base, extra = divmod(n, workers)
    lo = worker * base + min(worker, extra)
    return lo, lo + base + (1 if worker < extra else 0)


def block_cuts(source, lo, hi, block_bytes=BLOCK_BYTES, sliced=False):
    """Sorted row numbers of :class:`SplitRows` ``source`` cutting ``[lo, hi)`` into blocks.

    A file's blocks start at multiples of its block length: whole chunks of
    ``x``, about ``block_bytes`` of them (one chunk at least); with ``sliced``,
    a chunk larger than that is cut in equal slices from its start.  Files are
    never read in one block together.
    """
    cuts = [np.array([lo, hi], dtype=np.int64)]
    for index, member in enumerate(source.files):
        length = block_length(member, source.group, block_bytes, sliced)
        rows, chunk = member.sizes[source.group], max(1, member.chunk_rows.get(source.group, 1))
        if length < chunk:     # slices of each chunk
            starts = (np.arange(0, rows, chunk, dtype=np.int64)[:, None] + np.arange(0, chunk, length)).ravel()
            starts = source.starts[index] + np.sort(starts[starts < rows])
        else:
            starts = source.starts[index] + np.arange(0, rows, length, dtype=np.int64)
        if source.picked is not None:      # a carved split: where its rows cross the file's boundaries
            starts = np.searchsorted(source.picked, starts).astype(np.int64)
        cuts.append(starts[(starts > lo) & (starts < hi)])
    return np.unique(np.concatenate(cuts))


def block_length(member, group, block_bytes=BLOCK_BYTES, sliced=False):
    """Rows of a block of ``group`` in file ``member``: whole chunks of ``x``, about ``block_bytes`` (one chunk at
    least); with ``sliced``, a chunk larger than ``block_bytes`` is read in equal slices of at most about that."""
    return _length(member.chunk_rows.get(group, 1), member.row_bytes.get(group, 1), block_bytes, sliced)


def _length(chunk, row, block_bytes, sliced):
    chunk, row = max(1, chunk), max(1, row)
    if sliced and chunk * row > block_bytes:
        pieces = -(-chunk * row // block_bytes)
        return -(-chunk // pieces)
    return max(chunk, block_bytes // row // chunk * chunk)


def block_groups(source, cuts, block_bytes, sliced):
    """Which blocks between ``cuts`` slice one compressed chunk (the same number), or None where none do.

    Reading part of a compressed chunk decompresses all of it: an epoch reads
    the slices of one such chunk one after the other, from the chunk cache
    :class:`SplitRows` gives it, so each is decompressed about once an epoch.
    """
    compressed = [sliced and member.spans.get(source.group, (0, 0))[0] > 0
                  and block_length(member, source.group, block_bytes, True) < member.chunk_rows.get(source.group, 1)
                  for member in source.files]
    if not any(compressed) or len(cuts) < 3:
        return None
    rows = source.group_rows(cuts[:-1])
    files = np.searchsorted(source.starts, rows, side="right") - 1
    chunks = (rows - source.starts[files]) // np.array([max(1, m.chunk_rows.get(source.group, 1))
                                                        for m in source.files])[files]
    same = (files[1:] == files[:-1]) & (chunks[1:] == chunks[:-1]) & np.array(compressed)[files[1:]]
    groups = np.concatenate([[0], np.cumsum(~same)])
    return None if groups[-1] == len(groups) - 1 else groups


def stream_bytes(info, split, buffer, input_shape, dtype, sliced=False, train=True):
    """Bytes a :class:`Stream` of ``split`` holds at most (``train``: with its windows; else an evaluation's blocks).

    Its :data:`WINDOWS` windows of ``buffer`` samples and a block (in the
    model's dtype, with targets); a block being read (as stored, standardised
    where the file says so, converted); and the chunk cache of a file whose
    compressed chunks are larger than HDF5's (a chunk of ``x`` and of ``y``
    decompressed, and the compressed one read).
    """
    group = info.rows_of(split)[0]
    values = int(np.prod(input_shape))
    sample = values * np.dtype(dtype).itemsize + (8 if info.num_classes else info.target_width * 8)
    block = block_bytes_for(buffer, input_shape, dtype)
    kinds = {(m.chunk_rows.get(group, 1), m.row_bytes.get(group, 0), m.cache_bytes(group)) for m in info.files}
    rows = max(_length(chunk, row, block, sliced) for chunk, row, _ in kinds)
    stored = max(r for _, r, _ in kinds) + 8 + (8 * values if info.mean is not None else 0)
    cache = max(cache for _, _, cache in kinds)     # (one file's: a stream holds one such file open at a time)
    held = (WINDOWS * (buffer + rows) if train else EVAL_BLOCKS * rows) * sample
    return held + rows * (stored + sample) + cache


def block_bytes_for(buffer, input_shape, dtype):
    """Bytes of a block for a shuffle buffer of ``buffer`` samples: :data:`BLOCK_BYTES`, or a quarter of a small buffer.

    A window then holds four blocks at least, drawn from anywhere in the part.
    """
    return min(BLOCK_BYTES, max(1, buffer * int(np.prod(input_shape)) * np.dtype(dtype).itemsize // 4))


def default_buffer(input_shape, dtype, budget=None):
    """Samples in the default shuffle buffer: :data:`BUFFER_BYTES` of them, less in a small ``budget``; one at least.

    A stream holds four windows of about a buffer each: with a budget, the
    buffer is at most an eighth of it, so the windows take half.
    """
    size = BUFFER_BYTES if budget is None else min(BUFFER_BYTES, budget // 8)
    return max(1, size // (int(np.prod(input_shape)) * np.dtype(dtype).itemsize))


def epoch_windows(sizes, buffer, seed, epoch, worker, groups=None):
    """The blocks (indices into ``sizes``, their row counts) of each window of an epoch, in order.

    ``groups`` (:func:`block_groups`): blocks of one group stay together, in
    an order of their own; groups are ordered as blocks are without them.
    """
    generator = np.random.default_rng([seed, epoch, worker, STREAM_SEED])
    if groups is None:
        return _group(generator.permutation(len(sizes)).tolist(), sizes, buffer)
    firsts = np.flatnonzero(np.concatenate([[True], groups[1:] != groups[:-1]]))
    ends = np.append(firsts[1:], len(groups))
    order = []
    for run in generator.permutation(len(firsts)).tolist():
        lo, hi = int(firsts[run]), int(ends[run])
        order.extend((lo + generator.permutation(hi - lo)).tolist() if hi - lo > 1 else [lo])
    return _group(order, sizes, buffer)


def window_order(length, seed, epoch, worker, window):
    """The permutation of window ``window``'s ``length`` samples."""
    return np.random.default_rng([seed, epoch, worker, STREAM_SEED, window]).permutation(length)


def _group(blocks, sizes, buffer):
    windows, current, rows = [], [], 0
    for block in blocks:
        current.append(block)
        rows += int(sizes[block])
        if rows >= buffer:
            windows.append(current)
            current, rows = [], 0
    if current:
        windows.append(current)
    return windows


class Stream:
    """One split's rows for one worker, streamed.  Arguments as :class:`~mpidist.data.Shard`'s, and:

    Args:
        buffer: samples in the shuffle buffer (0: :func:`default_buffer`).
        direct: read around the page cache where the file system allows it (``--stream-io direct``).
        sliced: read a chunk larger than a block in slices (see :func:`block_cuts`, :func:`block_groups`).
    """

    mode = "stream"

    def __init__(self, info, split, worker, num_workers, input_shape, dtype, buffer=0, direct=False, sliced=False):
        self.source = SplitRows(info, split, input_shape, dtype, direct)
        self.lo, self.hi = worker_range(self.source.count, num_workers, worker)
        # (a window holds the part at most: a larger buffer orders it as one window too, and would be allocated)
        self.buffer = max(1, min(int(buffer) or default_buffer(input_shape, dtype), self.hi - self.lo))
        block = block_bytes_for(self.buffer, input_shape, dtype)
        self.cuts = block_cuts(self.source, self.lo, self.hi, block, sliced)
        self.groups = block_groups(self.source, self.cuts, block, sliced)
        self.sizes = np.diff(self.cuts)
        self.input_shape, self.dtype = tuple(input_shape), np.dtype(dtype)
        # window arrays the batches are done with, filled again: a fresh 64 MiB array costs its page faults
        # (tens of ms on a VM) each time; the reading thread takes, the consumer gives back
        self._spare = queue.SimpleQueue()
        self._allocated = 0     # window arrays made (in the pool, or in use)
        # a window read before it was asked for: (seed, epoch, worker, window) -> (x, y); see prime()
        self._ahead = {}

    def __len__(self):
        return self.hi - self.lo

    def window_rows(self):
        """The most samples a window holds: the buffer, plus all but one row of the largest block."""
        return self.buffer + int(self.sizes.max(initial=1)) - 1

    def prime(self, seed, epoch, worker, first):
        """Read now the window that holds sample ``first`` of ``epoch``: the first batches then wait for nothing.

        The run's set-up calls it where a shard in memory is loaded, so both
        modes start training with their data at hand.  An epoch read to its
        end (but the run's last) reads the next one's first window the same
        way, while its last batches train.
        """
        self._allocate()
        windows = epoch_windows(self.sizes, self.buffer, seed, epoch, worker, self.groups)
        ends = np.cumsum([int(self.sizes[w].sum()) for w in windows])
        index = int(np.searchsorted(ends, first, side="right"))
        if index < len(windows):
            handles = {}
            try:
                self._read_ahead(windows, index, seed, epoch, worker, handles)
            finally:
                _close(handles)

    def _read_ahead(self, windows, index, seed, epoch, worker, handles):
        self._advise(windows, index, handles)
        self._ahead = {(seed, epoch, worker, index): self._window(windows[index], handles)}

    def batches(self, local_batch, steps, seed, epoch, worker, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of one epoch from step ``skip`` on: windows read ahead, batches gathered ahead.

        Read to its end, an epoch reads the next one's first window while its
        last batches train, unless it is the ``last_epoch`` (a window of reading
        for nothing: a sixteenth of a gigabyte part).

        Two background threads: one reads the windows, one gathers each
        batch's samples from them in the window's permuted order (a copy, as
        a shard in memory's batches are, so the training thread gets them
        fresh in the cache and no batch refers to a window).  A window goes
        back to the pool once its last sample is gathered.
        """
        windows = epoch_windows(self.sizes, self.buffer, seed, epoch, worker, self.groups)
        ends = np.cumsum([int(self.sizes[w].sum()) for w in windows])
        first, last = skip * local_batch, steps * local_batch - 1
        if last < first:
            return iter(())
        k, final = (int(np.searchsorted(ends, row, side="right")) for row in (first, last))
        offset = first - (int(ends[k - 1]) if k else 0)

        def read():
            handles = {}
            try:
                for index in range(k, final + 1):
                    ready = self._ahead.pop((seed, epoch, worker, index), None) if index == k else None
                    self._advise(windows, index + (index == k), handles, both=index == k and ready is None)
                    yield ready if ready is not None else self._window(windows[index], handles)
                if final == len(windows) - 1 and not last_epoch:   # the epoch's end: the next one's first window
                    self._read_ahead(epoch_windows(self.sizes, self.buffer, seed, epoch + 1, worker, self.groups), 0, seed,
                                     epoch + 1, worker, handles)
            finally:
                _close(handles)

        def gather():
            reader = Prefetcher(read(), depth=1)
            window, index, at = None, k, offset      # window: (x, y, order) of the one being sampled
            try:
                for _ in range(steps - skip):
                    xs, ys, wanted = [], [], local_batch
                    while wanted:       # a batch may span windows
                        if window is None or at == len(window[2]):
                            if window is not None:
                                self._give_back(window)
                                at = 0
                            x, y = next(reader)
                            window = x, y, window_order(len(x), seed, epoch, worker, index)
                            index += 1
                        x, y, order = window
                        rows = order[at:at + wanted]
                        xs.append(x[rows])
                        ys.append(y[rows])
                        at += len(rows)
                        wanted -= len(rows)
                    yield (xs[0], ys[0]) if len(xs) == 1 else (np.concatenate(xs), np.concatenate(ys))
            finally:
                reader.close()
                if window is not None:
                    self._give_back(window)

        return Prefetcher(gather())

    def _give_back(self, window):
        """Put the arrays of ``window`` (``(x, y, order)``, every sample gathered) back in the pool."""
        x, y, _ = window
        self._spare.put((x.base if x.base is not None else x, y.base if y.base is not None else y))

    def eval_batches(self, size=1024):
        """The whole part in order, in chunks of ``size`` (the last one shorter), read a block ahead.

        Evaluation needs no shuffle buffer: it reads a block at a time, so it
        holds a few blocks, not windows, beside what training holds.
        """
        def read():
            handles = {}
            try:
                for block in range(len(self.sizes)):
                    for ahead in (block, block + 1) if block == 0 else (block + 1,):
                        if ahead < len(self.sizes):
                            self.source.advise(int(self.cuts[ahead]), int(self.cuts[ahead + 1]), handles)
                    x, y = self.source.read(np.arange(self.cuts[block], self.cuts[block + 1]), handles)
                    yield _own(x), _own(y)      # the next read may reuse a direct read's buffer
            finally:
                _close(handles)

        reader = Prefetcher(read(), depth=1)
        try:
            yield from _rechunk(reader, size)
        finally:
            reader.close()

    def _advise(self, windows, index, handles, both=False):
        """Ask the kernel to read window ``index``'s blocks ahead (and the one before it too, with ``both``)."""
        for blocks in windows[index - 1:index + 1] if both else windows[index:index + 1]:
            for block in blocks:
                self.source.advise(int(self.cuts[block]), int(self.cuts[block + 1]), handles)

    def _window(self, blocks, handles):
        """The samples of ``blocks``, in the order read, one read call per block."""
        x, y = self._arrays(int(self.sizes[blocks].sum()))
        done = 0
        for block in blocks:
            bx, by = self.source.read(np.arange(self.cuts[block], self.cuts[block + 1]), handles)
            x[done:done + len(bx)], y[done:done + len(by)] = bx, by
            done += len(bx)
        return x, y

    def _allocate(self):
        """Put :data:`WINDOWS` windows' arrays in the pool, every page written: at set-up, not in training.

        A page's first write costs a fault (on a VM, tens of ms a window);
        done here, the memory the stream holds is also taken, and any
        shortage shows, before training starts, as a shard's loading would.
        """
        while self._allocated < WINDOWS:
            x, y = self._arrays(0, new=True)
            x.base[...] = 0
            y.base[...] = 0
            self._spare.put((x.base, y.base))

    def _arrays(self, length, new=False):
        """``(x, y)`` to hold a window of ``length`` samples: a spare pair where there is one, else new ones."""
        while not new:
            try:
                x, y = self._spare.get_nowait()
            except queue.Empty:
                break
            if len(x) >= length:
                return x[:length], y[:length]
        self._allocated += 1
        info, rows = self.source.info, self.window_rows()
        targets = ((rows,), np.int64) if info.num_classes else ((rows, info.target_width), self.dtype)
        return np.empty((rows,) + self.input_shape, dtype=self.dtype)[:length], np.empty(*targets)[:length]


def _own(array):
    """``array``, or a copy where its memory is not a numpy array's (a view of a read buffer)."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return array if root.base is None else array.copy()


def _rechunk(pieces, size):
    """The ``(x, y)`` of ``pieces`` (in order) cut into chunks of ``size``, the last one shorter."""
    xs, ys, have = [], [], 0
    for x, y in pieces:
        at = 0
        while at < len(x):
            take = min(size - have, len(x) - at)
            xs.append(x[at:at + take])
            ys.append(y[at:at + take])
            have, at = have + take, at + take
            if have == size:
                yield _joined(xs, ys)
                xs, ys, have = [], [], 0
    if have:
        yield _joined(xs, ys)


def _joined(xs, ys):
    return (xs[0], ys[0]) if len(xs) == 1 else (np.concatenate(xs), np.concatenate(ys))


def _close(handles):
    """Close the files a stream opened (``handles`` also holds their datasets, under ``(path, group)`` keys)."""
    for key, handle in handles.items():
        if not isinstance(key, tuple) or (key[0] == "direct" and handle is not None):
            handle.close()
        elif key[0] == "fd":
            os.close(handle)
    handles.clear()
