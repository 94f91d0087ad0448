"""``bench --tracing DATA``: training with ``--trace`` against the same training without it.

Each round trains ``steps`` of ``model`` twice, back to back, without and with
``--trace`` (its ``trace.json`` written to a scratch directory, removed at the
end).  The figure is the median over rounds of each one's samples/s, their
ratio, and the median of each round's own ratio (``vs_untraced_paired``).
"""

import io
import shutil
import tempfile

import numpy as np

from ..comm import bcast_text

COLUMNS = [("trace", "trace", "{}"), ("ranks", "ranks", "{}"), ("steps", "steps", "{}"),
           ("samples_per_s", "samples/s", "{:,.0f}"), ("vs_untraced", "vs untraced", "{:.3f}")]
STEPS = 600


def tracing_rows(world, dataset, model="mlp-wide", batch_per_rank=128, steps=0, rounds=7):
    """Rows of the comparison (complete on rank 0; every rank must call)."""
    from ..api import train

    scratch = bcast_text(world, tempfile.mkdtemp(prefix="mpidist-bench-trace-") if world.Get_rank() == 0 else "")
    measured = {"off": [], "on": []}
    try:
        for round_index in range(rounds):
            for mode in measured:
                world.Barrier()
                result = train(model=model, data=dataset, epochs=10 ** 6, steps=steps or STEPS, eval_every=0,
                               batch_size=batch_per_rank * world.Get_size(), metrics="", checkpoint_dir="",
                               run_dir=f"{scratch}/{mode}-{round_index}" if mode == "on" else "", trace=mode,
                               progress="none", comm=world, stream=io.StringIO())
                if world.Get_rank() == 0:
                    measured[mode].append((result.figures["samples_per_s"], result.figures["steps"]))
    finally:
        world.Barrier()
        if world.Get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if world.Get_rank() != 0:
        return None
    rows = [{"trace": mode, "ranks": world.Get_size(), "steps": runs[0][1],
             "samples_per_s": float(np.median([rate for rate, _ in runs])), "rounds": [rate for rate, _ in runs]}
            for mode, runs in measured.items()]
    rows[1]["vs_untraced"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    rows[1]["vs_untraced_paired"] = float(np.median([on / off for (off, _), (on, _) in zip(measured["off"],
                                                                                           measured["on"])]))
    return rows
