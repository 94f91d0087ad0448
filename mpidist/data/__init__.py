"""Datasets: the HDF5 layout, each worker's part of it, and the batches a run trains on.

One module per concept:

* :mod:`~mpidist.data.sources`: the files ``--data`` names (:func:`resolve`),
  a directory's or a glob's in order, each opened;
* :mod:`~mpidist.data.layout`: what a file or a directory of files must hold,
  checked before anything is read (:func:`inspect`), each item fetched and
  the optional ones checked by :mod:`~mpidist.data.items`;
* :mod:`~mpidist.data.info`: what a checked dataset is (:class:`DatasetInfo`),
  and the splits a run cuts from it (``--val-fraction``, ``--eval-samples``),
  whose rows :mod:`~mpidist.data.selection` computes as they are read;
* :mod:`~mpidist.data.rows`: a split's rows across its files, read in as few
  calls as their pattern allows;
* :mod:`~mpidist.data.samples`: the checks and conversions every read sample
  goes through;
* :mod:`~mpidist.data.lanes`: the global batch's lanes, each fed one sample a
  step from an order of its own, whatever the worker count;
* :mod:`~mpidist.data.shard`: a worker's lanes (or an evaluation's strided
  shard), read whole into memory;
* :mod:`~mpidist.data.stream`: a worker's lanes, streamed through windows of
  the order's units (:mod:`~mpidist.data.order`), or an evaluation's
  contiguous part, in chunk-aligned blocks (:mod:`~mpidist.data.blocks`),
  with bounded memory;
* :mod:`~mpidist.data.budget`: which of the two a rank uses (``--data-mode``,
  ``--memory-budget``);
* :mod:`~mpidist.data.batches`: batch sizes every worker agrees on,
  prefetching.

Every worker reads only its own part of each split.
"""

from .arrays import ArrayData
from .batches import (
    Prefetcher,
    eval_batches,
    global_batches,
    left_out,
    local_batch_size,
    shard_size,
    steps_per_epoch,
    train_batches,
)
from .budget import Reading, budget_of, order_buffer_for, plan
from .info import DatasetInfo, Member, carve_validation, limit_evaluation
from .items import MAX_NAME
from .lanes import Lanes
from .layout import MAX_CLASSES, OPTIONAL_SPLITS, SPLITS, inspect
from .rows import SplitRows, read_rows
from .samples import standardizer
from .shard import Shard
from .sources import bundled_names, data_dirs, members, open_source, resolve
from .stream import Stream

_read_rows = read_rows  # (the name tests knew)

__all__ = [
    "ArrayData",
    "DatasetInfo",
    "Lanes",
    "MAX_CLASSES",
    "MAX_NAME",
    "Member",
    "OPTIONAL_SPLITS",
    "Prefetcher",
    "Reading",
    "SPLITS",
    "Shard",
    "SplitRows",
    "Stream",
    "budget_of",
    "bundled_names",
    "carve_validation",
    "data_dirs",
    "eval_batches",
    "global_batches",
    "inspect",
    "limit_evaluation",
    "left_out",
    "local_batch_size",
    "members",
    "open_source",
    "order_buffer_for",
    "plan",
    "read_rows",
    "resolve",
    "shard_size",
    "standardizer",
    "steps_per_epoch",
    "train_batches",
]
