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

from conftest import run_mpi
from small_net import small_convnet, worker_slice


class MpiSum:
    """:class:`~mpidist.runtime.nccl_sum.NcclSum`'s stand-in: a sum takes the bucket as it is when asked (as
    NCCL's stream reads it once the compute stream has written it) and lands in it only at :meth:`join` (as
    the compute stream sees NCCL's sums only once it waited for them), each an MPI allreduce."""

    def __init__(self, comm):
        self.comm, self.sums, self.pending, self.joins, self.freed = comm, [], [], 0, False

    def sum(self, array):
        assert array.flags.c_contiguous
        self.sums.append(array.size)
        self.pending.append((array, array.copy()))

    def join(self):
        self.joins += 1
        for array, taken in self.pending:
            mpi.allreduce_sum(self.comm, taken)
            array[...] = taken
        self.pending = []

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
def test_two_ranks_of_a_node_on_one_gpu_keep_every_rank_off_nccl(monkeypatch):
    world = MPI.COMM_WORLD
    made = []
    device = max(world.Get_rank(), 1)  # (ranks 0 and 1 on one GPU, the others on GPUs of their own)
    facts = (None, _fake_nccl(made), _FAKE_CUPY, device)
    monkeypatch.setattr(nccl_sum, "_local_facts", lambda buffer: facts)
    group, why = nccl_sum.nccl_group(world, None)
    assert group is None
    if world.Get_rank() < 2:
        assert why == "two ranks of a node share a GPU (NCCL needs one GPU per rank)"
    else:
        assert why == "rank 0 of the group cannot use NCCL"
    assert made == []  # (nobody started NCCL's initialisation, which waits for every rank)


SHARES = """
import sys
from mpi4py import MPI
from mpidist.runtime import nccl_sum

world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
local = node.Get_rank()
node.Free()
same_ids = nccl_sum._shares_a_gpu(world, local)  # (every node numbers its GPUs 0, 1, ...)
one_gpu = nccl_sum._shares_a_gpu(world, 0)
answers = world.gather((same_ids, one_gpu), root=0)
if world.Get_rank() == 0:
    print(answers)
"""


def test_a_gpu_is_told_apart_within_its_node(tmp_path):
    """Two nodes' GPUs may have the same PCI bus id: 2 emulated nodes of 2 ranks, each node's GPUs numbered
    0 and 1, share none; every rank on GPU 0 shares it with its node's other rank."""
    script = tmp_path / "shares.py"
    script.write_text(SHARES)
    done, _ = run_mpi(4, [str(script)], nodes=2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([(False, True)] * 4)


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


@pytest.mark.mpi(min_size=2)
def test_rank_0_without_a_unique_id_keeps_every_rank_off_nccl(monkeypatch):
    """NCCL's bootstrap finding no network on rank 0 (NCCL_SOCKET_IFNAME) leaves no rank waiting in the
    broadcast of the id: every rank goes on with MPI."""
    world = MPI.COMM_WORLD
    made = []
    nccl = _fake_nccl(made)

    def no_network():
        raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR: no socket interface found")

    nccl.get_unique_id = no_network
    monkeypatch.setattr(nccl_sum, "_local_facts", lambda buffer: (None, nccl, _FAKE_CUPY, world.Get_rank()))
    group, why = nccl_sum.nccl_group(world, None)
    assert group is None and made == []
    if world.Get_rank() == 0:
        assert why == "NCCL's unique id: RuntimeError: NCCL_ERROR_SYSTEM_ERROR: no socket interface found"
    else:
        assert why == "rank 0 could not make NCCL's unique id"


def test_mpi_with_fault_tolerance_on_keeps_off_nccl(monkeypatch):
    """A lost worker must surface as MPI's process-failure error (--elastic): NCCL's sums would wait for it
    for ever."""
    monkeypatch.setattr(nccl_sum, "ulfm_support", lambda: (True, ""))
    why = nccl_sum._local_facts(
        types.SimpleNamespace(__cuda_array_interface__={}, dtype=np.dtype(np.float32))
    )[0]
    assert why.startswith("MPI runs with fault tolerance on")


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
