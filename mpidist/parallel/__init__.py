"""Strategies: how workers (and parameter servers) share the work of one training step.

One module per strategy, one interface (:class:`base.Strategy`); each module
registers its class (:func:`registry.register`), so importing this package
fills :data:`registry.STRATEGIES`.
"""

# imported in the order --strategy lists them (each module registers its class)
from .local import LocalStrategy  # isort: skip
from .allreduce import AllreduceStrategy  # isort: skip
from .ps_sync import PsSyncStrategy  # isort: skip
from .ps_async import PsAsyncStrategy  # isort: skip
from .pipeline import PipelineStrategy  # isort: skip
from .local_sgd import LocalSgdStrategy  # isort: skip
from .base import StepResult, Strategy
from .data_parallel import DataParallel
from .exchange import Exchange, NoExchange, bucket_slices
from .fully_sharded import FullyShardedStrategy
from .registry import STRATEGIES, Option, declared_options, register

__all__ = [
    "STRATEGIES",
    "AllreduceStrategy",
    "DataParallel",
    "Exchange",
    "FullyShardedStrategy",
    "NoExchange",
    "LocalSgdStrategy",
    "LocalStrategy",
    "Option",
    "PipelineStrategy",
    "PsAsyncStrategy",
    "PsSyncStrategy",
    "StepResult",
    "Strategy",
    "bucket_slices",
    "declared_options",
    "register",
]
