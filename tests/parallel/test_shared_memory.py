"""The shared-memory exchange: closed-form sums on real ranks, its barriers under skew, and how allreduce
picks it."""

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn
from mpidist.parallel import AllreduceStrategy, Exchange
from mpidist.parallel.data.compression import CompressedExchange
from mpidist.parallel.data.node_model import NodeModelExchange
from mpidist.parallel.shards import chunk_bounds
from mpidist.parallel.data.shared_memory import ONE_WORKER, SharedMemoryExchange, shared_memory_possible
from mpidist.runtime.cluster import build_cluster
from mpidist.runtime.errors import UsageError


@pytest.mark.parametrize(
    "count,itemsize,parts", [(1, 4, 2), (5, 4, 3), (100, 4, 2), (1000, 8, 6), (33, 4, 4)]
)
def test_parts_cover_the_buffer_and_start_on_cache_lines(count, itemsize, parts):
    bounds = chunk_bounds(0, count, itemsize, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == count
    assert all(lo <= hi for lo, hi in zip(bounds, bounds[1:]))
    assert all(b % (64 // itemsize) == 0 for b in bounds[:-1])


def test_one_worker_has_nothing_to_share():
    assert shared_memory_possible(MPI.COMM_SELF, np.zeros(4, np.float32)) == ONE_WORKER
    assert shared_memory_possible(None, np.zeros(4, np.float32)) == ONE_WORKER


def _sgd(size):
    return nn.make_optimizer("sgd", size, 0.05)


def _strategy(comm, **arguments):
    model = nn.build_model("mlp:8", (8, 8), 10, np, np.float32)
    strategy = AllreduceStrategy(model, nn.loss_for(10, np), _sgd, build_cluster(comm), seed=3, **arguments)
    strategy.initialize()
    return strategy


def test_compression_and_a_forced_shared_memory_exchange_do_not_mix():
    with pytest.raises(UsageError, match="nothing for --compress bf16 to compress"):
        _strategy(MPI.COMM_SELF, compress="bf16", exchange="shared-memory")


def test_elastic_training_sums_over_mpi():
    """A lost worker must surface as MPI's process-failure error: MPI's shared-memory windows give none."""
    from mpidist.settings.config import Settings

    assert AllreduceStrategy.arguments(Settings(elastic=True), None)["exchange"] == "mpi"
    assert AllreduceStrategy.arguments(Settings(), None)["exchange"] == "auto"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [1, 3, 17, 1000, 4099])
def test_every_worker_gets_the_closed_form_sum(count):
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    assert shared_memory_possible(comm, np.zeros(count, np.float32)) is None  # mpiexec on one machine
    exchange = SharedMemoryExchange(comm, np.full(count, -1.0, np.float32))
    try:
        assert (exchange.buffer == -1).all()  # it starts from the buffer it was given
        for step in range(3):
            exchange.begin()
            exchange.buffer[...] = (rank + 1) * (step + 1) * np.arange(count, dtype=np.float32)
            exchange.finish()
            expected = size * (size + 1) // 2 * (step + 1) * np.arange(count)
            np.testing.assert_array_equal(exchange.buffer, expected)
            assert exchange.finite()
            assert exchange.bytes_per_step == 4 * count
    finally:
        exchange.free()


@pytest.mark.mpi(min_size=2)
def test_a_nan_on_one_worker_is_seen_by_every_worker():
    comm = MPI.COMM_WORLD
    exchange = SharedMemoryExchange(comm, np.zeros(100, np.float64))
    try:
        for bad_rank in range(comm.Get_size()):
            exchange.begin()
            exchange.buffer[...] = 1.0
            if comm.Get_rank() == bad_rank:
                exchange.buffer[(37 * bad_rank) % 100] = np.nan
            exchange.finish()
            assert not exchange.finite()
            exchange.begin()
            exchange.buffer[...] = 1.0
            exchange.finish()
            assert exchange.finite()
    finally:
        exchange.free()


class _Dawdling(SharedMemoryExchange):
    """Slow in one phase or the other, by worker and step: the others race ahead into the next phase."""

    def __init__(self, comm, buffer, slow):
        super().__init__(comm, buffer)
        self.slow = slow

    def _sum_own_part(self):
        if self.slow() == "sum":
            time.sleep(0.003)
        super()._sum_own_part()

    def _copy_other_parts(self):
        if self.slow() == "copy":
            time.sleep(0.003)
        super()._copy_other_parts()


@pytest.mark.mpi(min_size=2)
def test_the_barriers_hold_when_workers_run_at_different_speeds():
    """A worker that races ahead must not read a part before it is written or summed, nor overwrite one still
    read.

    Without any one of the three barriers this fails (each was taken out in turn when it was written).
    """
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    step = 0
    phases = ("write", "sum", "copy", None)
    exchange = _Dawdling(comm, np.zeros(5000, np.float32), lambda: phases[(step + rank) % 4])
    try:
        for step in range(24):
            exchange.begin()
            if phases[(step + rank) % 4] == "write":
                time.sleep(0.003)
            exchange.buffer[...] = rank + step
            exchange.finish()
            assert (exchange.buffer == size * (size - 1) // 2 + size * step).all(), step
    finally:
        exchange.free()


@pytest.mark.mpi(min_size=2)
def test_allreduce_trains_the_same_over_shared_memory_as_over_mpi():
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal((16, 8, 8)).astype(np.float32), rng.integers(0, 10, 16)
    params, losses = {}, {}
    for kind in ("shared-memory", "mpi"):
        strategy = _strategy(comm, exchange=kind)
        assert isinstance(strategy.exchange, SharedMemoryExchange if kind == "shared-memory" else Exchange)
        losses[kind] = [strategy.train_step(x, y, 1.0 / size, step) for step in range(5)]
        grads = strategy.model.grads.copy()
        strategy.free()
        # after close the gradients are the strategy's own copy: still there, still readable
        np.testing.assert_array_equal(strategy.model.grads, grads)
        params[kind] = strategy.model.params.copy()
    np.testing.assert_allclose(losses["shared-memory"], losses["mpi"], rtol=1e-5)
    np.testing.assert_allclose(params["shared-memory"], params["mpi"], rtol=1e-5, atol=1e-6)
    # one sum per part, copied by everyone: every worker holds the very same parameters
    everyone = np.empty((size, params["shared-memory"].size), np.float32)
    comm.Allgather(params["shared-memory"], everyone)
    assert (everyone == everyone[0]).all()


@pytest.mark.mpi(min_size=2)
def test_auto_picks_one_model_per_node_then_shared_gradients_and_mpi_to_compress():
    comm = MPI.COMM_WORLD
    for arguments, kind in (
        ({}, NodeModelExchange),
        ({"exchange": "shared-memory"}, SharedMemoryExchange),
        ({"exchange": "mpi"}, Exchange),
        ({"compress": "bf16"}, CompressedExchange),
    ):
        strategy = _strategy(comm, **arguments)
        try:
            assert type(strategy.exchange) is kind
        finally:
            strategy.free()
    # BatchNorm's running statistics are written by each worker's forward: no one copy of them per node
    model = nn.Sequential([nn.Flatten(), nn.Dense(8), nn.BatchNorm(), nn.Dense(10)], (8, 8), dtype=np.float32)
    strategy = AllreduceStrategy(model, nn.loss_for(10, np), _sgd, build_cluster(comm), seed=3)
    try:
        assert type(strategy.exchange) is SharedMemoryExchange
    finally:
        strategy.free()
