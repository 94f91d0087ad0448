"""``bench --tracing DATA``: training with ``--trace`` against the same training without it.

Each round trains ``steps`` of ``model`` twice, back to back, without and with
``--trace`` (its ``trace.json`` written to a scratch directory, removed at the
end).  The figure is the median over rounds of each one's samples/s, their
ratio, and the median of each round's own ratio (``vs_untraced_paired``).
"""

import io

from .timing import compared_in_scratch

COLUMNS = [
    ("trace", "trace", "{}"),
    ("ranks", "ranks", "{}"),
    ("steps", "steps", "{}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("vs_untraced", "vs untraced", "{:.3f}"),
]
STEPS = 600


def tracing_rows(world, dataset, model="mlp-wide", batch_per_rank=128, steps=0, rounds=7):
    """Rows of the comparison (complete on rank 0; every rank must call)."""
    from ..api import train

    def run(mode, index, scratch):
        return train(
            model=model,
            data=dataset,
            epochs=10**6,
            steps=steps or STEPS,
            eval_every=0,
            batch_size=batch_per_rank * world.Get_size(),
            metrics="",
            checkpoint_dir="",
            run_dir=f"{scratch}/{mode}-{index}" if mode == "on" else "",
            trace=mode,
            progress="none",
            comm=world,
            stream=io.StringIO(),
        )

    return compared_in_scratch(
        world, "mpidist-bench-trace-", ("off", "on"), run, rounds, "trace", "vs_untraced"
    )
