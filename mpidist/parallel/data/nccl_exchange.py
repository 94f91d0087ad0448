"""``allreduce``'s exchange on GPUs by NCCL: each bucket summed where it lies, while backward goes on.

Where every worker has a GPU of its own and NCCL is there
(:func:`~mpidist.runtime.nccl_sum.nccl_group`), a bucket's sum is queued on
NCCL's stream as soon as backward has written it, and backward goes on on
its own stream meanwhile: the two overlap on the device, and no bucket goes
through host memory (an MPI without CUDA support staged every bucket there,
and the host waited for each).  :meth:`NcclExchange.finish` makes the
compute stream wait for the sums, then takes their squared norm there, as
every exchange does for the step's verdict: the host waits once, for that
number.
"""

from .exchange import Exchange


class _Queued:
    """A bucket's sum queued on NCCL's stream: nothing for the host to wait for (the device waits, in
    :meth:`NcclExchange.finish`)."""

    def test(self):
        return False

    def wait(self):
        pass


class NcclExchange(Exchange):
    """:class:`~mpidist.parallel.data.exchange.Exchange` whose buckets NCCL sums.

    Args:
        group: the workers' :class:`~mpidist.runtime.nccl_sum.NcclSum` (or a stand-in with ``sum``,
            ``join`` and ``free``).
        buffer: the contiguous device array summed (gradients, then the weighted loss).
        bucket_bytes: largest bucket.
        overlap: queue each bucket as backward finishes it (False: all of them in :meth:`finish`).
    """

    def __init__(self, group, buffer, bucket_bytes, overlap=True):
        super().__init__(None, buffer, bucket_bytes, overlap)
        self.group = group

    def _start(self, lo, hi):
        self._mark(lo, hi)
        self.group.sum(self.buffer[lo:hi])
        self._pending.append(((lo, hi), _Queued()))

    def finish(self):
        while self._next < len(self.buckets):
            self._start(*self.buckets[self._next])
            self._next += 1
        self.group.join()  # (the device's wait: what follows on the compute stream reads the sums)
        for bucket, _ in self._pending:
            self._check(*bucket)
        self._pending = []

    def free(self):
        self.group.free()

    def stats(self):
        return {**super().stats(), "exchange_route": "nccl"}
