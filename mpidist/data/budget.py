"""Whether a rank reads its shards whole into memory or streams them: ``--data-mode`` and ``--memory-budget``.

A rank holds its shards in memory when what it reads (its training shard, and
the evaluation shards it reads) fits its budget at the peak of reading (as
stored, converted, and standardised where the dataset says so); otherwise it
streams every split it reads.  The workers of a run hold shards of the same
size, so with the same budget they choose alike; a worker's epoch order
depends on its mode, so pin ``--data-mode`` where a resumed run must repeat the
stopped one's order on machines with other memory.
"""

import dataclasses

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.memory import default_budget, human, parse_bytes
from .samples import footprint
from .shard import Shard
from .stream import WINDOWS, Stream, block_bytes_for, block_length, default_buffer


@dataclasses.dataclass(frozen=True)
class Reading:
    """How one rank reads its data: ``mode`` (memory or stream), and why, in words for the start-up table."""

    mode: str
    why: str
    buffer: int = 0     # samples in a stream's shuffle buffer
    direct: bool = False    # a stream reads around the page cache (--stream-io direct)

    def open(self, info, split, worker, num_workers, input_shape, dtype):
        """The shard of ``split`` for this worker: a :class:`Shard` in memory, or a :class:`Stream`."""
        if self.mode == "memory":
            return Shard(info, split, worker, num_workers, input_shape, dtype)
        return Stream(info, split, worker, num_workers, input_shape, dtype, self.buffer, self.direct)


def budget_of(config):
    """``(bytes, how they were set)`` of ``--memory-budget``."""
    if config.memory_budget == "auto":
        return default_budget(), "auto"
    return parse_bytes(config.memory_budget), "--memory-budget"


def plan(config, info, parts, input_shape, dtype):
    """The :class:`Reading` of a rank that reads ``parts`` (``[(split, rows)]``) of dataset ``info``."""
    if not parts:
        return Reading("memory", "")
    need = sum(footprint(rows, info, info.rows_of(split)[0], dtype) for split, rows in parts)
    budget, how = budget_of(config)
    if config.data_mode == "memory":
        return Reading("memory", f"memory {human(need)} (--data-mode memory)")
    if config.data_mode == "auto" and need <= budget:
        return Reading("memory", f"memory {human(need)} <= budget {human(budget)}")
    sample = int(np.prod(input_shape)) * np.dtype(dtype).itemsize
    buffer = config.shuffle_buffer or default_buffer(input_shape, dtype, budget)
    block = block_bytes_for(buffer, input_shape, dtype)
    largest = max(block_length(m, info.rows_of(split)[0], block) for m in info.files for split, _ in parts)
    held = WINDOWS * (buffer + largest) * (sample + 16)
    if held > budget and how == "--memory-budget" and config.shuffle_buffer:
        raise UsageError(f"--memory-budget {config.memory_budget}: streaming with --shuffle-buffer {buffer:,} "
                         f"holds about {human(held)} ({WINDOWS} windows of that many {human(sample)} samples, and "
                         "a block); give a smaller --shuffle-buffer or a larger budget")
    why = "--data-mode stream" if config.data_mode == "stream" else f"{human(need)} > budget {human(budget)}"
    return Reading("stream", f"stream ({why}), buffer {buffer:,}", buffer, config.stream_io == "direct")
