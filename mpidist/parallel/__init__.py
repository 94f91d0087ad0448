"""Strategies: how workers (and parameter servers) share the work of one training step.

One module per strategy, one interface (:class:`base.Strategy`).
"""

from .allreduce import AllreduceStrategy, bucket_slices
from .base import DataParallel, Strategy
from .local import LocalStrategy
from .pipeline import PipelineStrategy
from .ps_async import PsAsyncStrategy
from .ps_sync import PsSyncStrategy

STRATEGIES = {cls.name: cls for cls in (LocalStrategy, AllreduceStrategy, PsSyncStrategy, PsAsyncStrategy,
                                        PipelineStrategy)}

__all__ = ["STRATEGIES", "AllreduceStrategy", "DataParallel", "LocalStrategy", "PipelineStrategy", "PsAsyncStrategy", "PsSyncStrategy", "Strategy",
           "bucket_slices"]
