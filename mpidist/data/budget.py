"""Whether a rank reads its shards whole into memory or streams them: ``--data-mode`` and ``--memory-budget``.

A rank holds its shards in memory when what it reads (its training shard, and
the evaluation shards it reads) fits its budget at the peak of reading (as
stored, converted, and standardised where the dataset says so); otherwise it
streams every split it reads.  The workers of a run hold parts of about the
same size, so with the same budget they choose alike; the lanes depend on the
mode (strided rows in memory, contiguous ranges streamed), so pin
``--data-mode`` where the ranks' budgets differ, or where a resumed run must
repeat the stopped one's order on machines with other memory.

A stream's every buffer is sized from the budget and checked against it
before anything is allocated (:func:`~mpidist.data.blocks.stream_bytes`): its
lanes' windows, the batches it gathers ahead, the block being read, an
evaluation's blocks, and the chunk cache of compressed chunks larger than
HDF5's.  Where they do not fit, chunks larger than a block are read in
slices, then the shuffle buffer is capped (the start-up table and a note say
so), and where even a buffer of one sample does not fit, the run is refused,
naming what takes the memory.
"""

import dataclasses

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.memory import default_budget, human, parse_bytes
from .samples import footprint
from .shard import Shard
from .blocks import WINDOWS, block_bytes_for, block_length, default_buffer, lane_share, stream_bytes
from .stream import Stream


@dataclasses.dataclass(frozen=True)
class Reading:
    """How one rank reads its data: ``mode`` (memory or stream), and why, in words for the start-up table."""

    mode: str
    why: str
    buffer: int = 0     # samples in a stream's shuffle buffer
    direct: bool = False    # a stream reads around the page cache (--stream-io direct)
    sliced: bool = False    # a stream reads chunks larger than its blocks in slices
    notes: tuple = ()       # what the chief says of it (a buffer capped, chunks read in slices)

    def open(self, info, split, worker, num_workers, input_shape, dtype, lanes=None):
        """The shard of ``split`` for this worker: a :class:`Shard` in memory, or a :class:`Stream`; ``lanes``
        (:class:`~mpidist.data.lanes.Lanes`): the training split's lanes it holds."""
        if self.mode == "memory":
            return Shard(info, split, worker, num_workers, input_shape, dtype, lanes=lanes)
        return Stream(info, split, worker, num_workers, input_shape, dtype, self.buffer, self.direct, self.sliced,
                      lanes=lanes)


def budget_of(config):
    """``(bytes, how they were set)`` of ``--memory-budget``."""
    if config.memory_budget == "auto":
        return default_budget(), "auto"
    return parse_bytes(config.memory_budget), "--memory-budget"


def plan(config, info, parts, input_shape, dtype, lanes=None):
    """The :class:`Reading` of a rank that reads ``parts`` (``[(split, rows)]``) of dataset ``info``; ``lanes``:
    the :class:`~mpidist.data.lanes.Lanes` of its ``train`` part."""
    if not parts:
        return Reading("memory", "")
    need = sum(footprint(rows, info, info.rows_of(split)[0], dtype) for split, rows in parts)
    budget, how = budget_of(config)
    if config.data_mode == "memory":
        return Reading("memory", f"memory {human(need)} (--data-mode memory)")
    if config.data_mode == "auto" and need <= budget:
        return Reading("memory", f"memory {human(need)} <= budget {human(budget)}")
    why = "--data-mode stream" if config.data_mode == "stream" else f"{human(need)} > budget {human(budget)}"
    return _streaming(config, info, dict(parts), input_shape, dtype, budget, how, why, lanes)


def _streaming(config, info, parts, input_shape, dtype, budget, how, why, lanes):
    """A stream's :class:`Reading` of ``parts`` (``{split: rows}``): whole chunks where they fit ``budget``, else
    slices of them, then a smaller buffer; refused where a buffer of one sample does not fit."""
    splits = list(parts)
    def held(buffer, sliced):   # (a rank streams every split it reads: the train split with its windows)
        return sum(stream_bytes(info, split, buffer, input_shape, dtype, sliced,
                                lanes=lanes if split == "train" else None) for split in splits)

    asked = config.shuffle_buffer
    buffer = asked or default_buffer(input_shape, dtype, budget)
    if "train" in parts:    # the lanes' windows hold the split at most: a larger buffer gives the same order
        buffer = max(1, min(buffer, info.sizes["train"]))
    limit = f"--memory-budget {config.memory_budget}" if how == "--memory-budget" else \
        f"the memory budget {human(budget)} (--memory-budget auto)"
    sliced = held(buffer, False) > budget
    notes, capped = [], held(buffer, sliced) > budget
    if capped:
        fits = _largest(lambda size: held(size, True) <= budget, buffer)
        if fits == 0:
            raise UsageError(_too_small(info, splits, held(1, True), limit))
        if asked and how == "--memory-budget":
            sample = int(np.prod(input_shape)) * np.dtype(dtype).itemsize
            held_lanes = lanes.count if lanes else 1
            share = lane_share(buffer, info.sizes["train"], lanes.total) if lanes else buffer
            raise UsageError(f"--memory-budget {config.memory_budget}: streaming with --shuffle-buffer {asked:,} "
                             f"holds about {human(held(buffer, True))} ({WINDOWS} windows of at least {share:,} "
                             f"{human(sample)} samples for each of its {held_lanes:,} lane(s), and its blocks); "
                             f"give --shuffle-buffer {fits:,} or less, or a larger budget")
        if asked:   # (the default is what fits: no news)
            notes.append(f"--shuffle-buffer {asked:,} capped to {fits:,} samples: a stream holds {WINDOWS} windows "
                         f"of its lanes' share of it, which must fit {limit} beside its blocks (the data order "
                         "depends on it: pin --memory-budget where a resumed run must repeat it)")
        buffer = fits
    notes.extend(_slicing(info, splits, block_bytes_for(buffer, input_shape, dtype)) if sliced else [])
    why = f"stream ({why}), buffer {buffer:,}" + (" (capped)" if capped and asked else "")
    return Reading("stream", why, buffer, config.stream_io == "direct", sliced, tuple(notes))


def _largest(fits, upto):
    """The largest ``n`` in ``[1, upto]`` with ``fits(n)`` (which holds below any ``n`` it holds for), or 0."""
    lo, hi = 0, upto
    while lo < hi:
        middle = (lo + hi + 1) // 2
        lo, hi = (middle, hi) if fits(middle) else (lo, middle - 1)
    return lo


def _chunks(info, splits):
    """``(member, group, chunk rows)`` of each file and split read, largest chunk of ``x`` first."""
    found = [(m, info.rows_of(s)[0], m.chunk_rows.get(info.rows_of(s)[0], 1)) for s in splits for m in info.files]
    return sorted(found, key=lambda f: -f[2] * f[0].row_bytes.get(f[1], 1))


def _slicing(info, splits, block):
    """Notes on the chunks a stream reads in slices: larger than its blocks of ``block`` bytes."""
    for member, group, chunk in _chunks(info, splits):
        length = block_length(member, group, block, sliced=True)
        if length < chunk:
            compressed = member.spans.get(group, (0, 0))[0] > 0
            return [f"{member.path}: {group}/x is stored in chunks of {chunk:,} rows "
                    f"({human(chunk * member.row_bytes[group])}), more than a stream's blocks ({human(block)}) "
                    f"and its budget allow: read in slices of {length:,} rows"
                    + ("; a compressed chunk is decompressed whole to read any slice: a lane reads its slices "
                       "of a chunk one after the other (a window draws from fewer places) from a cache of one "
                       "chunk, but the lanes' windows take turns, so a chunk is decompressed again for each "
                       "window that reads it (rewrite the file in smaller chunks where that costs)"
                       if compressed else "")]
    return []


def _too_small(info, splits, least, limit):
    """Why a stream does not fit ``limit`` even with a buffer of one sample (it needs ``least`` bytes)."""
    member, group, chunk = _chunks(info, splits)[0]
    span = member.spans.get(group, (0, 0))[0]
    if 2 * member.cache_bytes(group) > least:     # the chunk cache takes most of it
        return (f"{member.path}: {group}/x is stored in compressed chunks of {chunk:,} rows ({human(span)} "
                f"decompressed): reading any of its samples decompresses a whole chunk, and a stream holds one, "
                f"needing at least {human(least)}, more than {limit}; rewrite the file in smaller chunks "
                "(`python -m mpidist ingest` writes chunks of about 1 MiB; or h5repack -l "
                f"{group}/x:CHUNK=...), or give a larger --memory-budget")
    return (f"streaming needs at least {human(least)} (a shuffle buffer of one sample, and a block), more than "
            f"{limit}: give a larger --memory-budget")
