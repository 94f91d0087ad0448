"""``allreduce``: synchronous data parallelism with fused, bucketed ``Allreduce``.

The chief initialises the parameters and broadcasts them (one ``Bcast`` of
the flat buffer).  Each step every worker back-propagates a loss weighted by
its share of the global batch, so an in-place ``Allreduce(SUM)`` of the flat
gradient buffer *is* the global mean gradient; every worker then applies the
same optimizer update to identical parameters.  The buffer is cut into
contiguous buckets of at most ``bucket_bytes``: one MPI call per bucket, never
one per tensor, and no copy.
"""

from .. import comm as mpi
from .base import DataParallel
from .registry import register


def bucket_slices(count, itemsize, bucket_bytes):
    """Contiguous ``(lo, hi)`` element ranges covering ``[0, count)``, each at most ``bucket_bytes``.

    >>> bucket_slices(10, 4, 16)
    [(0, 4), (4, 8), (8, 10)]
    """
    per_bucket = max(1, bucket_bytes // itemsize)
    return [(lo, min(lo + per_bucket, count)) for lo in range(0, count, per_bucket)]


@register
class AllreduceStrategy(DataParallel):
    """Every worker holds the model; gradients are summed with ``Allreduce``."""

    name = "allreduce"
    elastic_recovery = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buckets = bucket_slices(self.buffer.size, self.buffer.itemsize, self.bucket_bytes)

    def exchange(self, buffer):
        comm = self.worker_comm
        for lo, hi in self.buckets:
            mpi.allreduce_sum(comm, buffer[lo:hi])
