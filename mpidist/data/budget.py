"""Whether a rank reads its shards whole into memory or streams them: ``--data-mode`` and ``--memory-budget``.

A rank holds its shards in memory when what it reads (its training shard, and
the evaluation shards it reads) fits its budget at the peak of reading (as
stored, converted, and standardised where the dataset says so); otherwise it
streams every split it reads.  The data order is the same either way
(:mod:`mpidist.data.order`): it depends on the run's shuffle buffer, which
every rank sizes alike (:func:`order_buffer_for`, from the largest worker's
lanes and the budget) and a resumed run takes from its checkpoint, so a
resume or a shrink on another worker count, in another mode or with another
budget continues the very order.

A stream's every buffer is sized from the budget and checked against it
before anything is allocated (:func:`~mpidist.data.blocks.stream_bytes`): its
lanes' windows, the batches it gathers ahead, the block being read, an
evaluation's blocks, and the chunk cache of compressed chunks larger than
HDF5's.  Where they do not fit, an evaluation reads chunks larger than a
block in slices (training's units slice them always), a new run's shuffle
buffer is capped (the start-up table and a note say so), and where even a
buffer of one sample does not fit, the run is refused, naming what takes the
memory.
"""

import dataclasses

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.memory import default_budget, human, parse_bytes
from .samples import footprint
from .shard import Shard
from .blocks import (
    WINDOWS,
    block_bytes_for,
    block_length,
    default_buffer,
    lane_share,
    order_units,
    stream_bytes,
)
from .stream import Stream


@dataclasses.dataclass(frozen=True)
class Reading:
    """How one rank reads its data: ``mode`` (memory or stream), and why, in words for the start-up table."""

    mode: str
    why: str
    buffer: int = 0  # samples in the shuffle buffer of the run's data order (training)
    direct: bool = False  # a stream reads around the page cache (--stream-io direct)
    sliced: bool = False  # a stream reads chunks larger than its blocks in slices
    notes: tuple = ()  # what the chief says of it (a buffer capped, chunks read in slices)
    nbytes: int = 0  # what the rank's data holds at most: its shards in memory, or its streams

    def open(self, info, split, worker, num_workers, input_shape, dtype, lanes=None):
        """The shard of ``split`` for this worker: a :class:`Shard` in memory, or a :class:`Stream`; ``lanes``
        (:class:`~mpidist.data.lanes.Lanes`): the training split's lanes it holds."""
        if self.mode == "memory":
            return Shard(
                info, split, worker, num_workers, input_shape, dtype, lanes=lanes, buffer=self.buffer
            )
        return Stream(
            info,
            split,
            worker,
            num_workers,
            input_shape,
            dtype,
            self.buffer,
            self.direct,
            self.sliced,
            lanes=lanes,
        )


def budget_of(config):
    """``(bytes, how they were set)`` of ``--memory-budget``."""
    if config.memory_budget == "auto":
        return default_budget(), "auto"
    return parse_bytes(config.memory_budget), "--memory-budget"


def plan(config, info, parts, input_shape, dtype, lanes=None, order=None):
    """The :class:`Reading` of a rank that reads ``parts`` (``[(split, rows)]``) of dataset ``info``;
    ``lanes``: the :class:`~mpidist.data.lanes.Lanes` of its ``train`` part; ``order``: the run's shuffle
    buffer (samples), whether it was capped, whether it is a resumed run's (:func:`order_buffer_for`; by
    default, a new run's sized by ``lanes``)."""
    if order is None:
        order = order_buffer_for(config, info, input_shape, dtype, lanes) if lanes else (0, False, False)
    if not parts:
        return Reading("memory", "", order[0])
    need = sum(footprint(rows, info, info.rows_of(split)[0], dtype) for split, rows in parts)
    budget, how = budget_of(config)
    buffer = order[0]
    if config.data_mode == "memory":
        return Reading("memory", f"memory {human(need)} (--data-mode memory)", buffer, nbytes=need)
    if config.data_mode == "auto" and need <= budget:
        return Reading("memory", f"memory {human(need)} <= budget {human(budget)}", buffer, nbytes=need)
    why = "--data-mode stream" if config.data_mode == "stream" else f"{human(need)} > budget {human(budget)}"
    return _streaming(config, info, dict(parts), input_shape, dtype, (budget, how), why, lanes, order)


def order_buffer_for(config, info, input_shape, dtype, widest, resumed=0):
    """``(samples, capped, resumed)``: the shuffle buffer of the run's data order, the same on every rank
    whatever its mode, and whether it was capped, whether it is a resumed run's.

    A resumed run keeps its checkpoint's (``resumed``).  A new run takes
    ``--shuffle-buffer`` (default :func:`~mpidist.data.blocks.default_buffer`),
    at most the training split, capped where the ``widest`` worker's training
    stream (:class:`~mpidist.data.lanes.Lanes`) would not fit the budget
    beside an evaluation's blocks: the largest that does.
    """
    if resumed:
        return max(1, min(int(resumed), info.sizes["train"])), False, True
    budget = budget_of(config)[0]
    buffer = max(1, min(config.shuffle_buffer or default_buffer(input_shape, dtype), info.sizes["train"]))
    # (an evaluation's blocks, as a stream of a whole split has them: every rank reserves alike)
    reserve = sum(
        stream_bytes(info, split, max(1, min(buffer, rows)), input_shape, dtype, True)
        for split, rows in info.sizes.items()
        if split != "train"
    )

    def fits(size):
        return stream_bytes(info, "train", size, input_shape, dtype, True, widest) + reserve <= budget

    if fits(buffer):
        return buffer, False, False
    return max(1, _largest(fits, buffer)), True, False


def _streaming(config, info, parts, input_shape, dtype, limits, why, lanes, order):
    """A stream's :class:`Reading` of ``parts`` (``{split: rows}``) with the order's buffer (``order``:
    samples, whether capped, whether a resumed run's): chunks larger than a block read in slices where whole
    ones do not fit the budget; refused where a buffer of one sample does not fit, or a buffer given with the
    budget does not."""
    splits, (budget, how), (buffer, capped, resumed) = list(parts), limits, order

    def held(size, sliced):  # (a rank streams every split it reads: the train split with its windows)
        return sum(
            stream_bytes(
                info, split, size, input_shape, dtype, sliced, lanes=lanes if split == "train" else None
            )
            for split in splits
        )

    asked = config.shuffle_buffer
    limit = (
        f"--memory-budget {config.memory_budget}"
        if how == "--memory-budget"
        else f"the memory budget {human(budget)} (--memory-budget auto)"
    )
    if held(1, True) > budget:
        raise UsageError(_too_small(info, splits, held(1, True), limit))
    sliced = held(buffer, False) > budget
    notes = []
    if capped and asked and how == "--memory-budget":
        sample = int(np.prod(input_shape)) * np.dtype(dtype).itemsize
        held_lanes = lanes.count if lanes else 1
        share = lane_share(asked, info.sizes["train"], lanes.total) if lanes else asked
        raise UsageError(
            f"--memory-budget {config.memory_budget}: streaming with --shuffle-buffer {asked:,} "
            f"holds about {human(held(asked, True))} ({WINDOWS} windows of at least {share:,} "
            f"{human(sample)} samples for each of its {held_lanes:,} lane(s), and its blocks); "
            f"give --shuffle-buffer {buffer:,} or less, or a larger budget"
        )
    if capped and asked:  # (the default is what fits: no news)
        notes.append(
            f"--shuffle-buffer {asked:,} capped to {buffer:,} samples: a stream holds {WINDOWS} windows "
            f"of its lanes' share of it, which must fit {limit} beside its blocks (the run keeps this "
            "buffer, and so its data order, when it is resumed)"
        )
    if resumed and held(buffer, True) > budget:
        notes.append(
            f"the data order resumed holds windows of {buffer:,} samples over the global batch: this "
            f"rank's stream holds about {human(held(buffer, True))}, more than {limit} (the order is "
            "kept, so each sample is still trained once an epoch)"
        )
    # (a chunk larger than a block is read in parts: by an evaluation where whole ones do not fit, by the
    # training order's units whatever the budget)
    if sliced or "train" in parts:
        notes.extend(_slicing(info, splits, block_bytes_for(buffer, input_shape, dtype)))
    if "train" in parts and lanes is not None:
        units = order_units(info.sizes["train"], buffer, input_shape, lanes.total)
        notes.extend(_decompressed_again(info, units, lanes.total))
    why = f"stream ({why}), buffer {buffer:,}" + (" (capped)" if capped and asked else "")
    return Reading(
        "stream", why, buffer, config.stream_io == "direct", sliced, tuple(notes), held(buffer, sliced)
    )


def _largest(fits, upto):
    """The largest ``n`` in ``[1, upto]`` with ``fits(n)`` (which holds below any ``n`` it holds for), or
    0."""
    lo, hi = 0, upto
    while lo < hi:
        middle = (lo + hi + 1) // 2
        lo, hi = (middle, hi) if fits(middle) else (lo, middle - 1)
    return lo


def _chunks(info, splits):
    """``(member, group, chunk rows)`` of each file and split read, largest chunk of ``x`` first."""
    found = [
        (m, info.rows_of(s)[0], m.chunk_rows.get(info.rows_of(s)[0], 1)) for s in splits for m in info.files
    ]
    return sorted(found, key=lambda f: -f[2] * f[0].row_bytes.get(f[1], 1))


def _slicing(info, splits, block):
    """Notes on the chunks a stream reads in slices: larger than its blocks of ``block`` bytes."""
    for member, group, chunk in _chunks(info, splits):
        length = block_length(member, group, block, sliced=True)
        if length < chunk:
            compressed = member.spans.get(group, (0, 0))[0] > 0
            return [
                f"{member.path}: {group}/x is stored in chunks of {chunk:,} rows "
                f"({human(chunk * member.row_bytes[group])}), more than a stream's blocks ({human(block)}) "
                f"and its budget allow: read in slices of {length:,} rows"
                + (
                    "; a compressed chunk is decompressed whole to read any slice: an evaluation reads its "
                    "slices of a chunk one after the other from a cache of one chunk"
                    if compressed
                    else ""
                )
            ]
    return []


def _decompressed_again(info, order, total):
    """A note on the compressed chunks of ``train/x`` larger than the training order's units (``order``:
    :func:`~mpidist.data.blocks.order_units` over ``total`` lanes), which a stream decompresses once for each
    unit that reads them, where a lane has several windows (a lane of one window is read front to back, its
    units one after the other from HDF5's cache of the chunk)."""
    (unit, window), group = order, info.rows_of("train")[0]
    if unit * window >= -(-info.sizes["train"] // total):
        return []
    for member, _, chunk in _chunks(info, ["train"]):
        if chunk > unit and member.spans.get(group, (0, 0))[0] > 0:
            return [
                f"{member.path}: {group}/x is stored in compressed chunks of {chunk:,} rows, more than the "
                f"training order's units of {unit:,} row{'s' if unit > 1 else ''} (a quarter of a lane's "
                "share of the shuffle buffer, whatever the file's chunks): a chunk is decompressed whole for "
                f"each unit that reads part of it, up to {-(-chunk // unit) + 1:,} times an epoch; rewrite "
                "the file in smaller chunks (or --compression none), or give a larger --shuffle-buffer, "
                "where that costs"
            ]
    return []


def _too_small(info, splits, least, limit):
    """Why a stream does not fit ``limit`` even with a buffer of one sample (it needs ``least`` bytes)."""
    member, group, chunk = _chunks(info, splits)[0]
    span = member.spans.get(group, (0, 0))[0]
    if 2 * member.cache_bytes(group) > least:  # the chunk cache takes most of it
        return (
            f"{member.path}: {group}/x is stored in compressed chunks of {chunk:,} rows ({human(span)} "
            f"decompressed): reading any of its samples decompresses a whole chunk, and a stream holds one, "
            f"needing at least {human(least)}, more than {limit}; rewrite the file in smaller chunks "
            "(`python -m mpidist ingest` writes chunks of about 1 MiB; or h5repack -l "
            f"{group}/x:CHUNK=...), or give a larger --memory-budget"
        )
    return (
        f"streaming needs at least {human(least)} (a shuffle buffer of one sample, and a block), more than "
        f"{limit}: give a larger --memory-budget"
    )
