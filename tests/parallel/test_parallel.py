"""Strategies: allreduce must equal local training on the same global batch."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn
from mpidist.parallel import AllreduceStrategy, LocalStrategy, bucket_slices
from mpidist.runtime.cluster import build_cluster

from small_net import small_convnet, worker_slice


def test_buckets_cover_the_buffer_contiguously():
    assert bucket_slices(10, 4, 16) == [(0, 4), (4, 8), (8, 10)]
    assert bucket_slices(10, 4, 1 << 20) == [(0, 10)]
    assert bucket_slices(3, 8, 1) == [(0, 1), (1, 2), (2, 3)]  # never an empty bucket


def train_both(cluster, global_batch, optimizer, dtype, steps=5, bucket_bytes=64 << 20):
    rng = np.random.default_rng(0)  # the same data on every rank
    xs = rng.random((steps, global_batch, 1, 6, 6)).astype(dtype)
    ys = rng.integers(0, 4, (steps, global_batch))
    make = lambda size: nn.make_optimizer(optimizer, size, 0.05, xp=np, dtype=dtype)  # noqa: E731
    ref_model, dist_model = small_convnet(dtype), small_convnet(dtype)
    local = LocalStrategy(ref_model, nn.loss_for(4, np), make, seed=3)
    dist = AllreduceStrategy(dist_model, nn.loss_for(4, np), make, cluster, seed=3, bucket_bytes=bucket_bytes)
    local.initialize()
    dist.initialize()
    part = worker_slice(global_batch, cluster.num_workers, cluster.worker_index)
    weight = (part.stop - part.start) / global_batch
    for step in range(steps):
        local_loss = local.train_step(xs[step], ys[step], 1.0, step)
        dist_loss = dist.train_step(xs[step][part], ys[step][part], weight, step)
        assert np.isclose(dist_loss, local_loss, rtol=1e-5)
    return ref_model.params, dist_model.params


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("extra", [0, 3], ids=["even-split", "uneven-split"])
def test_allreduce_equals_local_on_the_global_batch_float64(optimizer, extra):
    cluster = build_cluster(MPI.COMM_WORLD)
    expected, got = train_both(cluster, 4 * cluster.num_workers + extra, optimizer, np.float64)
    assert not np.allclose(got, small_convnet(np.float64).params)  # it did train
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_allreduce_equals_local_in_float32_within_summation_order():
    cluster = build_cluster(MPI.COMM_WORLD)
    expected, got = train_both(cluster, 8 * cluster.num_workers + 1, "sgd", np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_many_small_buckets_give_the_same_result_as_one():
    cluster = build_cluster(MPI.COMM_WORLD)
    expected, got = train_both(cluster, 2 * cluster.num_workers, "adam", np.float64, bucket_bytes=256)
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_workers_start_from_the_chiefs_parameters():
    world = MPI.COMM_WORLD
    cluster = build_cluster(world)
    model = small_convnet(np.float32)
    strategy = AllreduceStrategy(model, nn.loss_for(4, np), None, cluster, seed=10 + world.Get_rank())
    strategy.initialize()
    chief = small_convnet(np.float32)
    chief.init_params(10)  # the chief's seed (rank 0)
    np.testing.assert_array_equal(model.params, chief.params)


@pytest.mark.mpi(min_size=2)
def test_evaluation_sums_every_workers_shard():
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    cluster = build_cluster(world)
    rng = np.random.default_rng(1)
    x, y = rng.random((50, 1, 6, 6)), rng.integers(0, 4, 50)
    model = small_convnet(np.float64)
    strategy = AllreduceStrategy(model, nn.loss_for(4, np), None, cluster)
    strategy.initialize()
    figures = strategy.evaluate([(x[rank::size], y[rank::size])])
    out = model.forward(x)
    assert figures["samples"] == 50 and sum(figures["per_class"]["support"]) == 50
    assert np.isclose(figures["loss"], float(nn.SoftmaxCrossEntropy(np).forward(out, y)))
    assert np.isclose(figures["accuracy"], (out.argmax(axis=1) == y).mean())


def test_an_average_that_fails_leaves_the_array_as_it_was(monkeypatch):
    """A collective that fails (a rank died in it) leaves its buffer undefined: the average writes nothing
    then."""
    from mpidist.parallel.data import replicated as data_parallel

    def dies_midway(comm, array):
        array[: len(array) // 2] *= 3.0  # a partial sum, as a broken Allreduce may leave
        raise MPI.Exception(MPI.ERR_OTHER)

    params = np.arange(6.0)
    monkeypatch.setattr(data_parallel.mpi, "allreduce_sum", dies_midway)
    with pytest.raises(MPI.Exception):
        data_parallel.average_over(MPI.COMM_SELF, params[2:])
    np.testing.assert_array_equal(params, np.arange(6.0))  # (one that succeeds: the multi-rank test below)


@pytest.mark.mpi(min_size=2)
def test_an_average_over_the_ranks_is_their_mean_in_place():
    from mpidist.parallel.data.replicated import average_over

    comm = MPI.COMM_WORLD
    params = np.full(5, float(comm.Get_rank()))
    average_over(comm, params[1:])
    expected = (comm.Get_size() - 1) / 2
    np.testing.assert_array_equal(params, [comm.Get_rank()] + [expected] * 4)
