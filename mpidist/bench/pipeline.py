"""The pipeline's measured bubble against the schedule's theory, on stages of equal work."""

import numpy as np

from .. import nn
from ..parallel import PipelineStrategy
from ..parallel.pipeline.schedule import bubble
from ..parallel.pipeline.schedule_runner import split_sizes
from ..runtime.cluster import build_cluster
from .rows import sgd
from .timing import synced_timed


def _uniform_pipeline(stages, xp=np):
    """Eight equal Dense(512)+ReLU pairs and a small head, split evenly: stages do equal work."""
    layers = []
    for _ in range(8):
        layers += [nn.Dense(512), nn.ReLU()]
    layers.append(nn.Dense(10, init="glorot"))
    model = nn.Sequential(layers, (512,), xp=xp, dtype=np.float32)
    pairs = split_sizes(8, stages)
    balance = [2 * n for n in pairs]
    balance[-1] += 1
    return model, balance


def pipeline_rows(world, seconds, micro_batch=32, counts=(2, 4, 8, 16)):
    """Measured bubble (idle over pipeline time, mean over stages) against (P-1)/(M+P-1).

    All ranks form one pipeline (``P`` = ranks, no replicas).
    """
    stages, rows = world.Get_size(), []
    cluster = build_cluster(world)
    for name in ("gpipe", "1f1b"):
        for micro_batches in counts:
            model, balance = _uniform_pipeline(stages)
            batch = micro_batch * micro_batches
            strategy = PipelineStrategy(
                model,
                nn.loss_for(10, np),
                sgd,
                cluster,
                seed=0,
                stages=stages,
                micro_batches=micro_batches,
                schedule_name=name,
                balance=balance,
                global_batch=batch,
            )
            strategy.initialize()
            rng = np.random.default_rng(0)
            x, y = rng.random((batch, 512), dtype=np.float32), rng.integers(0, 10, batch)
            counter = iter(range(1 << 30))
            strategy.train_step(x, y, 1.0, next(counter))  # warm-up, not counted
            strategy.figures.update(steps=0, pipeline_s=0.0, idle_s=0.0)
            per_step = synced_timed(world, lambda: strategy.train_step(x, y, 1.0, next(counter)), seconds / 4)
            stats = world.gather(strategy.stats(), root=0)
            strategy.free()
            if world.Get_rank() == 0:
                rows.append(
                    {
                        "schedule": name,
                        "stages": stages,
                        "micro_batches": micro_batches,
                        "bubble_measured": float(np.mean([s["bubble"] for s in stats])),
                        "bubble_theory": bubble(stages, micro_batches),
                        "peak_activations": max(s["peak_activations"] for s in stats),
                        "samples_per_s": batch / per_step,
                    }
                )
    cluster.free()
    return rows


PIPELINE_COLUMNS = [
    ("schedule", "schedule", "{}"),
    ("stages", "P", "{}"),
    ("micro_batches", "M", "{}"),
    ("bubble_measured", "bubble measured", "{:.1%}"),
    ("bubble_theory", "(P-1)/(M+P-1)", "{:.1%}"),
    ("peak_activations", "peak activations", "{}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
]
