"""``bench --streaming DATA``: an epoch streamed from disk against the same data held in memory.

Each round trains one epoch (or ``steps``) of ``model`` twice, back to back:
with the workers' shards read whole into memory (``--data-mode memory``, their
loading not timed), then streamed (``--data-mode stream``) after the dataset's
pages were dropped from the page cache, so the stream reads from the disk.
Before each run the machine is left idle for ``settle`` seconds: on a
virtual machine that hands freed memory back to its host (virtio-balloon's
free page reporting), the gigabytes the previous run's shards or the dropped
cache just freed are handed back over the next ~10 s, and the host's work
shows as time stolen from the guest's busy cores (measured here: 0.5-1 s of
a 15 s epoch, all of it landing on the stream run that follows them).
The figure is the median over rounds of each mode's training samples/s, and
their ratio; the JSON also has the median of each round's ratio
(``vs_memory_paired``).
"""

import io
import os
import time

from mpi4py import MPI

from .. import data as datasets
from .timing import compared_rows, interleaved_runs

COLUMNS = [
    ("mode", "data", "{}"),
    ("ranks", "ranks", "{}"),
    ("steps", "steps", "{}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("vs_memory", "vs memory", "{:.3f}"),
    ("cold", "page cache", "{}"),
]


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


SETTLE_S = 15.0  # idle seconds before each run: long enough for a VM to hand 2 GB freed back to its host


def streaming_rows(world, dataset, model="mlp-wide", batch_per_rank=128, steps=0, rounds=5, settle=None):
    """Rows of the comparison (complete on rank 0; every rank must call); ``settle`` None:
    :data:`SETTLE_S`."""
    from ..api import train

    files = [m.path for m in datasets.inspect(datasets.resolve(dataset)).files]
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    cold = True

    def get_ready(mode):
        nonlocal cold
        if mode == "stream" and local.Get_rank() == 0:  # one rank per node drops the node's cache
            cold = drop_from_page_cache(files) and cold
        time.sleep(SETTLE_S if settle is None else settle)

    def run(mode, _):
        # (each run's own summary: not this table's)
        return train(
            model=model,
            data=dataset,
            data_mode=mode,
            epochs=1,
            steps=steps,
            eval_every=0,
            batch_size=batch_per_rank * world.Get_size(),
            metrics="",
            run_dir="",
            progress="none",
            comm=world,
            stream=io.StringIO(),
        )

    measured = interleaved_runs(world, ("memory", "stream"), run, rounds, prepare=get_ready)
    local.Free()
    if measured is None:
        return None
    rows = compared_rows(measured, "mode", world.Get_size(), "vs_memory")
    for row in rows:
        row["cold"] = ("dropped" if cold else "kept") if row["mode"] == "stream" else "-"
    return rows
