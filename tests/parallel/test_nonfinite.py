"""NaN and Inf: an update whose loss or gradients are not finite is skipped, on every rank alike."""

import numpy as np
import pytest
from mpi4py import MPI
from small_net import small_convnet, worker_slice

from mpidist import nn
from mpidist.parallel import AllreduceStrategy, PipelineStrategy, PsSyncStrategy
from mpidist.parallel.base import SkipCounter, finite
from mpidist.runtime.cluster import PS, build_cluster
from mpidist.runtime.errors import RunError

from conftest import cluster_with_ps


def test_finite_sees_one_bad_element_anywhere():
    values = np.arange(1000, dtype=np.float32)
    assert finite(values)
    for bad in (np.nan, np.inf, -np.inf):
        spoiled = values.copy()
        spoiled[777] = bad
        assert not finite(spoiled)


def test_patience_counts_skips_in_a_row_and_resets_on_a_good_update():
    counter = SkipCounter(patience=2)
    assert [counter.update_allowed(ok, "x were") for ok in (False, False, True, False, False)] == [
        False,
        False,
        True,
        False,
        False,
    ]
    assert counter.total == 4
    with pytest.raises(RunError, match=r"x were NaN or Inf 3 time\(s\) in a row \(--nan-patience 2\)"):
        counter.update_allowed(False, "x were")
    with pytest.raises(RunError):
        SkipCounter(patience=0).update_allowed(False, "x were")  # 0: the first one ends the run
    silent = SkipCounter(patience=0, speaks=False)  # another ps speaks for this one
    assert [silent.update_allowed(False, "x were") for _ in range(3)] == [False] * 3


def batches(global_batch, steps, poisoned_step):
    """The same data on every rank; the last sample of ``poisoned_step`` is NaN (the last worker's)."""
    rng = np.random.default_rng(0)
    xs = rng.random((steps, global_batch, 1, 6, 6))
    xs[poisoned_step, -1, 0, 0, 0] = np.nan
    return xs, rng.integers(0, 4, (steps, global_batch))


def make_optimizer(size):
    return nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64)


def check_skip(strategy, params_of, step_of):
    """Steps 0, 1 (one worker's batch holds a NaN) and 2: the update of step 1 is skipped on every rank."""
    seen, skipped = [], []
    for step in range(3):
        step_of(step)
        seen.append(params_of().copy())
        skipped.append(strategy.skipped)
    assert skipped == [False, True, False]
    assert np.isfinite(seen[1]).all()
    np.testing.assert_array_equal(seen[1], seen[0])  # nothing of the NaN step reached the parameters
    assert not np.array_equal(seen[2], seen[1])  # and training went on
    assert MPI.COMM_WORLD.allgather(skipped) == [skipped] * MPI.COMM_WORLD.Get_size()


@pytest.mark.mpi(min_size=2)
def test_allreduce_skips_a_step_with_a_nan_on_one_worker_everywhere():
    cluster = build_cluster(MPI.COMM_WORLD)
    global_batch = 3 * cluster.num_workers
    xs, ys = batches(global_batch, 3, poisoned_step=1)
    strategy = AllreduceStrategy(
        small_convnet(np.float64), nn.loss_for(4, np), make_optimizer, cluster, seed=3
    )
    strategy.initialize()
    part = worker_slice(global_batch, cluster.num_workers, cluster.worker_index)
    check_skip(
        strategy,
        lambda: strategy.model.params,
        lambda step: strategy.train_step(xs[step][part], ys[step][part], 1 / cluster.num_workers, step),
    )
    assert strategy.optimizer.steps == 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_ps", [1, 2])
def test_ps_sync_servers_skip_together_and_every_rank_learns_it(num_ps):
    cluster = cluster_with_ps(num_ps)
    workers = cluster.num_workers
    global_batch = 3 * workers
    xs, ys = batches(global_batch, 3, poisoned_step=1)
    strategy = PsSyncStrategy(small_convnet(np.float64), nn.loss_for(4, np), make_optimizer, cluster, seed=3)
    strategy.initialize()
    worker = cluster.role != PS
    part = worker_slice(global_batch, workers, cluster.worker_index) if worker else None

    def step_of(step):
        args = (xs[step][part], ys[step][part], 1 / workers) if worker else (None, None, 0.0)
        strategy.train_step(*args, step)

    check_skip(strategy, lambda: strategy.model.params, step_of)
    if not worker:
        assert strategy.figures["updates"] == 2


@pytest.mark.mpi(min_size=2)
def test_pipeline_stages_skip_together_though_only_the_last_sees_the_loss():
    world = MPI.COMM_WORLD
    if world.Get_size() % 2:
        pytest.skip(f"2 stages do not divide {world.Get_size()} ranks")
    cluster = build_cluster(world)
    replicas = world.Get_size() // 2
    global_batch = 4 * replicas
    xs, ys = batches(global_batch, 3, poisoned_step=1)
    strategy = PipelineStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make_optimizer,
        cluster,
        seed=3,
        stages=2,
        micro_batches=2,
        schedule_name="1f1b",
        global_batch=global_batch,
    )
    strategy.initialize()
    part = worker_slice(global_batch, replicas, strategy.replica)
    check_skip(
        strategy,
        lambda: strategy.model.params,
        lambda step: strategy.train_step(xs[step][part], ys[step][part], 1 / replicas, step),
    )
