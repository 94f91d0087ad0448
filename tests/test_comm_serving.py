"""The calls the ps serving loops make through runtime.comm (reductions by maximum and minimum, receives from
any rank), and the failure watch freed by its maker."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.runtime import comm as mpi
from mpidist.runtime.ulfm import FailureWatch


@pytest.mark.mpi(min_size=2)
def test_allreduce_max_and_min_take_each_element_over_the_ranks():
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    mine = np.array([rank, -rank, rank % 2, 7], dtype=np.int64)
    assert mpi.allreduce_max(world, mine.copy()).tolist() == [size - 1, 0, 1, 7]
    assert mpi.allreduce_min(world, mine.copy()).tolist() == [0, -(size - 1), 0, 7]


@pytest.mark.mpi(min_size=2)
def test_a_receive_from_any_rank_says_who_sent_it():
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if rank == 0:
        senders = []
        for _ in range(size - 1):
            words, status = np.zeros(2, dtype=np.int64), mpi.Status()
            mpi.recv(world, words, mpi.ANY_SOURCE, 21, status=status)
            assert words.tolist() == [status.source, 10 * status.source]
            senders.append(status.source)
        assert sorted(senders) == list(range(1, size))
    else:
        note = np.array([rank, 10 * rank], dtype=np.int64)
        mpi.wait_all([mpi.isend(world, note, 0, 21)[0]])
    world.Barrier()


def test_a_failure_watch_frees_its_communicator_once():
    watch = FailureWatch(MPI.COMM_SELF)
    assert watch.poll() == []
    watch.free()
    assert watch.comm is None and watch.group is None
    watch.free()   # a second call does nothing
