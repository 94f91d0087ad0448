"""ps-async: one-sided pushes lose nothing; the staleness bound holds."""

import time

import numpy as np
import pytest
from mpi4py import MPI
from small_net import LastToStart, small_convnet

from mpidist import nn
from mpidist.parallel import PsAsyncStrategy
from mpidist.parallel.ps.async_exchange import AsyncExchange
from mpidist.parallel.shards import shard_bounds
from mpidist.runtime.cluster import PS, build_cluster
from mpidist.runtime.rma import Window

from conftest import cluster_with_ps


@pytest.mark.mpi(min_size=2)
def test_window_adds_from_every_rank_are_exact_and_swap_takes_everything():
    world = MPI.COMM_WORLD
    with Window(world, 7 if world.Get_rank() == 0 else 0, np.float64) as window:
        for _ in range(50):
            window.add(np.full(7, world.Get_rank() + 1.0), 0)
        window.flush()
        world.Barrier()
        if world.Get_rank() == 0:
            taken = np.empty(7)
            window.swap(np.zeros(7), taken, 0)
            window.flush()
            size = world.Get_size()
            np.testing.assert_array_equal(taken, 50 * size * (size + 1) / 2)
            window.read(taken, 0)
            window.flush()
            np.testing.assert_array_equal(taken, 0)
        world.Barrier()
    assert window.win is None
    window.free()  # freeing twice is harmless


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_ps", [1, 2])
def test_concurrent_pushes_from_every_worker_lose_nothing(num_ps):
    """Workers push while the ps ranks take: the applied total is the exact sum."""
    cluster = cluster_with_ps(num_ps)
    world = cluster.world
    ps_ranks = [r for r, role in enumerate(cluster.roles) if role == PS]
    n, pushes = 1001, 40
    bounds = shard_bounds(n, num_ps)
    exchange = AsyncExchange(world, ps_ranks, bounds, cluster.num_workers, np.float64)
    if cluster.role == PS:
        lo, hi = bounds[ps_ranks.index(cluster.rank)]
        total, arrived, counted, steps = np.zeros(hi - lo), np.zeros(hi - lo), 0, 0
        while True:
            count, step_sum = exchange.take(arrived, cluster.rank)
            counted, steps = counted + count, steps + step_sum
            total += arrived
            if count == 0 and not arrived.any() and exchange.workers_done() == cluster.num_workers:
                count, step_sum = exchange.take(arrived, cluster.rank)
                counted, steps = counted + count, steps + step_sum
                total += arrived
                if not arrived.any():
                    break
        workers = cluster.num_workers
        # worker w pushes (w + 1) * (element index + 1), 40 times
        expected = pushes * workers * (workers + 1) / 2 * np.arange(lo + 1, hi + 1)
        np.testing.assert_array_equal(total, expected)
        assert counted == pushes * workers
        assert steps == workers * sum(range(pushes))  # each arrival's step, for its learning rate
    else:
        gradient = (cluster.worker_index + 1.0) * np.arange(1, n + 1)
        for step in range(pushes):
            exchange.push(gradient, step)
        exchange.retire(cluster.worker_index)
    world.Barrier()
    exchange.free()
    cluster.free()


def train_async(staleness, slow_worker_delay, steps=12, slow_starts_last=False):
    """``steps`` steps on every worker, worker 1 sleeping ``slow_worker_delay`` before each, or starting
    once the others have ended (``slow_starts_last``: :class:`~small_net.LastToStart`)."""
    world = MPI.COMM_WORLD
    cluster = build_cluster(world, num_ps=1)
    make = lambda size: nn.make_optimizer("sgd", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    strategy = PsAsyncStrategy(
        small_convnet(np.float64), nn.loss_for(4, np), make, cluster, seed=3, staleness=staleness
    )
    strategy.initialize()
    workers = [rank for rank, role in enumerate(cluster.roles) if role != PS]
    last = LastToStart(world, workers[1], workers[:1] + workers[2:]) if slow_starts_last else None
    if strategy.serves:
        strategy.serve()
    else:
        rng = np.random.default_rng(cluster.worker_index)
        if slow_starts_last and cluster.worker_index == 1:
            assert last.wait(), "the others did not end without the slow worker"
        for step in range(steps):
            if cluster.worker_index == 1:
                time.sleep(slow_worker_delay)  # a deliberately slow worker
            x, y = rng.random((4, 1, 6, 6)), rng.integers(0, 4, 4)
            assert np.isfinite(strategy.train_step(x, y, 0.5, step))
        if slow_starts_last and cluster.worker_index != 1:
            last.ended()
    strategy.finish()
    if last:
        last.free()
    stats = strategy.stats()
    everyone = world.allgather((cluster.role, stats))
    params = world.allgather(strategy.host_params.copy() if strategy.is_worker else None)
    strategy.free()
    cluster.free()
    return everyone, [p for p in params if p is not None]


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("bound", [0, 2])
def test_the_recorded_staleness_never_exceeds_the_bound(bound):
    everyone, _ = train_async(staleness=bound, slow_worker_delay=0.02)
    workers = [stats for role, stats in everyone if role == "worker"]
    assert all(stats["steps"] == 12 for stats in workers)
    assert max(stats["staleness_max"] for stats in workers) <= bound
    assert max(stats["wait_s"] for stats in workers) > 0.05  # fast workers did wait for the slow one


@pytest.mark.mpi(min_size=3)
def test_without_a_bound_fast_workers_run_ahead_of_a_slow_one():
    """The slow worker starts once the others have ended: they ran every step ahead of it (a sleep before
    each of its steps left how far ahead to the machine's speed)."""
    everyone, _ = train_async(staleness=None, slow_worker_delay=0.0, slow_starts_last=True)
    assert max(stats["staleness_max"] for role, stats in everyone if role == "worker") == 11


@pytest.mark.mpi(min_size=2)
def test_every_worker_ends_with_the_same_final_parameters_and_the_ps_counts_every_gradient():
    everyone, params = train_async(staleness=None, slow_worker_delay=0.0)
    for other in params[1:]:
        np.testing.assert_array_equal(other, params[0])
    workers = sum(1 for role, _ in everyone if role == "worker")
    server = next(stats for role, stats in everyone if role == "ps")
    assert server["gradients"] == 12 * workers and 1 <= server["updates"] <= 12 * workers


@pytest.mark.mpi(min_size=2)
def test_free_frees_the_failure_watch_and_a_second_free_does_nothing():
    cluster = build_cluster(MPI.COMM_WORLD, num_ps=1)
    make = lambda size: nn.make_optimizer("sgd", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    strategy = PsAsyncStrategy(
        small_convnet(np.float64), nn.loss_for(4, np), make, cluster, seed=3, elastic=True
    )
    strategy.initialize()
    watch = strategy.lost.watch
    assert watch.poll() == []  # nobody died
    strategy.free()
    assert watch.comm is None
    watch.free()
    cluster.free()


class _PoisonOnWorker1(nn.Layer):
    """NaN activations on rank 1's training passes alone (a worker whose data or numbers went bad)."""

    def forward(self, x, training=False):
        return x * np.nan if training and MPI.COMM_WORLD.Get_rank() == 1 else x

    def backward(self, dy):
        return dy


@pytest.mark.mpi(min_size=3)
def test_a_workers_nan_gradients_stay_its_own_and_the_others_train_on():
    """One ps-async worker's NaN gradients, summed into the ps's inbox with the others', took theirs with
    them: the ps skipped 23 of 88 gradients and the run ended "done" at 0.21 test accuracy.  The worker keeps
    them (counted as skipped) and the ps applies every other gradient."""
    import io

    import mpidist

    world = MPI.COMM_WORLD

    def build(shape, outputs):
        return [nn.Flatten(), nn.Dense(32), nn.ReLU(), _PoisonOnWorker1(), nn.Dense(outputs)]

    result = mpidist.train(
        build, "digits", strategy="ps-async", ps=1, epochs=1, nan_patience=10**6, optimizer="sgd", lr=0.05,
        progress="none", metrics="", run_dir="", stream=io.StringIO(), comm=world,
    )  # fmt: skip
    assert result.status == "done"
    if result.is_chief:
        roles = {role["rank"]: role for role in result.figures["roles"]}
        workers = [role for role in roles.values() if role["role"] == "worker"]
        (ps,) = [role for role in roles.values() if role["role"] == "ps"]
        assert roles[1]["skipped"] == roles[1]["steps"] > 0
        assert all(role["skipped"] == 0 for rank, role in roles.items() if rank != 1)
        assert ps["gradients"] == sum(role["steps"] for role in workers if role["rank"] != 1)
