"""Sums by NCCL over MPI ranks' GPUs (mpidist.runtime.nccl_sum, mpidist.parallel.data.nccl_exchange).

NCCL needs a GPU per rank, which neither this machine nor a one-GPU check
has: these tests reach the code with stand-ins.  The agreement and the
bootstrap (rank 0's unique id to every rank) run over real MPI ranks with a
stand-in NCCL module; the exchange runs real training steps with a group
that sums over MPI where NCCL would sum on the device.
"""

import types

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn
from mpidist.parallel import AllreduceStrategy, LocalStrategy
from mpidist.parallel.data import allreduce
from mpidist.runtime import comm as mpi
from mpidist.runtime import nccl_sum
from mpidist.runtime.cluster import build_cluster

from small_net import small_convnet, worker_slice


class MpiSum:
    """:class:`~mpidist.runtime.nccl_sum.NcclSum`'s stand-in: each sum an MPI allreduce of a host array."""

    def __init__(self, comm):
        self.comm, self.sums, self.joins, self.freed = comm, [], 0, False

    def sum(self, array):
        assert array.flags.c_contiguous
        self.sums.append(array.size)
        mpi.allreduce_sum(self.comm, array)

    def join(self):
        self.joins += 1

    def free(self):
        self.freed = True


def _fake_nccl(made):
    """A stand-in ``cupy.cuda.nccl``: its unique id is 128 bytes of this rank's number; a communicator records
    what it was made with in ``made``."""

    def communicator(size, uid, rank):
        made.append((size, uid, rank))
        return types.SimpleNamespace(destroy=lambda: None)

    rank = MPI.COMM_WORLD.Get_rank()
    return types.SimpleNamespace(get_unique_id=lambda: bytes([rank + 7]) * 128, NcclCommunicator=communicator)


_FAKE_CUPY = types.SimpleNamespace(
    cuda=types.SimpleNamespace(Stream=lambda non_blocking: types.SimpleNamespace(synchronize=lambda: None))
)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "after-backward"])
def test_an_allreduce_whose_buckets_nccl_sums_equals_local_training(monkeypatch, overlap):
    """Seven steps, an uneven split, buckets of 256 bytes: each step's loss and the parameters are the local
    run's on the global batch; every bucket was summed once a step and the device joined once a step."""
    world = MPI.COMM_WORLD
    groups = []

    def group(comm, buffer):
        groups.append(MpiSum(comm))
        return groups[-1], None

    monkeypatch.setattr(allreduce, "nccl_group", group)
    cluster = build_cluster(world)
    make = lambda size: nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    local = LocalStrategy(small_convnet(np.float64), nn.loss_for(4, np), make, seed=3)
    dist = AllreduceStrategy(
        small_convnet(np.float64), nn.loss_for(4, np), make, cluster, seed=3, bucket_bytes=256
    )
    dist.exchange.overlap = overlap
    assert type(dist.exchange).__name__ == "NcclExchange" and dist.stats()["exchange_route"] == "nccl"
    local.initialize()
    dist.initialize()
    rng = np.random.default_rng(0)  # (the same batches on every rank)
    steps = 7
    for step in range(steps):
        x, y = (
            rng.random((4 * cluster.num_workers + 3, 1, 6, 6)),
            rng.integers(0, 4, 4 * cluster.num_workers + 3),
        )
        part = worker_slice(len(x), cluster.num_workers, cluster.worker_index)
        expected = local.train_step(x, y, 1.0, step)
        got = dist.train_step(x[part], y[part], (part.stop - part.start) / len(x), step)
        assert got == pytest.approx(expected, rel=1e-9)
    np.testing.assert_allclose(dist.model.params, local.model.params, rtol=1e-9, atol=1e-12)
    (sums,) = groups
    assert len(sums.sums) == steps * len(dist.exchange.buckets) and sum(sums.sums) == steps * dist.buffer.size
    assert sums.joins == steps
    dist.free()
    assert sums.freed


@pytest.mark.mpi(min_size=2)
def test_host_arrays_are_summed_by_mpi_on_every_rank():
    world = MPI.COMM_WORLD
    assert nccl_sum.nccl_group(world, np.zeros(4, np.float32)) == (None, "host arrays")
    strategy = AllreduceStrategy(small_convnet(np.float32), nn.loss_for(4, np), None, build_cluster(world))
    assert type(strategy.exchange).__name__ != "NcclExchange" and "nccl_off" not in strategy.stats()
    strategy.free()


@pytest.mark.mpi(min_size=2)
def test_one_rank_that_cannot_use_nccl_keeps_every_rank_off_it(monkeypatch):
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    facts = (
        ("no NCCL (pip install nvidia-nccl-cu13)", None, None, 0) if rank == 1 else (None, None, None, rank)
    )
    monkeypatch.setattr(nccl_sum, "_local_facts", lambda buffer: facts)
    group, why = nccl_sum.nccl_group(world, None)
    assert group is None
    assert why == (
        "no NCCL (pip install nvidia-nccl-cu13)" if rank == 1 else "rank 1 of the group cannot use NCCL"
    )


@pytest.mark.mpi(min_size=2)
def test_two_ranks_on_one_gpu_keep_off_nccl(monkeypatch):
    world = MPI.COMM_WORLD
    made = []
    device = max(world.Get_rank(), 1)  # (ranks 0 and 1 on one GPU, the others on GPUs of their own)
    facts = (None, _fake_nccl(made), _FAKE_CUPY, device)
    monkeypatch.setattr(nccl_sum, "_local_facts", lambda buffer: facts)
    assert nccl_sum.nccl_group(world, None) == (None, "two ranks share a GPU (NCCL needs one GPU per rank)")
    assert made == []  # (nobody started NCCL's initialisation, which waits for every rank)


@pytest.mark.mpi(min_size=2)
def test_every_rank_joins_nccl_with_rank_0s_unique_id(monkeypatch):
    world = MPI.COMM_WORLD
    made = []
    facts = (None, _fake_nccl(made), _FAKE_CUPY, 1000 + world.Get_rank())
    monkeypatch.setattr(nccl_sum, "_local_facts", lambda buffer: facts)
    group, why = nccl_sum.nccl_group(world, None)
    assert why is None and isinstance(group, nccl_sum.NcclSum)
    assert made == [(world.Get_size(), bytes([7]) * 128, world.Get_rank())]  # (rank 0's id is 128 bytes of 7)
    group.free()
    assert group.communicator is None


def test_a_unique_id_in_either_form_cupy_has_given_it():
    """cupy 14 gives NCCL's id as bytes and takes bytes; earlier versions a tuple of signed chars."""
    signed = tuple(range(-64, 64))
    assert nccl_sum._as_bytes(signed) == np.array(signed, np.int8).tobytes()
    assert nccl_sum._as_bytes(b"\x01" * 128) == b"\x01" * 128
    made = []

    def old_communicator(size, uid, rank):  # (cupy before 14: a tuple, nothing else)
        if not isinstance(uid, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        made.append(uid)

    nccl = types.SimpleNamespace(NcclCommunicator=old_communicator)
    nccl_sum._communicator(nccl, 2, np.array(signed, np.int8).tobytes(), 0)
    assert made == [signed]
