"""A worker's lanes of the training split read as training goes (or its part of an evaluation split), bounded
memory.

Datasets larger than ``--memory-budget`` stream.  For training, a worker
holds its lanes (:mod:`mpidist.data.lanes`): contiguous, balanced ranges of
rows, so its lanes are one contiguous range.  Each epoch each lane's units
are put in an order of their own and grouped into windows, each window's
samples permuted (:mod:`mpidist.data.order`), and step ``s`` takes sample
``s`` of every lane: the same samples on any number of workers, and in
memory (:class:`~mpidist.data.Shard` computes the same order row by row).

Two background threads.  One reads the windows in the order the steps need
them, each lane's next window while its current one is trained on, into a
pool of :data:`~mpidist.data.blocks.WINDOWS` windows a lane, allocated and
written at set-up and reused.  The other gathers the batches a segment of
steps at a time (steps during which no lane changes window): one take from
the pool per segment, through an index of each lane's current window in its
permuted order, a copy, as a shard in memory's batches are.  The first
windows are read at set-up (:meth:`Stream.prime`) and, while an epoch's last
batches train, the next epoch's.  The order is a function of the seed, the
epoch, the lanes, the buffer and the sample's size (nothing read, nothing
timed), so a resumed run, on any number of workers, starts at the windows
holding its step and continues exactly.  The windows are made as they are
needed: nothing here grows with the split, only with what a worker reads.

An evaluation split is streamed as a worker's contiguous part
(:func:`~mpidist.data.blocks.worker_range`), in order, a block at a time.

A lane's consecutive samples come from one window: random units of the lane,
not the whole lane; a batch still draws one sample from each of the ``B``
lanes, spread over the whole split.
"""

import os
import queue
import threading

import numpy as np

from .batches import Prefetcher
from .blocks import (
    WINDOWS,
    block_bytes_for,
    block_cuts,
    default_buffer,
    lane_share,
    segment_steps,
    worker_range,
)
from .order import order_for
from .rows import SplitRows


class Stream:
    """One split's rows for one worker, streamed.  Arguments as :class:`~mpidist.data.Shard`'s, and:

    Args:
        buffer: samples in the shuffle buffer, shared by the lanes (0:
            :func:`~mpidist.data.blocks.default_buffer`).
        direct: read around the page cache where the file system allows it (``--stream-io direct``).
        sliced: read a chunk larger than a block in slices (see :func:`~mpidist.data.blocks.block_cuts`).
        lanes: the worker's :class:`~mpidist.data.lanes.Lanes` of the training split; None for an evaluation's
            part.
    """

    mode = "stream"

    def __init__(
        self,
        info,
        split,
        worker,
        num_workers,
        input_shape,
        dtype,
        buffer=0,
        direct=False,
        sliced=False,
        lanes=None,
    ):
        self.source = SplitRows(info, split, input_shape, dtype, direct)
        count, self.lanes = self.source.count, lanes
        asked = int(buffer) or default_buffer(input_shape, dtype)
        if lanes is None:
            self.lo, self.hi = worker_range(count, num_workers, worker)
            # (a window holds the part at most: a larger buffer orders it as one window too)
            self.buffer = self.share = max(1, min(asked, self.hi - self.lo))
            self.blocks = (block_bytes_for(self.share, input_shape, dtype), sliced)
            return
        self.lo, self.hi = lanes.span(count)
        # (the split caps it, not the worker's part: the order must not depend on the worker count)
        self.buffer = max(1, min(asked, count))
        self.share = lane_share(self.buffer, count, lanes.total)
        self.order = order_for(info, split, self.buffer, input_shape, lanes.total)
        # (read in order: eval_batches)
        self.blocks = (
            block_bytes_for(self.share, input_shape, dtype),
            sliced,
        )
        # a window holds its units, and its lane at most
        rows = min(self.order.unit * self.order.window, int(lanes.sizes(count).max(initial=1)))
        self.pool = Pool(lanes.count, rows, input_shape, dtype, info)
        self._ahead = {}  # windows read before they were asked for: (seed, epoch, lane, window) -> slot

    def __len__(self):
        return self.hi - self.lo

    def prime(self, seed, epoch, step):
        """Read now the windows that hold step ``step`` of ``epoch``: the first batches then wait for nothing.

        The run's set-up calls it where a shard in memory is loaded, so both
        modes start training with their data at hand.  An epoch read to its
        end (but the run's last) reads the next one's first windows the same
        way, while its last batches train.
        """
        self.pool.allocate()
        self._ahead = {}
        self.pool.release({})
        handles = {}
        try:
            self._read_ahead(
                list(self._schedule(seed, epoch, step, step + 1)), seed, epoch, handles, threading.Event()
            )
        finally:
            _close(handles)

    def _schedule(self, seed, epoch, first, last):
        """The windows of this stream's lanes holding positions ``[first, last)`` of ``epoch``, in turn."""
        return self.order.windows(self.lanes.ids, seed, epoch, first, last)

    def _key(self, seed, epoch, window):
        return seed, epoch, self.lanes.first + window.lane, window.index

    def _read_ahead(self, windows, seed, epoch, handles, stop):
        """Read ``windows`` of ``epoch`` into free slots, kept for the :meth:`batches` that asks for them."""
        self._advise([w.units for w in windows], handles)
        for window in windows:
            slot = self.pool.take(stop)
            if slot is None:
                return
            self._read(window.units, slot, handles)
            self._ahead[self._key(seed, epoch, window)] = slot

    def batches(self, steps, seed, epoch, skip=0, last_epoch=False):
        """The ``(x, y)`` batches of steps ``skip..steps-1`` of ``epoch``: windows read ahead, batches
        gathered ahead.

        Read to its end, an epoch reads the next one's first windows while its
        last batches train, unless it is the ``last_epoch`` (reading for nothing).
        """
        if skip >= steps:
            return Prefetcher(iter(()))
        self.pool.allocate()
        # the windows read ahead (by prime, or the last epoch's end) are the first ones: any other slot is
        # free
        first = {self._key(seed, epoch, window) for window in self._schedule(seed, epoch, skip, skip + 1)}
        ready = {key: slot for key, slot in self._ahead.items() if key in first}
        self._ahead = {}
        self.pool.release(ready)
        stop = threading.Event()  # the batches were closed early: the reading thread lets go

        def read():
            handles, advised = {}, None  # (the window advised last: the kernel reads it ahead)
            try:
                windows = self._schedule(seed, epoch, skip, steps)
                following = next(windows, None)
                while following is not None:
                    window, following = following, next(windows, None)
                    slot = ready.pop(self._key(seed, epoch, window), None)
                    if slot is None:
                        self._advise(
                            [w.units for w in (window, following) if w is not None and w != advised], handles
                        )
                        advised = following
                        slot = self.pool.take(stop)
                        if slot is None:
                            return
                        self._read(window.units, slot, handles)
                    lane = self.lanes.first + window.lane
                    yield slot, self.order.window_order(window.rows, seed, epoch, lane, window.index)
                if not last_epoch:  # the epoch's end: the next one's first windows
                    self._read_ahead(
                        list(self._schedule(seed, epoch + 1, 0, 1)), seed, epoch + 1, handles, stop
                    )
            finally:
                _close(handles)

        # (the gathering thread walks the same schedule again for the windows' starts: a few integers a
        # window, where sharing one generator between the two threads would need a lock)
        return Prefetcher(self._gather(self._schedule(seed, epoch, skip, steps), read(), steps, skip, stop))

    def _gather(self, windows, reads, steps, skip, stop):
        """The batches of steps ``skip..steps-1``, a segment of steps at a time, from ``windows`` (their
        :class:`~mpidist.data.order.Window`\\ s, in turn) as ``reads`` gives them read."""
        pool = self.pool
        (x, y, index), count, rows = pool.arrays, self.lanes.count, pool.rows
        reader = Prefetcher(reads, depth=pool.slots)
        held, begins, lanes = [None] * count, np.zeros(count, dtype=np.int64), np.arange(count)
        most = segment_steps(self.share, count * (x[:1].nbytes + y[:1].nbytes))
        at, following, finished = skip, next(windows, None), False
        try:
            while at < steps:
                while following is not None and following.start <= at:
                    window, following = following, next(windows, None)
                    slot, order = next(reader)
                    index[window.lane, : window.rows] = slot * rows + order
                    begins[window.lane] = window.start
                    if held[window.lane] is not None:
                        pool.free.put(held[window.lane])
                    held[window.lane] = slot
                end = min(steps, at + most, following.start if following is not None else steps)
                taken = index[lanes[None, :], np.arange(at, end)[:, None] - begins[None, :]].ravel()
                bx, by = x[taken], y[taken]
                bx, by = (
                    bx.reshape((end - at, count) + bx.shape[1:]),
                    by.reshape((end - at, count) + by.shape[1:]),
                )
                for step in range(end - at):
                    yield bx[step], by[step]
                at = end
            finished = True
        finally:
            for slot in held:
                if slot is not None:
                    pool.free.put(slot)
            if not finished:
                stop.set()
            reader.close()

    def eval_batches(self, size=1024):
        """The whole part in order, in chunks of ``size`` (the last one shorter), read a block ahead.

        Evaluation needs no shuffle buffer: it reads a block at a time, so it
        holds a few blocks, not windows, beside what training holds.
        """
        cuts = block_cuts(self.source, self.lo, self.hi, *self.blocks)

        def read():
            handles = {}
            try:
                for block in range(len(cuts) - 1):
                    for ahead in (block, block + 1) if block == 0 else (block + 1,):
                        if ahead < len(cuts) - 1:
                            self.source.advise(int(cuts[ahead]), int(cuts[ahead + 1]), handles)
                    x, y = self.source.read(np.arange(cuts[block], cuts[block + 1]), handles)
                    yield _own(x), _own(y)  # the next read may reuse a direct read's buffer
            finally:
                _close(handles)

        reader = Prefetcher(read(), depth=1)
        try:
            yield from _rechunk(reader, size)
        finally:
            reader.close()

    def _advise(self, windows, handles):
        """Ask the kernel to read the units of ``windows`` (tuples of ``(lo, hi)`` rows) ahead."""
        for units in windows:
            for lo, hi in units:
                self.source.advise(lo, hi, handles)

    def _read(self, units, slot, handles):
        """The samples of ``units`` (``(lo, hi)`` rows) into slot ``slot`` of the pool, in turn, a read call
        each."""
        x, y, _ = self.pool.arrays
        at = slot * self.pool.rows
        for lo, hi in units:
            bx, by = self.source.read(np.arange(lo, hi), handles)
            x[at : at + len(bx)], y[at : at + len(by)] = bx, by
            at += len(bx)


class Pool:
    """The windows a training stream holds: :data:`~mpidist.data.blocks.WINDOWS` slots a lane of ``rows``
    samples each, in one array allocated and written once, reused; and which slots no window holds.

    The reading thread takes free slots, the gathering thread gives them back
    once their window's samples are gathered.  ``arrays`` is ``(x, y,
    index)``: the samples, their targets, and each lane's current window's
    samples (rows of ``x``) in its permuted order.
    """

    def __init__(self, lanes, rows, input_shape, dtype, info):
        self.lanes, self.rows, self.slots = lanes, max(1, int(rows)), WINDOWS * lanes
        self.input_shape, self.dtype, self.info = tuple(input_shape), np.dtype(dtype), info
        self.arrays = None
        self.free = queue.Queue()

    def allocate(self):
        """The arrays, every page written: at set-up, not in training (all slots free on first call).

        A page's first write costs a fault (on a VM, tens of ms a window);
        done here, the memory the stream holds is also taken, and any
        shortage shows, before training starts, as a shard's loading would.
        """
        if self.arrays is not None:
            return
        rows = self.slots * self.rows
        targets = ((rows,) + self.info.target_shape, np.int64 if self.info.num_classes else self.dtype)
        x, y = np.zeros((rows,) + self.input_shape, dtype=self.dtype), np.zeros(*targets)
        index = np.zeros((self.lanes, self.rows), dtype=np.int64)
        for array in (x, y, index):
            array.reshape(-1)[:: max(1, 4096 // array.itemsize)] = 0  # (np.zeros may map untouched pages)
        self.arrays = x, y, index
        self.release({})

    def take(self, stop):
        """A free slot, once one is; None once ``stop`` (an Event) is set."""
        while True:
            try:
                return self.free.get(timeout=0.05)
            except queue.Empty:
                if stop.is_set():
                    return None

    def release(self, kept):
        """Every slot free but those in ``kept`` (a dict's values): no thread uses the pool."""
        self.free = queue.Queue()
        for slot in sorted(set(range(self.slots)) - set(kept.values())):
            self.free.put(slot)


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
            xs.append(x[at : at + take])
            ys.append(y[at : at + take])
            have, at = have + take, at + take
            if have == size:
                yield _joined(xs, ys)
                xs, ys, have = [], [], 0
    if have:
        yield _joined(xs, ys)


def _joined(xs, ys):
    return (xs[0], ys[0]) if len(xs) == 1 else (np.concatenate(xs), np.concatenate(ys))


def _close(handles):
    """Close the files a stream opened (``handles`` also holds their datasets, under ``(path, group)``
    keys)."""
    for key, handle in handles.items():
        if not isinstance(key, tuple) or (key[0] == "direct" and handle is not None):
            handle.close()
        elif key[0] == "fd":
            os.close(handle)
    handles.clear()
