"""One copy of the model per node (``--exchange node``): the ring between nodes, and training equal to local.

The multi-rank tests here pass on one node (the README's ``mpiexec -n N``
runs: L ranks, one node) and on emulated clusters: the serial test at the end
runs this file's multi-rank tests again on 2 and 3 emulated nodes of 2 ranks
(``conftest.node_hosts``), where the ring crosses MPI's network module.
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn
from mpidist.nn import BatchNorm, Dense, Flatten, Sequential
from mpidist.parallel import AllreduceStrategy, LocalStrategy
from mpidist.parallel.data.node_model import NodeModelExchange, node_model_possible
from mpidist.parallel.data.ring import Ring
from mpidist.parallel.shards import chunk_bounds
from mpidist.runtime.cluster import build_cluster

from conftest import ROOT, events, run_mpi
from small_net import small_convnet, worker_slice
from test_recipe import STEPS, batches, clip_for, make, recipe, reference_local


@pytest.mark.parametrize(
    "lo,hi,itemsize,parts", [(0, 1, 4, 2), (16, 117, 4, 3), (0, 1000, 8, 6), (5, 9, 4, 4)]
)
def test_chunks_cover_the_part_in_cache_line_steps(lo, hi, itemsize, parts):
    bounds = chunk_bounds(lo, hi, itemsize, parts)
    assert len(bounds) == parts + 1 and bounds[0] == lo and bounds[-1] == hi
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert all((b - lo) % (64 // itemsize) == 0 for b in bounds[:-1])


@pytest.mark.mpi(min_size=2)
def test_a_model_with_running_statistics_keeps_a_copy_per_rank():
    model = Sequential([Flatten(), Dense(6), BatchNorm(), Dense(3)], (4,), dtype=np.float64)
    why = node_model_possible(MPI.COMM_WORLD, np.zeros(model.num_params + 1), model)
    assert "running statistics (BatchNorm)" in why


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [1, 5, 37, 1000])
def test_the_ring_sums_every_chunk_and_counts_what_it_sends(count):
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    lo, hi = 3, 3 + count  # a part of a larger buffer: the rest is left alone
    array = np.full(hi + 2, -1.0)
    array[lo:hi] = (rank + 1) * np.arange(count)
    ring = Ring(comm, lo, hi, array.dtype)
    ring.reduce_scatter(array)
    mine = slice(*ring.chunk)
    np.testing.assert_array_equal(
        array[mine], size * (size + 1) // 2 * np.arange(count)[mine.start - lo : mine.stop - lo]
    )
    ring.allgather(array)
    np.testing.assert_array_equal(array[lo:hi], size * (size + 1) // 2 * np.arange(count))
    assert (array[:lo] == -1).all() and (array[hi:] == -1).all()
    # reduce-scatter sends every chunk but this rank's own, allgather every chunk but the next rank's
    sizes = np.diff(ring.bounds)
    assert ring.sent == 8 * (2 * count - sizes[rank] - sizes[(rank + 1) % size])
    every = comm.allgather(array.tobytes())
    assert all(one == every[0] for one in every)


def _node_strategy(cluster, optimizer, accumulate, shard, clip=2.0):
    return AllreduceStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make(optimizer),
        cluster,
        seed=3,
        recipe=recipe(accumulate, clip),
        exchange="node",
        shard=shard,
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", ["none", "optimizer"])
@pytest.mark.parametrize("optimizer,accumulate", [("sgd", 1), ("adam", 3)])
def test_one_copy_per_node_trains_as_local_and_sends_the_rings_bound(optimizer, accumulate, shard):
    cluster = build_cluster(MPI.COMM_WORLD)
    workers = cluster.num_workers
    global_batch = 3 * workers + 2
    local, expected, clipped = reference_local(global_batch, optimizer, accumulate)
    state = local.optimizer.state_arrays()
    xs, ys = batches(global_batch)
    strategy = _node_strategy(cluster, optimizer, accumulate, shard, clip_for(global_batch, optimizer))
    exchange = strategy.exchange
    assert isinstance(exchange, NodeModelExchange)
    strategy.initialize()
    part = worker_slice(global_batch, workers, cluster.worker_index)
    for step in range(STEPS):
        strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
        np.testing.assert_allclose(strategy.model.params, expected[step], rtol=1e-9, atol=1e-12)
        assert strategy.clipped == clipped[step]
    every = cluster.workers.allgather(strategy.model.params.tobytes())
    assert all(params == every[0] for params in every)  # bit-identical on every node's copy

    # this rank updates a slice alone: 1/L of the node's model, 1/W with --shard optimizer
    nodes, local = exchange.nodes, exchange.node.Get_size()
    # (set where the ranks span emulated nodes)
    assert nodes == int(os.environ.get("MPIDIST_TEST_NODES", "1"))
    assert (
        strategy.part.size
        <= -(-strategy.model.num_params // (workers if shard == "optimizer" else local)) + 16
    )
    # what the node sent to other nodes per step: the ring's bound on the gradient buffer, within 1%
    node_bytes = exchange.node.allreduce(strategy.stats().get("internode_bytes_per_step", 0.0))
    bound = 2 * (nodes - 1) / nodes * strategy.buffer.nbytes
    assert node_bytes == pytest.approx(bound, rel=0.01, abs=0.0)

    # a checkpoint holds the whole optimizer state, gathered from the slices
    whole = strategy.state()
    if cluster.is_chief:
        params, arrays, steps = whole.params, whole.optimizer, whole.steps
        np.testing.assert_allclose(params, expected[-1], rtol=1e-9, atol=1e-12)
        assert steps == STEPS and arrays.keys() == state.keys()
        for name in state:
            np.testing.assert_allclose(arrays[name], state[name], rtol=1e-9, atol=1e-12)
    strategy.free()
    np.testing.assert_allclose(strategy.model.params, expected[-1], rtol=1e-9, atol=1e-12)  # (a copy now)
    cluster.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", ["none", "optimizer"])
def test_a_model_smaller_than_a_cache_line_per_rank_trains_as_local(shard):
    """Parts and chunks may be empty; the last, which holds the loss, never is."""
    cluster = build_cluster(MPI.COMM_WORLD)
    workers, worker = cluster.num_workers, cluster.worker_index

    def tiny():
        return Sequential([Dense(2)], (2,), dtype=np.float64)  # 6 parameters, the loss: 7 of 8 per line

    rng = np.random.default_rng(0)
    x, y = rng.random((2 * workers, 2)), rng.integers(0, 2, 2 * workers)
    local = LocalStrategy(tiny(), nn.loss_for(2, np), make("adam"), seed=3)
    strategy = AllreduceStrategy(
        tiny(), nn.loss_for(2, np), make("adam"), cluster, seed=3, exchange="node", shard=shard
    )
    for one in (local, strategy):
        one.initialize()
    mine = slice(2 * worker, 2 * worker + 2)
    for step in range(3):
        expected = local.train_step(x, y, 1.0, step)
        assert strategy.train_step(x[mine], y[mine], 1 / workers, step) == pytest.approx(expected, rel=1e-12)
        np.testing.assert_allclose(strategy.model.params, local.model.params, rtol=1e-9, atol=1e-12)
    whole = strategy.state()
    if cluster.is_chief:
        np.testing.assert_allclose(
            whole.optimizer["v"], local.optimizer.state_arrays()["v"], rtol=1e-9, atol=1e-15
        )
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_a_nan_on_one_rank_skips_the_step_on_every_rank():
    cluster = build_cluster(MPI.COMM_WORLD)
    strategy = _node_strategy(cluster, "adam", 1, "none")
    strategy.initialize()
    before = strategy.model.params.copy()
    rng = np.random.default_rng(cluster.worker_index)
    x, y = rng.random((3, 1, 6, 6)), rng.integers(0, 4, 3)
    for bad in range(cluster.num_workers):
        poisoned = x.copy()
        if cluster.worker_index == bad:
            poisoned[0, 0, 0, 0] = np.nan
        strategy.train_step(poisoned, y, 1 / cluster.num_workers, bad)
        assert strategy.skipped  # on every rank, whichever rank saw the NaN
        np.testing.assert_array_equal(strategy.model.params, before)
    strategy.train_step(x, y, 1 / cluster.num_workers, 1)  # (a step whose learning rate is not 0)
    assert not strategy.skipped and not np.array_equal(strategy.model.params, before)
    held = strategy.held_bytes()  # a node's copy counted 1/L on each rank; optimizer state for the part alone
    local = strategy.exchange.node.Get_size()
    assert (
        held["params"] == 8 * strategy.model.num_params // local and held["grads"] == strategy.buffer.nbytes
    )
    assert held["optimizer_state"] == 2 * 8 * strategy.part.size
    strategy.free()
    cluster.free()


@pytest.mark.parametrize("nodes", [2, 3])
def test_the_node_model_tests_pass_on_emulated_nodes(nodes):
    done, _ = run_mpi(
        2 * nodes,
        [
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "mpi",
            "--with-mpi",
            str(ROOT / "tests" / "parallel" / "test_node_model.py"),
        ],
        nodes=nodes,
        timeout=300,
        env={"MPIDIST_TEST_NODES": str(nodes)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in done.stdout and "failed" not in done.stdout


def test_under_an_address_space_limit_each_worker_keeps_its_own_copy(tmp_path):
    """ulimit -v counts the node's whole windows (the model and every worker's gradients) in every rank
    that maps them, where a rank's price counts its share: auto sums over MPI with a copy a rank, and the
    exchanges that share windows are refused when asked for, on every rank alike."""
    flags = ["-m", "mpidist", "train", "--steps", "1", "--run-dir", "", "--progress", "none"]
    limited = ("prlimit", f"--as={8 << 30}")
    metrics = tmp_path / "metrics.jsonl"
    auto, _ = run_mpi(2, [*flags, "--metrics", str(metrics)], timeout=120, prefix=limited)
    assert auto.returncode == 0, auto.stderr
    # (the node's one copy would count half the parameters on each rank: 26,122 of mlp's in float32)
    roles = events(metrics, "done")[-1]["roles"]
    assert [role["held_bytes"]["params"] for role in roles] == [26_122 * 4] * 2, roles
    for asked in ("node", "shared-memory"):
        refused, _ = run_mpi(2, [*flags, "--exchange", asked], timeout=120, prefix=limited)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count(f"--exchange {asked}: an address-space limit (ulimit -v)") == 1, (
            refused.stderr
        )
