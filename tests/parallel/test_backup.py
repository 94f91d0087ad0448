"""Backup workers (ps-sync --aggregate R): the first R gradients make each step."""

import time

import numpy as np
import pytest
from mpi4py import MPI
from small_net import small_convnet, worker_slice

from mpidist import nn
from mpidist.parallel import LocalStrategy
from mpidist.parallel.backup import BackupWorkersStrategy
from mpidist.runtime.cluster import build_cluster

STEPS = 10


def run(num_ps, aggregate, slow_delay=0.0, optimizer="sgd"):
    world = MPI.COMM_WORLD
    cluster = build_cluster(world, num_ps=num_ps)
    workers = cluster.num_workers
    global_batch = 2 * workers + 1
    rng = np.random.default_rng(0)
    xs = rng.random((STEPS, global_batch, 1, 6, 6))
    ys = rng.integers(0, 4, (STEPS, global_batch))
    make = lambda size: nn.make_optimizer(optimizer, size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    strategy = BackupWorkersStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make,
        cluster,
        seed=3,
        aggregate=aggregate,
        total_steps=STEPS,
    )
    strategy.initialize()
    start = time.perf_counter()
    iterations = 0
    if strategy.serves:
        strategy.serve()
    else:
        part = worker_slice(global_batch, workers, cluster.worker_index)
        weight = (part.stop - part.start) / global_batch
        while not strategy.finished:
            if cluster.worker_index == workers - 1:
                time.sleep(slow_delay)
            version = strategy.version
            strategy.train_step(xs[version][part], ys[version][part], weight, version)
            iterations += 1
    elapsed = time.perf_counter() - start
    strategy.finish()
    everyone = world.allgather((cluster.role, strategy.stats(), iterations, elapsed))
    return cluster, strategy, everyone, (xs, ys, make)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_aggregating_every_worker_equals_local_training(optimizer):
    world = MPI.COMM_WORLD
    num_ps = 2 if world.Get_size() >= 4 else 1
    cluster, strategy, everyone, (xs, ys, make) = run(
        num_ps, aggregate=world.Get_size() - num_ps, optimizer=optimizer
    )
    reference = LocalStrategy(small_convnet(np.float64), nn.loss_for(4, np), make, seed=3)
    reference.initialize()
    for step in range(STEPS):
        reference.train_step(xs[step], ys[step], 1.0, step)
    np.testing.assert_allclose(strategy.host_params, reference.model.params, rtol=1e-9, atol=1e-12)
    servers = [stats for role, stats, _, _ in everyone if role == "ps"]
    assert all(s["updates"] == STEPS and s["dropped"] == 0 for s in servers)
    cluster.free()


@pytest.mark.mpi(min_size=3)
def test_a_slow_worker_does_not_slow_the_steps_and_its_late_gradients_are_dropped():
    world = MPI.COMM_WORLD
    num_ps = 2 if world.Get_size() >= 5 else 1
    workers = world.Get_size() - num_ps
    delay = 0.1
    cluster, strategy, everyone, _ = run(num_ps, aggregate=workers - 1, slow_delay=delay)
    servers = [stats for role, stats, _, _ in everyone if role == "ps"]
    worker_runs = [(iterations, elapsed) for role, _, iterations, elapsed in everyone if role == "worker"]
    # the slow worker alone would need STEPS * delay = 1 s; the others finish the steps without it
    fast_elapsed = min(elapsed for _, elapsed in worker_runs)
    assert fast_elapsed < 0.5 * STEPS * delay, worker_runs
    assert max(iterations for iterations, _ in worker_runs) == STEPS
    # every ps took the same decisions: same workers accepted, same late ones dropped
    assert all(s == servers[0] | {"shard": s["shard"]} for s in servers)
    assert servers[0]["updates"] == STEPS and servers[0]["accepted"] == STEPS * (workers - 1)
    assert servers[0]["dropped"] >= 1
    # every worker, the slow one too, ends with the final parameters
    finals = world.allgather(strategy.host_params.copy())
    for other in finals[1:]:
        np.testing.assert_array_equal(other, finals[0])
    cluster.free()
