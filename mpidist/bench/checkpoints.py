"""``bench --checkpoints DATA``: training with a checkpoint at every step against the same training without
any.

Each round trains ``steps`` of ``model`` twice, back to back, without
checkpoints and with ``--checkpoint-every 1`` (written behind training into a
scratch directory, removed at the end).  The figure is the median over rounds
of each one's samples/s, their ratio, and the median of each round's own
ratio (``vs_none_paired``).
"""

import io

from .timing import compared_in_scratch

COLUMNS = [
    ("checkpoints", "checkpoints", "{}"),
    ("ranks", "ranks", "{}"),
    ("steps", "steps", "{}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("vs_none", "vs none", "{:.3f}"),
]
STEPS = 600


def checkpoint_rows(world, dataset, model="mlp-wide", batch_per_rank=128, steps=0, rounds=7):
    """Rows of the comparison (complete on rank 0; every rank must call)."""
    from ..api import train

    def run(mode, index, scratch):
        every = 1 if mode == "every step" else 0
        return train(
            model=model,
            data=dataset,
            epochs=10**6,
            steps=steps or STEPS,
            eval_every=0,
            batch_size=batch_per_rank * world.Get_size(),
            metrics="",
            run_dir="",
            progress="none",
            checkpoint_dir=f"{scratch}/{index}" if every else "",
            checkpoint_every=every,
            comm=world,
            stream=io.StringIO(),
        )

    return compared_in_scratch(
        world, "mpidist-bench-ckpt-", ("none", "every step"), run, rounds, "checkpoints", "vs_none"
    )
