"""Roles and communicators."""

import os

import pytest
from mpi4py import MPI

from mpidist.runtime.cluster import PS, WORKER, assign_roles, build_cluster


def test_without_ps_every_rank_is_a_worker():
    assert assign_roles([0, 0, 0], 0) == [WORKER] * 3


def test_ps_ranks_spread_over_nodes_before_doubling_up():
    roles = assign_roles([0, 0, 0, 1, 1, 1], 2)
    assert roles == [WORKER, WORKER, PS, WORKER, WORKER, PS]
    roles = assign_roles([0, 0, 0, 1, 1, 1], 3)
    assert roles.count(PS) == 3 and roles[0] == WORKER
    assert roles[1:3] == [PS, PS] and roles[5] == PS


def test_ps_on_one_node_take_the_last_ranks_and_keep_the_chief():
    assert assign_roles([0] * 4, 2) == [WORKER, WORKER, PS, PS]


def test_no_worker_left_is_refused():
    with pytest.raises(ValueError, match="no worker"):
        assign_roles([0, 0], 2)


@pytest.mark.mpi(min_size=2)
def test_all_ranks_are_workers_and_rank_0_is_the_chief():
    world = MPI.COMM_WORLD
    cluster = build_cluster(world)
    assert cluster.role == WORKER
    assert cluster.num_workers == world.Get_size() == cluster.workers.Get_size()
    assert cluster.worker_index == world.Get_rank()
    assert cluster.is_chief == (world.Get_rank() == 0)
    assert 0 <= cluster.node_index < cluster.num_nodes
    assert 0 <= cluster.local_rank < cluster.local_size
    nodes_total = world.allreduce(1 if cluster.local_rank == 0 else 0)
    assert nodes_total == cluster.num_nodes
    table = cluster.table("cpu")
    pids, nodes = world.gather(os.getpid()), world.allgather(cluster.node_index)
    if cluster.is_chief:
        lines = table.splitlines()
        assert lines[0].split() == ["rank", "host", "node", "pid", "local", "role", "index", "device"]  # (no
        # part of a model held, no data read: those columns are left out)
        assert [line.split()[0] for line in lines[1:]] == [str(r) for r in range(world.Get_size())]
        assert [int(line.split()[3]) for line in lines[1:]] == pids  # a launcher names pids, not ranks
        assert [int(line.split()[2]) for line in lines[1:]] == nodes
    else:
        assert table is None
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_a_cluster_frees_the_communicators_it_made_once():
    world = MPI.COMM_WORLD
    cluster = build_cluster(world, num_ps=1)
    made = (cluster.role_comm, cluster.node)
    cluster.free()
    assert all(comm == MPI.COMM_NULL for comm in made)
    cluster.free()  # a second free does nothing (it would be an MPI error on a freed handle)
    assert world.allreduce(1) == world.Get_size()  # the world itself is untouched
