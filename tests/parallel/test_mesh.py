"""The grid of ranks: coordinates and groups by table, then each axis's communicator over real ranks."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.parallel.mesh import AXES, Mesh, MeshShape


@pytest.mark.parametrize(
    "ranks, stages, parts, rank, sizes, coordinates",
    [
        (8, 1, 1, 5, (8, 1, 1), (5, 0, 0)),  # data parallel: every rank a replica
        (8, 1, 2, 5, (4, 1, 2), (2, 0, 1)),  # --tensor 2: consecutive ranks a tensor group
        (8, 2, 1, 5, (4, 2, 1), (2, 1, 0)),  # --stages 2: consecutive ranks a replica's stages
        (8, 2, 2, 5, (2, 2, 2), (1, 0, 1)),  # data x pipeline x tensor
        (12, 3, 2, 11, (2, 3, 2), (1, 2, 1)),
        (1, 1, 1, 0, (1, 1, 1), (0, 0, 0)),
    ],
)
def test_a_rank_is_part_fastest_then_stage_then_replica(ranks, stages, parts, rank, sizes, coordinates):
    shape = MeshShape(ranks, stages, parts)
    assert shape.sizes == sizes and shape.coordinates(rank) == coordinates
    assert shape.rank_of(*coordinates) == rank
    assert [shape.size(axis) for axis in AXES] == list(sizes)


def test_every_rank_has_its_own_coordinates():
    shape = MeshShape(24, 3, 2)
    assert sorted(shape.coordinates(rank) for rank in range(24)) == [
        (d, p, t) for d in range(4) for p in range(3) for t in range(2)
    ]


@pytest.mark.parametrize(
    "axis, rank, colour, key",
    [
        ("part", 5, 2, 1),  # (1, 0, 1): the tensor group of replica 1's stage 0, third of 4 groups
        ("stage", 5, 3, 0),  # a pipe: replica 1, part 1 -> colour 1 x 2 + 1
        ("replica", 5, 1, 1),  # the same stage 0 and part 1 in every replica
        ("replica", 6, 2, 1),  # (1, 1, 0)
    ],
)
def test_a_group_is_the_ranks_whose_other_coordinates_are_equal(axis, rank, colour, key):
    assert MeshShape(8, 2, 2).group(axis, rank) == (colour, key)


def test_the_ranks_of_one_colour_differ_in_the_axis_alone():
    shape = MeshShape(12, 3, 2)
    for axis in AXES:
        groups = {}
        for rank in range(12):
            colour, key = shape.group(axis, rank)
            groups.setdefault(colour, {})[key] = rank
        assert len(groups) == 12 // shape.size(axis)
        for members in groups.values():
            assert sorted(members) == list(range(shape.size(axis)))
            kept = {
                tuple(c for a, c in zip(AXES, shape.coordinates(rank)) if a != axis)
                for rank in members.values()
            }
            assert len(kept) == 1


@pytest.mark.parametrize("ranks, stages, parts", [(6, 4, 1), (8, 1, 3), (4, 0, 1), (4, 1, 0)])
def test_a_grid_that_does_not_divide_the_ranks_is_refused(ranks, stages, parts):
    with pytest.raises(ValueError, match="do not divide"):
        MeshShape(ranks, stages, parts)


def test_a_process_alone_has_no_communicators_and_coordinates_zero():
    mesh = Mesh(None)
    assert [mesh.comm(axis) for axis in AXES] == [None, None, None]
    assert [mesh.index(axis) for axis in AXES] == [0, 0, 0] and mesh.is_last("stage")
    mesh.free()


@pytest.mark.mpi(min_size=4)
def test_each_axis_sums_over_the_ranks_whose_other_coordinates_are_equal():
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    if size % 4:
        pytest.skip("a 2 x 2 grid of stages and parts needs a multiple of 4 ranks")
    mesh = Mesh(world, stages=2, parts=2)
    shape = mesh.shape
    assert mesh.coordinates == shape.coordinates(rank)
    for axis in AXES:
        comm = mesh.comm(axis)
        assert comm.Get_size() == shape.size(axis) and comm.Get_rank() == mesh.index(axis)
        total = np.array([rank], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, total)
        # closed form: the world ranks of this rank's group, every coordinate but the axis's kept
        coordinates = dict(zip(AXES, mesh.coordinates))
        members = [shape.rank_of(**{**coordinates, axis: index}) for index in range(shape.size(axis))]
        assert total[0] == sum(members)
    owned = mesh.owned()
    assert len(owned) == (2 if size == 4 else 3)  # (with one replica its axis is COMM_SELF, not a split)
    mesh.free()
    assert all(comm == MPI.COMM_NULL for comm in owned)
    with pytest.raises(RuntimeError, match="freed"):
        mesh.comm("part")
    mesh.free()  # (a second free does nothing)


@pytest.mark.mpi(min_size=2)
def test_a_private_axis_over_every_rank_is_a_split_of_its_own_and_freed():
    world = MPI.COMM_WORLD
    mesh = Mesh(world, stages=world.Get_size(), private=("stage",))
    pipe = mesh.comm("stage")
    assert pipe is not world and pipe.Get_size() == world.Get_size() and pipe.Get_rank() == world.Get_rank()
    assert mesh.owned() == [pipe] and mesh.comm("replica") is MPI.COMM_SELF
    mesh.free()
    assert pipe == MPI.COMM_NULL


@pytest.mark.mpi(min_size=2)
def test_an_axis_over_every_rank_is_the_given_communicator_and_not_freed():
    world = MPI.COMM_WORLD
    mesh = Mesh(world)
    assert mesh.comm("replica") is world and mesh.comm("stage") is MPI.COMM_SELF and mesh.owned() == []
    assert mesh.index("replica") == world.Get_rank()
    mesh.free()
    assert mesh.comm("replica") is world  # (not the mesh's to free)
