"""Backup workers (ps-sync --aggregate R): the first R gradients make each step."""

import numpy as np
import pytest
from mpi4py import MPI
from small_net import LastToStart, small_convnet, worker_slice

from mpidist import nn
from mpidist.parallel import LocalStrategy
from mpidist.parallel.ps.backup import BackupWorkersStrategy
from mpidist.runtime.cluster import build_cluster

STEPS = 10


def run(num_ps, aggregate, slow_worker=False, optimizer="sgd"):
    """Train :data:`STEPS` steps; ``slow_worker``: the last worker is slower than the whole run
    (:class:`~small_net.LastToStart`).  Returns the cluster, the strategy, every rank's ``(role, stats,
    iterations, whether it saw the others end before it started)`` and the batches."""
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
    *fast, slow = strategy.worker_ranks
    last = LastToStart(world, slow, fast)
    iterations, others_ended_first = 0, False
    if strategy.serves:
        strategy.serve()
    else:
        part = worker_slice(global_batch, workers, cluster.worker_index)
        weight = (part.stop - part.start) / global_batch
        if slow_worker and world.Get_rank() == slow:
            others_ended_first = last.wait()
        while not strategy.finished:
            version = strategy.version
            strategy.train_step(xs[version][part], ys[version][part], weight, version)
            iterations += 1
        if slow_worker and world.Get_rank() != slow:
            last.ended()
    strategy.finish()  # (collective: the slow worker's too)
    last.free()
    everyone = world.allgather((cluster.role, strategy.stats(), iterations, others_ended_first))
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
    """The slow worker starts once the others have taken every step: a step that waited for it would never
    come (it asserted the others' time against a slow worker's sleeps, which a busy machine can upset)."""
    world = MPI.COMM_WORLD
    num_ps = 2 if world.Get_size() >= 5 else 1
    workers = world.Get_size() - num_ps
    cluster, strategy, everyone, _ = run(num_ps, aggregate=workers - 1, slow_worker=True)
    servers = [stats for role, stats, _, _ in everyone if role == "ps"]
    worker_runs = [(iterations, first) for role, _, iterations, first in everyone if role == "worker"]
    # the others took every step without it, then its one gradient came, late for every step
    assert worker_runs == [(STEPS, False)] * (workers - 1) + [(1, True)]
    # every ps took the same decisions: same workers accepted, same late ones dropped
    assert all(s == servers[0] | {"shard": s["shard"]} for s in servers)
    assert servers[0]["updates"] == STEPS and servers[0]["accepted"] == STEPS * (workers - 1)
    assert servers[0]["dropped"] == 1
    # every worker, the slow one too, ends with the final parameters
    finals = world.allgather(strategy.host_params.copy())
    for other in finals[1:]:
        np.testing.assert_array_equal(other, finals[0])
    cluster.free()
