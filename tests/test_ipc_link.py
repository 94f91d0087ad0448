"""The IPC link's protocol (slots, handles, acknowledgements, closing), run on CPUs with shared memory
standing in for the device's (host_ipc.py); tests/test_gpu.py runs it on a GPU with CUDA's."""

import os

import numpy as np
import pytest
from host_ipc import HostMemory, leftovers
from mpi4py import MPI

from mpidist.runtime import ipc_link
from mpidist.runtime.ipc_link import GRANULE, IpcLink


@pytest.fixture(autouse=True)
def no_leftovers():
    """A failed test leaves no stand-in files behind (the tests assert there are none where they pass)."""
    yield
    for name in leftovers():
        os.unlink(os.path.join("/dev/shm", name))


def message(tag, count, sender=0):
    """The closed-form contents of the message of ``tag`` from ``sender``: ``count`` float64 values."""
    return np.arange(count, dtype=np.float64) * (tag + 1) + 1000.0 * sender


@pytest.fixture
def self_link():
    """``make(memory)``: a link from this process to itself (its sends are its receives), over two
    communicators of its own, freed after the test."""
    comms = [MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()]
    yield lambda memory: IpcLink(*comms, 0, memory)
    for comm in comms:
        comm.Free()


def test_messages_in_flight_take_a_slot_each_and_arrive_whole_in_any_tag_order(self_link):
    memory = HostMemory()
    link = self_link(memory)
    counts = {2: 10, 4: 1000, 6: GRANULE // 8 + 1, 8: 1}  # (one past a granule: a slot of 2 granules)
    sent = {tag: message(tag, count) for tag, count in counts.items()}
    requests = [link.isend(array, tag)[0] for tag, array in sent.items()]
    for array in sent.values():
        array[...] = -1  # (the bytes left with the send: the array may be reused at once)
    for tag in (6, 2, 8, 4):
        got = link.recv(np.empty(counts[tag]), tag)
        np.testing.assert_array_equal(got, message(tag, counts[tag]))
    MPI.Request.Waitall(requests)
    assert (memory.made, memory.opened) == (4, 4)
    assert sorted(slot.capacity for slot in link.slots) == [GRANULE] * 3 + [2 * GRANULE]

    # (a second round of the same messages: the slots and the opened handles are used again)
    for tag, count in counts.items():
        request = link.isend(message(tag, count), tag)[0]
        np.testing.assert_array_equal(link.recv(np.empty(count), tag), message(tag, count))
        request.Wait()  # (a message to this process itself is delivered once received)
    assert (memory.made, memory.opened) == (4, 4)

    # (a message larger than every slot: a free slot is made larger, and its new handle travels)
    larger = 2 * GRANULE // 8 + 1
    request = link.isend(message(10, larger), 10)[0]
    assert (memory.made, memory.freed) == (5, 0)  # (the old memory stays: the peer maps it still)
    np.testing.assert_array_equal(link.recv(np.empty(larger), 10), message(10, larger))
    request.Wait()
    assert (memory.opened, memory.closed) == (5, 1)  # (the receiver let go of the old, took the new)
    request = link.isend(message(2, 3), 2)[0]  # (the acknowledgement seen: the old memory is freed)
    link.recv(np.empty(3), 2)
    request.Wait()
    assert (memory.made, memory.freed, memory.opened, memory.closed) == (5, 1, 5, 1)
    assert sorted(slot.capacity for slot in link.slots) == [GRANULE] * 2 + [2 * GRANULE, 3 * GRANULE]

    link.close()
    assert (memory.made, memory.freed, memory.opened, memory.closed) == (5, 5, 5, 5)
    assert leftovers() == []
    link.close()  # (a second close does nothing)
    with pytest.raises(RuntimeError, match="was closed"):
        link.isend(message(0, 4), 0)


def test_an_empty_message_and_a_2d_array_travel(self_link):
    memory = HostMemory()
    link = self_link(memory)
    link.isend(np.empty((0, 3)), 0)
    assert link.recv(np.empty((0, 3)), 0).shape == (0, 3)
    grid = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    link.isend(grid, 1)
    np.testing.assert_array_equal(link.recv(np.empty((3, 4), np.float32), 1), grid)
    link.close()
    assert leftovers() == []


def test_a_message_for_a_buffer_of_another_size_or_a_strided_array_is_refused_and_the_link_still_closes(
    self_link,
):
    memory = HostMemory()
    link = self_link(memory)
    link.isend(message(0, 8), 0)
    with pytest.raises(RuntimeError, match="a message of 64 bytes for a buffer of 56 bytes"):
        link.recv(np.empty(7), 0)
    with pytest.raises(ValueError, match="contiguous"):
        link.isend(np.zeros((4, 4))[:, 0], 2)
    link.close()
    assert memory.made == memory.freed and memory.opened == memory.closed and leftovers() == []


def pair():
    """``(communicator of ranks 0 and 1, the other's rank)`` on those two; the other ranks skip."""
    world = MPI.COMM_WORLD
    comm = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if comm == MPI.COMM_NULL:
        return None, None
    return comm, 1 - comm.Get_rank()


@pytest.mark.mpi(min_size=2)
def test_two_ranks_send_both_ways_at_once_and_a_sender_past_its_slots_waits_for_a_slot(monkeypatch):
    monkeypatch.setattr(ipc_link, "MAX_SLOTS", 2)
    comm, peer = pair()
    if comm is None:
        return
    acks = comm.Dup()
    memory = HostMemory()
    link = IpcLink(comm, acks, peer, memory)
    me = comm.Get_rank()
    sizes = [5, 300_000, 7, 300_000, 2]  # (five messages each way, at most two slots in flight)
    requests = [link.isend(message(tag, size, me), tag)[0] for tag, size in enumerate(sizes) if tag < 2]
    for tag, size in enumerate(sizes):
        if tag >= 2:  # (past two in flight: the send waits for the peer to take one)
            requests.append(link.isend(message(tag, size, me), tag)[0])
        np.testing.assert_array_equal(link.recv(np.empty(size), tag), message(tag, size, peer))
    MPI.Request.Waitall(requests)
    assert len(link.slots) == 2 and memory.made <= 3
    link.close()
    assert memory.made == memory.freed and memory.opened == memory.closed
    assert leftovers() == []
    acks.Free()
    comm.Free()


def test_a_link_abandoned_after_a_lost_rank_lets_go_of_everything_without_mpi(self_link):
    memory = HostMemory()
    link = self_link(memory)
    requests = [link.isend(message(tag, 10), tag)[0] for tag in (0, 2)]
    link.recv(np.empty(10), 0)  # (one received, one left in flight)
    link.abandon()
    assert memory.made == memory.freed == 2 and memory.opened == memory.closed == 1
    assert leftovers() == []
    with pytest.raises(RuntimeError, match="was closed"):
        link.recv(np.empty(10), 2)
    MPI.Request.Waitall(requests[:1])


class RefusingMemory(HostMemory):
    """Memory another process cannot map (a GPU this rank cannot see, a container without shared IPC)."""

    def open(self, handle):
        raise OSError("cudaErrorInvalidDevice: invalid device ordinal")


@pytest.mark.mpi(min_size=2)
def test_the_probe_agrees_on_whether_each_pair_can_map_the_others_memory():
    comm, peer = pair()
    if comm is None:
        return
    acks = comm.Dup()
    memory = HostMemory()
    assert ipc_link.probe(acks, [peer], memory) is None
    refused = ipc_link.probe(acks, [peer], RefusingMemory() if comm.Get_rank() == 1 else memory)
    assert refused is not None
    if comm.Get_rank() == 1:
        assert "rank 0's device memory could not be mapped (OSError: cudaErrorInvalidDevice" in refused
    assert ipc_link.probe(acks, [], memory) is None  # (no pair on either rank: nothing refused)
    assert leftovers() == []
    acks.Free()
    comm.Free()
