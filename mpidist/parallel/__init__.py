"""Strategies: how workers (and parameter servers) share the work of one training step.

A small core and one package per family.  The core is what every strategy
is and shares: the interface (:mod:`~mpidist.parallel.base`, its
declarations :mod:`~mpidist.parallel.declared`), the registry, the mesh, the
step's verdict, the recipe around the optimizer and the optimizer of a
slice, a worker's passes, the cut of a flat buffer into shards, a rank's
part along the tensor axis as strategies see it (:mod:`~mpidist.parallel.parts`),
and what survives a lost rank or a checkpoint (recovery, rewind, saved
state).  The families import the core and never each other:

* :mod:`~mpidist.parallel.data`: ``local``, ``allreduce`` and its exchanges,
  ``local-sgd``, ``--shard optimizer`` and ``--shard parameters``;
* :mod:`~mpidist.parallel.ps`: ``ps-sync``, ``ps-async``, backup workers;
* :mod:`~mpidist.parallel.pipeline`: stages, schedules and their runner;
* :mod:`~mpidist.parallel.tensor`: the tensor parts (``--tensor T``).

:mod:`~mpidist.parallel.holding` (what a rank holds under any layout, before
a strategy exists) reads several families' arithmetic, and this package's
roll-call imports every family: both sit above the families.  Each family
registers its classes (:func:`registry.register`, :func:`registry.register_split`),
so importing this package fills :data:`registry.STRATEGIES`.
"""

# imported in the order --strategy lists them (each module registers its class)
from .data.local import LocalStrategy  # isort: skip
from .data.allreduce import AllreduceStrategy  # isort: skip
from .ps.sync import PsSyncStrategy  # isort: skip
from .ps.asynchronous import PsAsyncStrategy  # isort: skip
from .pipeline.strategy import PipelineStrategy  # isort: skip
from .data.local_sgd import LocalSgdStrategy  # isort: skip
from . import tensor  # noqa: F401  (registers the tensor axis's split)
from .base import StepResult, Strategy
from .data.exchange import Exchange, NoExchange, bucket_slices
from .data.fully_sharded import FullyShardedStrategy
from .data.replicated import DataParallel
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
