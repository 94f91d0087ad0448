"""Strategies: how workers share the work of one training step.

One module per strategy, one interface (:class:`base.Strategy`).
"""

from .allreduce import AllreduceStrategy, bucket_slices
from .base import DataParallel, Strategy
from .local import LocalStrategy

STRATEGIES = {cls.name: cls for cls in (LocalStrategy, AllreduceStrategy)}

__all__ = ["STRATEGIES", "AllreduceStrategy", "DataParallel", "LocalStrategy", "Strategy", "bucket_slices"]
