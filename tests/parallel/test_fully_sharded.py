"""``allreduce --shard parameters``: each worker holds a shard of every unit, gathered as it runs.

Against the local reference on the same global batch (tests/parallel/test_recipe.py's: a warm-up into a
cosine, a clip that bites on some steps, weight decay, accumulation in slices), equal to 1e-9 in float64
at every step, each worker's shards compared with their places in the reference's parameters.
"""

import numpy as np
import pytest
from mpi4py import MPI
from small_net import small_convnet, worker_slice
from test_recipe import STEPS, batches, clip_for, make, recipe, reference_run

from mpidist import nn
from mpidist.parallel import AllreduceStrategy
from mpidist.parallel.fully_sharded import FullyShardedStrategy
from mpidist.runtime.cluster import build_cluster

#: the small convnet's units at 40 parameters: the convolution (30), the first Dense (224), the last (36)
UNIT_BYTES = 40 * 8


def sharded(cluster, optimizer, accumulate=1, clip=0.0, keep=False):
    return FullyShardedStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make(optimizer),
        cluster,
        seed=3,
        bucket_bytes=UNIT_BYTES,
        recipe=recipe(accumulate, clip),
        keep=keep,
    )


def test_the_allreduce_settings_choose_the_fully_sharded_class():
    settings = type("Settings", (), {"shard": "parameters"})
    assert AllreduceStrategy.variant(settings, 4) is FullyShardedStrategy
    settings.shard = "optimizer"
    assert AllreduceStrategy.variant(settings, 4) is AllreduceStrategy


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_shards_train_as_local_on_the_global_batch(optimizer, accumulate, keep):
    cluster = build_cluster(MPI.COMM_WORLD)
    workers = cluster.num_workers
    global_batch = 3 * workers + 2
    expected, clipped = reference_run(global_batch, optimizer)
    xs, ys = batches(global_batch)
    strategy = sharded(cluster, optimizer, accumulate, clip_for(global_batch, optimizer), keep)
    assert [unit.size for unit in strategy.shards.units] == [30, 224, 36]
    strategy.initialize()
    where = strategy.placement.positions()
    part = worker_slice(global_batch, workers, cluster.worker_index)
    for step in range(STEPS):
        strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
        np.testing.assert_allclose(strategy.params, expected[step][where], rtol=1e-9, atol=1e-12)
        assert strategy.clipped == clipped[step]
    # every worker holds a shard of its own, and together they are the model, each element once
    held = np.concatenate(cluster.workers.allgather(where))
    assert np.array_equal(np.sort(held), np.arange(strategy.model.num_params))
    # the units every worker gathers are bit-identical
    strategy.gathers.idle_pass()
    slots = b"".join(slot.tobytes() for slot in strategy.gathers.param_slots)
    assert len(set(cluster.workers.allgather(slots))) == 1
    strategy.free()
    cluster.free()
