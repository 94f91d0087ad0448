"""Batches: sizes every worker agrees on, background prefetch.

The global batch ``B`` is split as evenly as possible over ``W`` workers (the
first ``B % W`` take one more sample): worker ``w``'s share is its lanes
(:mod:`mpidist.data.lanes`).  An epoch has ``n // B`` steps on any number of
workers.  A shard (in memory or streamed) gives its own batches; the functions
here are what the loop and the strategies call, whatever the shard.
"""

import queue
import threading

from ..runtime.errors import UsageError


def shard_size(n, num_workers, worker):
    """Rows ``worker, worker + W, ...`` below ``n`` (an evaluation's strided shard)."""
    return len(range(worker, n, num_workers))


def local_batch_size(global_batch, num_workers, worker):
    """This worker's part of the global batch (the first ``B % W`` take one more)."""
    return global_batch // num_workers + (1 if worker < global_batch % num_workers else 0)


def steps_per_epoch(n, global_batch, num_workers):
    """Steps per epoch: ``n // B``, one sample of each of the ``B`` lanes a step, whatever the worker
    count."""
    if global_batch < num_workers:
        raise UsageError(
            f"--batch-size {global_batch} is smaller than the number of workers ({num_workers}): "
            "every worker needs at least one sample per step"
        )
    return n // global_batch


#: an epoch that leaves out this share of the training samples or more is said at start-up
LEFT_OUT_SAID = 0.1


def left_out(n, global_batch, num_workers):
    """What an epoch of ``n`` samples at global batch ``B`` leaves out (its last ``n mod B``), and the batch
    size nearest ``B`` (from ``B / 2`` to ``2 B``) that leaves out none, or the fewest; None where it is
    under :data:`LEFT_OUT_SAID` of the samples.

    >>> left_out(127, 64, 1).split("; ")[-1]
    '--batch-size 127 trains every sample every epoch'
    """
    dropped = n % global_batch
    if dropped < LEFT_OUT_SAID * n:
        return None
    steps = n // global_batch
    sizes = range(max(num_workers, global_batch // 2, 1), min(n, 2 * global_batch) + 1)
    best = min(sizes, key=lambda size: (n % size, abs(size - global_batch)))
    then = (
        f"--batch-size {best} trains every sample every epoch"
        if n % best == 0
        else f"--batch-size {best} leaves out {n % best}"
    )
    return (
        f"{n:,} training samples at --batch-size {global_batch}: an epoch is {steps} step"
        f"{'s' if steps != 1 else ''}, and the other {dropped:,} ({100 * dropped / n:.0f}%) wait for a later "
        f"epoch (each epoch draws its own order); {then}"
    )


class Prefetcher:
    """Iterate ``source`` in a background thread, ``depth`` items ahead.

    An exception in the thread is re-raised in the consumer; :meth:`close`
    stops the thread early (e.g. when ``--steps`` ends an epoch midway).
    """

    _END = object()

    def __init__(self, source, depth=2):
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(iter(source),), daemon=True, name="mpidist-prefetch"
        )
        self._thread.start()

    def _run(self, iterator):
        try:
            for item in iterator:
                if self._stop.is_set():
                    return
                self._put(item)
        except BaseException as err:  # handed to the consumer, which raises it with its traceback
            self._put(err)
            return
        finally:  # a source stopped early lets go of what it holds (a stream's open files) in this thread
            getattr(iterator, "close", lambda: None)()
        self._put(self._END)

    def _put(self, item):
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self._stop.set()
        while self._thread.is_alive():  # take what it offers: a put waiting for room returns at once
            try:
                self._queue.get(timeout=0.01)
            except queue.Empty:
                pass
        self._thread.join()


def train_batches(shard, steps, seed, epoch, skip=0, last_epoch=False):
    """The ``(x, y)`` batches of one epoch of ``shard`` (opened with its worker's lanes) from step ``skip``
    on, prefetched.

    ``last_epoch``: no epoch follows (a stream then reads nothing of the next).
    """
    return shard.batches(steps, seed, epoch, skip=skip, last_epoch=last_epoch)


def global_batches(split, steps, seed, epoch, skip=0, last_epoch=False):
    """In-graph replication, on the chief: whole global batches of one epoch, prefetched.

    ``split`` holds every lane (worker 0 of 1): the global batches every
    layout of the lanes over workers gives, in-graph or not.
    """
    return split.batches(steps, seed, epoch, skip=skip, last_epoch=last_epoch)


def eval_batches(shard, size=1024):
    """The whole shard in order, in chunks of ``size``."""
    return shard.eval_batches(size)
