"""``allreduce``: synchronous data parallelism with fused, bucketed ``Allreduce``.

The chief initialises the parameters and broadcasts them (one ``Bcast`` of
the flat buffer).  Each step every worker back-propagates a loss weighted by
its share of the global batch, so an in-place ``Allreduce(SUM)`` of the flat
gradient buffer *is* the global mean gradient; every worker then applies the
same optimizer update to identical parameters.  The buffer is cut into
contiguous buckets of at most ``bucket_bytes``, each reduced by a non-blocking
``Iallreduce`` started as soon as backward has filled it
(:mod:`mpidist.parallel.exchange`): one MPI call per bucket, never one per
tensor, and no copy.
"""

from .base import DataParallel
from .compression import CompressedExchange
from .exchange import Exchange
from .registry import Option, register


@register
class AllreduceStrategy(DataParallel):
    """Every worker holds the model; gradients are summed with ``Allreduce``."""

    name = "allreduce"
    elastic_recovery = True
    options = (Option("compress", "none", "allreduce: send gradients as 16-bit floats, with error feedback "
                                          "(half the bytes; see the performance docs)",
                      choices=("none", "fp16", "bf16")),)

    @classmethod
    def arguments(cls, settings, setup):
        return {"compress": settings.compress}

    def __init__(self, *args, compress="none", **kwargs):
        self.compress = compress
        super().__init__(*args, **kwargs)

    def make_exchange(self):
        if self.compress == "none":
            return Exchange(self.worker_comm, self.buffer, self.bucket_bytes)
        return CompressedExchange(self.worker_comm, self.buffer, self.bucket_bytes, self.compress)
