"""``bench --streaming DATA``: an epoch streamed from disk against the same data held in memory.

Each round trains one epoch (or ``steps``) of ``model`` twice, back to back:
with the workers' shards read whole into memory (``--data-mode memory``, their
loading not timed), then streamed (``--data-mode stream``) after the dataset's
pages were dropped from the page cache, so the stream reads from the disk.
The figure is the median over rounds of each mode's training samples/s, and
their ratio; the JSON also has the median of each round's ratio
(``vs_memory_paired``).
"""

import io
import os

import numpy as np
from mpi4py import MPI

from .. import data as datasets

COLUMNS = [("mode", "data", "{}"), ("ranks", "ranks", "{}"), ("steps", "steps", "{}"),
           ("samples_per_s", "samples/s", "{:,.0f}"), ("vs_memory", "vs memory", "{:.3f}"),
           ("cold", "page cache", "{}")]


def drop_from_page_cache(paths):
    """Ask the kernel to forget the cached pages of ``paths`` (``POSIX_FADV_DONTNEED``); True where it could.

    Clean pages are dropped without privileges; a file system that ignores the
    advice (some network ones) keeps them, so the stream may read from memory.
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def streaming_rows(world, dataset, model="mlp-wide", batch_per_rank=128, steps=0, rounds=5):
    """Rows of the comparison (complete on rank 0; every rank must call)."""
    from ..api import train

    files = [m.path for m in datasets.inspect(datasets.resolve(dataset)).files]
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    measured = {"memory": [], "stream": []}
    cold = True
    for _ in range(rounds):
        for mode in ("memory", "stream"):
            if mode == "stream" and local.Get_rank() == 0:   # one rank per node drops the node's cache
                cold = drop_from_page_cache(files) and cold
            world.Barrier()
            result = train(model=model, data=dataset, data_mode=mode, epochs=1, steps=steps, eval_every=0,
                           batch_size=batch_per_rank * world.Get_size(), metrics="", run_dir="", progress="none", comm=world,
                           stream=io.StringIO())   # (each run's own summary: not this table's)
            if world.Get_rank() == 0:
                measured[mode].append((result.figures["samples_per_s"], result.figures["steps"]))
    local.Free()
    if world.Get_rank() != 0:
        return None
    rows = [{"mode": mode, "ranks": world.Get_size(), "steps": runs[0][1],
             "samples_per_s": float(np.median([rate for rate, _ in runs])), "rounds": [rate for rate, _ in runs],
             "cold": ("dropped" if cold else "kept") if mode == "stream" else "-"} for mode, runs in measured.items()]
    rows[1]["vs_memory"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    # each round's stream against the memory run just before it: drifts of a shared machine cancel
    rows[1]["vs_memory_paired"] = float(np.median([s / m for (m, _), (s, _) in zip(measured["memory"],
                                                                                     measured["stream"])]))
    return rows

