"""Buffer-based collectives: closed-form results at any rank count."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.runtime import comm


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_allreduce_sum_of_ranks_is_the_triangle_number(dtype):
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    array = np.full(1000, rank, dtype=dtype)
    assert comm.allreduce_sum(world, array) is array  # in place
    np.testing.assert_array_equal(array, size * (size - 1) // 2)


@pytest.mark.mpi(min_size=2)
def test_allreduce_sum_on_a_slice_leaves_the_rest_alone():
    world = MPI.COMM_WORLD
    array = np.ones(10)
    comm.allreduce_sum(world, array[3:7])
    np.testing.assert_array_equal(array, [1, 1, 1] + [world.Get_size()] * 4 + [1, 1, 1])


@pytest.mark.mpi(min_size=2)
def test_bcast_copies_the_roots_buffer():
    world = MPI.COMM_WORLD
    last = world.Get_size() - 1
    array = np.arange(5.0) * (world.Get_rank() + 1)
    comm.bcast(world, array, root=last)
    np.testing.assert_array_equal(array, np.arange(5.0) * (last + 1))


@pytest.mark.mpi(min_size=2)
def test_sum_float64_adds_scalars_over_ranks():
    world = MPI.COMM_WORLD
    size = world.Get_size()
    total = comm.sum_float64(world, [1.0, world.Get_rank()])
    np.testing.assert_array_equal(total, [size, size * (size - 1) / 2])


@pytest.fixture
def cuda_aware_env(monkeypatch):
    """Set (or with None, remove) MPIDIST_CUDA_AWARE; the detection cache is cleared around the test."""

    def set_to(value):
        if value is None:
            monkeypatch.delenv("MPIDIST_CUDA_AWARE", raising=False)
        else:
            monkeypatch.setenv("MPIDIST_CUDA_AWARE", value)
        comm.cuda_aware.cache_clear()

    yield set_to
    comm.cuda_aware.cache_clear()


def test_sum_float64_without_a_communicator_is_the_values():
    np.testing.assert_array_equal(comm.sum_float64(None, [2, 3]), [2.0, 3.0])


class FakeDeviceScalar:
    """A cupy 0-d array as numpy sees it: ``float()`` copies it to the host, implicit conversion is
    refused."""

    def __init__(self, value):
        self.value = value

    def __float__(self):
        return float(self.value)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


def test_sum_float64_takes_device_scalars_beside_host_ones():
    # local-sgd sums its loss as computed, a device scalar on a GPU (found by gpu/check.sh on an H200)
    total = comm.sum_float64(None, [FakeDeviceScalar(2.5), True, np.float32(1.5)])
    np.testing.assert_array_equal(total, [2.5, 1.0, 1.5])
    np.testing.assert_array_equal(
        comm.sum_float64(None, np.array([[1, 2], [3, 4]])), [[1.0, 2.0], [3.0, 4.0]]
    )


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("0", False), ("false", False)])
def test_cuda_awareness_can_be_overridden(cuda_aware_env, value, expected):
    cuda_aware_env(value)
    assert comm.cuda_aware() is expected
    assert comm.transfer_path() == ("cuda-aware" if expected else "host-staged")


def test_cuda_awareness_is_detected_from_the_loaded_library(cuda_aware_env):
    cuda_aware_env(None)
    assert comm.mpi_library_path() is not None
    assert isinstance(comm.cuda_aware(), bool)


class FakeDeviceArray:
    """Just enough of a cupy array to exercise host staging without a GPU."""

    def __init__(self, values):
        self.host = np.array(values, dtype=np.float64)
        self.__cuda_array_interface__ = {}

    def get(self):
        return self.host.copy()

    def set(self, values):
        self.host[...] = values


@pytest.mark.mpi(min_size=2)
def test_device_arrays_are_staged_through_the_host_when_mpi_is_not_cuda_aware(cuda_aware_env):
    cuda_aware_env("0")
    world = MPI.COMM_WORLD
    array = FakeDeviceArray([world.Get_rank(), 1.0])
    comm.allreduce_sum(world, array)
    np.testing.assert_array_equal(
        array.host, [world.Get_size() * (world.Get_size() - 1) / 2, world.Get_size()]
    )
    array = FakeDeviceArray([world.Get_rank()] * 3)
    comm.bcast(world, array, root=1)
    np.testing.assert_array_equal(array.host, [1.0] * 3)


@pytest.mark.mpi(min_size=2)
def test_point_to_point_staging_sends_and_receives_device_arrays_through_the_host(cuda_aware_env):
    cuda_aware_env("0")
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    outgoing = FakeDeviceArray(np.arange(4.0) + 10 * rank)
    request, staged = comm.isend(world, outgoing, (rank + 1) % size, tag=5)
    assert isinstance(staged, np.ndarray)  # a host copy travels, kept alive by the caller
    incoming = FakeDeviceArray(np.zeros(4))
    comm.recv(world, incoming, (rank - 1) % size, tag=5)
    request.Wait()
    np.testing.assert_array_equal(incoming.host, np.arange(4.0) + 10 * ((rank - 1) % size))


def test_an_operation_still_in_flight_at_a_loss_keeps_its_buffer_after_its_starter_lets_go():
    """After a lost rank the survivors drop the objects that started operations on the broken world; a buffer
    MPI may still write into must not be freed with them (mpi4py lets go of it with its request)."""
    import gc
    import weakref

    private = MPI.COMM_SELF.Dup()
    buffer = np.zeros(4)
    watch = weakref.ref(buffer)
    comm.irecv(private, buffer, 0, tag=7)  # (nobody sends: it stays in flight, as on a revoked communicator)
    done = np.zeros(3)
    done_watch = weakref.ref(done)
    comm.iallreduce_sum(private, done).wait()  # (completed: nothing to keep)
    assert comm.keep_in_flight() == 1
    del buffer, done
    gc.collect()
    assert watch() is not None and done_watch() is None
    assert comm.keep_in_flight() == 0  # (each is kept once)


def test_completed_operations_are_let_go_as_more_are_started():
    import gc
    import weakref

    private = MPI.COMM_SELF.Dup()
    watches = []
    for _ in range(3 * comm.InFlight.FIRST_PASS):
        array = np.ones(2)
        watches.append(weakref.ref(array))
        comm.iallreduce_sum(private, array).wait()
    del array
    gc.collect()
    assert sum(watch() is not None for watch in watches) <= comm.InFlight.FIRST_PASS
    comm.keep_in_flight()
    private.Free()
