"""``bench --checkpoints DATA``: training with a checkpoint at every step against the same training without any.

Each round trains ``steps`` of ``model`` twice, back to back, without
checkpoints and with ``--checkpoint-every 1`` (written behind training into a
scratch directory, removed at the end).  The figure is the median over rounds
of each one's samples/s, their ratio, and the median of each round's own
ratio (``vs_none_paired``).
"""

import io
import shutil
import tempfile

from ..runtime.comm import bcast_text
from .timing import compared_rows, interleaved_runs

COLUMNS = [("checkpoints", "checkpoints", "{}"), ("ranks", "ranks", "{}"), ("steps", "steps", "{}"),
           ("samples_per_s", "samples/s", "{:,.0f}"), ("vs_none", "vs none", "{:.3f}")]
STEPS = 600


def checkpoint_rows(world, dataset, model="mlp-wide", batch_per_rank=128, steps=0, rounds=7):
    """Rows of the comparison (complete on rank 0; every rank must call)."""
    from ..api import train

    scratch = bcast_text(world, tempfile.mkdtemp(prefix="mpidist-bench-ckpt-") if world.Get_rank() == 0 else "")

    def run(mode, index):
        every = 1 if mode == "every step" else 0
        return train(model=model, data=dataset, epochs=10 ** 6, steps=steps or STEPS, eval_every=0,
                     batch_size=batch_per_rank * world.Get_size(), metrics="", run_dir="", progress="none",
                     checkpoint_dir=f"{scratch}/{index}" if every else "", checkpoint_every=every,
                     comm=world, stream=io.StringIO())

    try:
        measured = interleaved_runs(world, ("none", "every step"), run, rounds)
    finally:
        world.Barrier()
        if world.Get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    return None if measured is None else compared_rows(measured, "checkpoints", world.Get_size(), "vs_none")
