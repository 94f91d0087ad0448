"""The calls the ps serving loops make through runtime.comm (reductions by maximum and minimum, a receive
posted per rank), and the failure watch freed by its maker."""

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
def test_one_receive_per_rank_takes_each_message_as_it_completes_and_says_from_whom():
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if rank == 0:
        senders = list(range(1, size))
        words = np.zeros((len(senders), 2), dtype=np.int64)
        requests = [mpi.irecv(world, words[index], sender, 21) for index, sender in enumerate(senders)]
        taken = []
        for look in range(len(senders)):
            index = mpi.wait_any(requests, first=look)
            assert requests[index] is None and words[index].tolist() == [senders[index], 10 * senders[index]]
            taken.append(index)
        assert sorted(taken) == list(range(len(senders)))
        # nothing posted: nothing to wait for
        assert mpi.wait_any(requests) is None and mpi.wait_any([]) is None
    else:
        note = np.array([rank, 10 * rank], dtype=np.int64)
        mpi.wait_all([mpi.isend(world, note, 0, 21)[0]])
    world.Barrier()


@pytest.mark.mpi(min_size=3)
def test_wait_any_looks_first_where_it_is_told():
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if rank == 0:
        words = np.zeros((2, 1), dtype=np.int64)
        requests = [mpi.irecv(world, words[index], index + 1, 22) for index in range(2)]
        # both arrived (Get_status frees nothing)
        while not all(request.Get_status() for request in requests):
            pass
        assert mpi.wait_any(requests, first=1) == 1 and mpi.wait_any(requests, first=1) == 0
    elif rank in (1, 2):
        mpi.wait_all([mpi.isend(world, np.array([rank], dtype=np.int64), 0, 22)[0]])
    world.Barrier()


def test_a_failure_watch_frees_its_communicator_once():
    watch = FailureWatch(MPI.COMM_SELF)
    assert watch.poll() == []
    watch.free()
    assert watch.comm is None and watch.group is None
    watch.free()  # a second call does nothing
