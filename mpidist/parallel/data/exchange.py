"""Gradient exchanges: how data-parallel workers turn their gradients into the sum, and when.

A data-parallel strategy is given an exchange object; the strategy decides
*what* is summed (the flat gradient buffer, followed by the weighted loss),
the exchange decides *how* (plain ``Iallreduce``, or compressed) and *when*.

Backward fills the flat gradient buffer from the last layer to the first, and
layer ``i``'s parameters lie above layer ``i - 1``'s, so the buffer is cut into
buckets from the top.  As soon as backward has finished every layer under a
bucket, :meth:`Exchange.ready` starts that bucket's non-blocking reduction and
drives MPI's progress on the ones already started; :meth:`Exchange.finish`
waits for the rest just before the optimizer.  This is what Horovod's tensor
fusion and DDP's gradient buckets do.  One MPI call per bucket, never one per
tensor, and no copy.
"""

import numpy as np

from ...nn.precision import BLOCK, is_low, squared_sum
from ...runtime import comm as mpi
from ...runtime import recorder
from ..verdict import decide

_TRACER = recorder.tracer()


def bucket_slices(count, itemsize, bucket_bytes):
    """Contiguous ``(lo, hi)`` element ranges covering ``[0, count)``, each at most ``bucket_bytes``.

    >>> bucket_slices(10, 4, 16)
    [(0, 4), (4, 8), (8, 10)]
    """
    per_bucket = max(1, bucket_bytes // itemsize)
    return [(lo, min(lo + per_bucket, count)) for lo in range(0, count, per_bucket)]


def top_down_buckets(count, itemsize, bucket_bytes):
    """Buckets in the order backward completes them: cut from the top of ``[0, count)``, highest first.

    The lowest bucket is the short one, so the last reduction to start (after
    the first layer's backward, with nothing left to overlap) is the smallest.

    >>> top_down_buckets(10, 4, 16)
    [(6, 10), (2, 6), (0, 2)]
    """
    per_bucket = max(1, bucket_bytes // itemsize)
    return [(max(hi - per_bucket, 0), hi) for hi in range(count, 0, -per_bucket)]


class NoExchange:
    """One worker: its weighted gradients already are the sum.

    Every exchange also answers whether the summed buffer is all finite
    (:meth:`finite`, the lockstep strategies' NaN check).  It checks each part
    when it has just been written, still in cache: here as backward fills the
    buffer, in :class:`Exchange` as each bucket's sum arrives.  (A NaN or Inf
    anywhere makes the squared norm NaN or Inf; so does a norm above about
    1.8e19 in float32, which only a diverging run reaches.)

    Args:
        buffer: the contiguous array (gradients, then the weighted loss), or
            None where nobody asks :meth:`finite`.
    """

    bytes_per_step = 0
    #: Whether :attr:`buffer` is memory of the exchange's own that the strategy's gradients must be bound to
    #: (and bound away from before :meth:`free`): the shared-memory exchange's window.
    holds_buffer = False
    #: Whether the model's parameters live in :attr:`params`, memory of the exchange's own (one copy per
    #: node).
    holds_params = False

    def __init__(self, buffer=None):
        self.buffer = buffer
        #: The summed gradient's squared norm as far as it has arrived (an exchange that sums otherwise sets
        #: it)
        self.summed_squares = 0.0
        self._unchecked = 0
        # a 16-bit buffer's squares are summed in float32, a block at a time through this (host arrays)
        self._wide = (
            np.empty(BLOCK, np.float32) if isinstance(buffer, np.ndarray) and is_low(buffer.dtype) else None
        )

    def begin(self):
        """A new step's gradients are about to be computed."""
        self.summed_squares = 0.0
        self._unchecked = 0 if self.buffer is None else self.buffer.size

    def ready(self, lo):
        """``buffer[lo:]`` holds its final values for this step."""
        self._check(lo, self._unchecked)

    def finish(self):
        """Return once ``buffer`` holds the sum over the workers."""
        self._check(0, self._unchecked)

    def free(self):
        """Release what the exchange holds of MPI (a compressed one's reduction operation)."""

    def after_update(self):
        """After the optimizer's step (taken or skipped): what must hold before the next forward."""

    def squared_norm(self):
        """The summed gradient's squared norm (the loss left out), taken as its parts arrived (after
        :meth:`finish`): what the step's :func:`~mpidist.parallel.verdict.decide` reads."""
        return self.summed_squares

    def own_state(self):
        """What this worker's exchange carries from step to step, its own (name -> flat array): none here."""
        return {}

    def optimizer_part(self):
        """The slice of the model this rank's optimizer updates where the exchange decides it, else None (the
        strategy's choice: the whole model, or ``--shard optimizer``'s slice).  Collective where it is not
        None."""
        return None

    def stats(self):
        """The exchange's own figures for the ``done`` event: none here."""
        return {}

    def finite(self):
        """Whether every element of the summed buffer is finite (after :meth:`finish`)."""
        return not decide(self.summed_squares, self.buffer[-1], 0.0).skip  # (the verdict's own rule)

    def _check(self, lo, hi):
        """Add the squares of the gradients in ``buffer[lo:hi]`` (one BLAS pass, no temporary; the loss slot
        is the verdict's to look at).

        One worker checks from the top down as backward fills the buffer
        (``_unchecked`` is where it has got to); an exchange, bucket by bucket.
        """
        if lo < hi:
            part = self.buffer[lo : min(hi, self.buffer.size - 1)]
            self.summed_squares += squared_sum(part, self._wide)
            self._unchecked = min(self._unchecked, lo)


class Exchange(NoExchange):
    """In-place sum of ``buffer`` over ``comm``, bucket by bucket, overlapped with backward.

    Args:
        comm: the workers' communicator.
        buffer: the contiguous array summed (gradients, then the weighted loss).
        bucket_bytes: largest bucket.
        overlap: start each bucket as soon as it is ready (False: all of them
            in :meth:`finish`, after backward, one after another).
    """

    def __init__(self, comm, buffer, bucket_bytes, overlap=True):
        super().__init__(buffer)
        self.comm, self.overlap = comm, overlap
        self.buckets = top_down_buckets(buffer.size, buffer.itemsize, bucket_bytes)
        self.bytes_per_step = int(buffer.nbytes)
        self._next, self._pending = 0, []
        self._began = {}  # --trace: (lo, hi) -> when the bucket started

    def begin(self):
        super().begin()
        self._next, self._pending = 0, []

    def ready(self, lo):
        if not self.overlap:
            return
        while self._next < len(self.buckets) and self.buckets[self._next][0] >= lo:
            self._start(*self.buckets[self._next])
            self._next += 1
        # progress: MPICH moves a started collective only inside MPI calls
        self._pending = [
            (bucket, pending) for bucket, pending in self._pending if not self._arrived(bucket, pending)
        ]

    def finish(self):
        while self._next < len(self.buckets):
            self._start(*self.buckets[self._next])
            self._next += 1
            if not self.overlap:  # one at a time, as blocking calls would
                bucket, pending = self._pending.pop()
                pending.wait()
                self._check(*bucket)
        for bucket, pending in self._pending:
            pending.wait()
            self._check(*bucket)
        self._pending = []

    def _arrived(self, bucket, pending):
        """Whether the bucket's sum is in (then checked, while it is in cache)."""
        if pending.test():
            self._check(*bucket)
            return True
        return False

    def _check(self, lo, hi):
        super()._check(lo, hi)
        began = self._began.pop((lo, hi), None)
        if began is not None:  # --trace: the bucket from its start to its arrival
            _TRACER.complete(
                "bucket",
                "exchange",
                began,
                recorder.BUCKETS,
                lo=lo,
                hi=hi,
                bytes=(hi - lo) * self.buffer.itemsize,
            )

    def _mark(self, lo, hi):
        """--trace: bucket ``[lo, hi)`` starts now (a span until :meth:`_check` sees it arrive)."""
        if _TRACER.on:
            self._began[(lo, hi)] = recorder.now()

    def _start(self, lo, hi):
        """Start reducing ``buffer[lo:hi]`` (compressed exchanges override this and :meth:`finish`)."""
        self._mark(lo, hi)
        self._pending.append(((lo, hi), mpi.iallreduce_sum(self.comm, self.buffer[lo:hi])))
