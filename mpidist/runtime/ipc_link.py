"""Sends between two ranks of one node whose bytes move device to device: MPI carries only handles and order.

Without a CUDA-aware MPI a device array between two processes went through
host memory (3.3-6 GB/s on an H200 for 64 MiB, where a device copy runs at
474-543 GB/s).  Two processes on one node can instead map each other's
device memory by CUDA IPC handles (the ``ipc`` route of
:mod:`~mpidist.runtime.routes`).  The protocol, one :class:`IpcLink` per
pair, the same at both ends:

* the sender copies the array into a *slot* of device memory it owns and
  exported, waits for the copy, and sends a small header by MPI with the
  message's tag: which slot, how many bytes, and the slot's handle when the
  slot is new or was made larger;
* the receiver maps the slot the first time its handle comes (an opened
  handle is kept: opening costs far more than a copy), copies out of it into
  its buffer, waits for the copy, and acknowledges the slot;
* a slot is used again only once acknowledged, so every message in flight
  has a slot of its own: a schedule with several messages in flight to one
  peer (1F1B) gets as many slots, never a wait for the receiver that the
  schedule does not already have (up to :data:`MAX_SLOTS`).

A send therefore returns with the array free for reuse (its bytes are in the
slot) and an MPI request for the header, which is what a caller of
:func:`~mpidist.runtime.comm.isend` waits on.  Messages of one tag arrive in
order, as MPI's do; the slot travels in the header, so messages of several
tags may be received in any order.

The device side is an object of six operations (:class:`~mpidist.runtime.cuda_ipc.CudaMemory`);
the tests run the whole protocol on CPUs with one over POSIX shared memory.
"""

import numpy as np
from mpi4py import MPI

from . import comm as mpi

#: bytes of a CUDA IPC memory handle (``cudaIpcMemHandle_t``)
HANDLE_BYTES = 64
#: a header's words: the slot, the bytes, whether a handle follows, the handle
HEADER_WORDS = 3 + HANDLE_BYTES // 8
#: slots a link makes at most towards its peer (messages in flight to it at once)
MAX_SLOTS = 64
#: a slot's size is a multiple of this (CUDA's allocation granularity): a smaller last batch fits, and a
#: message a little larger than the last rarely needs a new slot
GRANULE = 2 << 20
#: tags on the acknowledgements' communicator besides the slots' (0 .. MAX_SLOTS - 1): the closing
#: handshake, and the handles of the start-up probe (:func:`probe`)
CLOSING, PROBING = MAX_SLOTS, MAX_SLOTS + 1


class _Slot:
    """Device memory this rank exported to its peer, and the message using it (if any)."""

    def __init__(self, index):
        self.index = index
        self.memory, self.capacity, self.handle = None, 0, None
        self.fresh = False  # its handle has not been sent yet
        self.retired = None  # the memory it was made larger from, mapped by the peer until it takes the new
        self.header = np.zeros(HEADER_WORDS, np.int64)
        self.sent = None  # the header's send (its buffer is not written again until it completes)
        self.ack = np.zeros(1, np.int64)
        self.acknowledged = None  # the receive of its acknowledgement while a message uses it


class IpcLink:
    """Device-to-device sends to and receives from ``peer``, one rank of the same node.

    Both ends make one, and both close it (:meth:`close`, collective over the
    pair).  ``messages`` carries the headers with the callers' tags and
    ``acks`` the acknowledgements: communicators of the caller's, over which no
    other traffic between the pair may use those tags (the caller frees them
    after :meth:`close`).

    Args:
        messages, acks: the two communicators (both ends in them).
        peer: the other end's rank in them.
        memory: the device's operations (:class:`~mpidist.runtime.cuda_ipc.CudaMemory`).
    """

    def __init__(self, messages, acks, peer, memory):
        self.messages, self.acks, self.peer, self.memory = messages, acks, int(peer), memory
        self.slots = []  # exported to the peer
        self.mapped = {}  # the peer's slots this rank opened, by index
        self.header = np.zeros(HEADER_WORDS, np.int64)
        self.acks_sent = []  # requests of acknowledgements not known to be delivered
        self.closed = False

    def isend(self, array, tag):
        """Send ``array`` (contiguous, on the device) with ``tag``: ``(request, header)``.

        The array may be overwritten as soon as this returns; the request
        (the header's send) completes without the receiver.
        """
        self._open()
        if not array.flags.c_contiguous:
            raise ValueError("an IPC send takes a contiguous array")
        nbytes = int(array.nbytes)
        slot = self._slot_for(nbytes)
        if nbytes:
            self.memory.put(slot.memory, array)
            self.memory.wait()  # (the peer reads the slot outside this process's stream order)
        if slot.sent is not None:
            slot.sent.Wait()  # (done long ago: its message was acknowledged)
        header = slot.header
        header[:3] = (slot.index, nbytes, int(slot.fresh))
        if slot.fresh:
            header[3:] = np.frombuffer(slot.handle, np.int64)
            slot.fresh = False
        slot.acknowledged = mpi.irecv(self.acks, slot.ack, self.peer, slot.index)
        slot.sent, _ = mpi.isend(self.messages, header, self.peer, tag)
        return slot.sent, header

    def recv(self, buffer, tag):
        """Receive the message of ``tag`` into ``buffer`` (contiguous, on the device, the message's size)."""
        self._open()
        header = self.header
        mpi.recv(self.messages, header, self.peer, tag)
        index, nbytes, fresh = (int(word) for word in header[:3])
        if not 0 <= index < MAX_SLOTS or (not fresh and index not in self.mapped):
            raise RuntimeError(f"IPC link from rank {self.peer}: a header names slot {index}, never opened")
        if fresh:
            if index in self.mapped:
                self.memory.close(self.mapped.pop(index))
            self.mapped[index] = self.memory.open(header[3:].tobytes())
        if nbytes != buffer.nbytes or not buffer.flags.c_contiguous:
            self._acknowledge(index)  # (refused, its slot is the sender's again: both ends can still close)
            raise RuntimeError(
                f"IPC link from rank {self.peer}: a message of {nbytes} bytes for a buffer of "
                f"{buffer.nbytes} bytes{'' if buffer.flags.c_contiguous else ' (not contiguous)'} (tag {tag})"
            )
        if nbytes:
            self.memory.take(buffer, self.mapped[index], nbytes)
            self.memory.wait()  # (the slot is the sender's again once acknowledged)
        self._acknowledge(index)
        return buffer

    def close(self):
        """Collective over the pair: wait for the peer's acknowledgements, let go of its slots, and free this
        rank's own once the peer has let go of them (a second call does nothing)."""
        if self.closed:
            return
        self.closed = True
        MPI.Request.Waitall([slot.acknowledged for slot in self.slots if slot.acknowledged is not None])
        for memory in self.mapped.values():
            self.memory.close(memory)
        self.mapped = {}
        MPI.Request.Waitall(self.acks_sent)
        self.acks_sent = []
        # (each end has let go of the other's slots once both have said so)
        mpi.sendrecv(self.acks, np.zeros(1, np.int64), self.peer, np.zeros(1, np.int64), self.peer, CLOSING)
        MPI.Request.Waitall([slot.sent for slot in self.slots if slot.sent is not None])
        self.abandon()

    def abandon(self):
        """Let go of every slot and mapping here, without MPI (after a lost rank, where the pair's handshake
        would wait for the dead; and as :meth:`close`'s last step)."""
        self.closed = True
        for memory in self.mapped.values():
            self.memory.close(memory)
        self.mapped = {}
        for slot in self.slots:
            for memory in (slot.memory, slot.retired):
                if memory is not None:
                    self.memory.free(memory)
        self.slots = []

    def _open(self):
        if self.closed:
            raise RuntimeError(f"the IPC link to rank {self.peer} was closed")

    def _slot_for(self, nbytes):
        """A slot of ``nbytes`` at least that no message in flight uses: the smallest free one that fits, a
        free one made larger, or a new one (waiting for an acknowledgement only past :data:`MAX_SLOTS`)."""
        while True:
            free = [slot for slot in self.slots if self._is_free(slot)]
            fitting = [slot for slot in free if slot.capacity >= nbytes]
            if fitting:
                return min(fitting, key=lambda slot: slot.capacity)
            if free or len(self.slots) < MAX_SLOTS:
                slot = free[0] if free else self._new_slot()
                self._fill(slot, nbytes)
                return slot
            MPI.Request.Waitany([slot.acknowledged for slot in self.slots])

    def _is_free(self, slot):
        if slot.acknowledged is not None and slot.acknowledged.Test():
            slot.acknowledged = None
            if slot.retired is not None:  # (the peer took the new handle, and let go of the old memory)
                self.memory.free(slot.retired)
                slot.retired = None
        return slot.acknowledged is None

    def _new_slot(self):
        slot = _Slot(len(self.slots))
        self.slots.append(slot)
        return slot

    def _fill(self, slot, nbytes):
        """Give ``slot`` (free) device memory of ``nbytes`` at least, exported anew.  Its old memory is freed
        once the message with the new handle is acknowledged: the peer maps the old until then."""
        # (retired holds nothing here: a slot is free once acknowledged, which freed its retired memory)
        if slot.memory is not None:
            slot.retired, slot.memory = slot.memory, None
        capacity = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        slot.memory, handle = self.memory.alloc(capacity)
        if len(handle) != HANDLE_BYTES:
            raise RuntimeError(f"an IPC handle of {len(handle)} bytes, not {HANDLE_BYTES}")
        slot.capacity, slot.handle, slot.fresh = capacity, bytes(handle), True

    def _acknowledge(self, index):
        """Tell the peer its slot ``index`` is free again (drop the acknowledgements already delivered)."""
        self.acks_sent = [request for request in self.acks_sent if not request.Test()]
        request, _ = mpi.isend(self.acks, np.full(1, index, np.int64), self.peer, index)
        self.acks_sent.append(request)


def probe(acks, peers, memory):
    """Collective over ``acks``' ranks: None where every rank can map the device memory of each of its
    ``peers`` (ranks of ``acks``) by a handle, else why not, the same on every rank.

    Made once at start-up, before any link is used: IPC can be refused where
    the facts allow it (each rank sees only its own GPU, two GPUs without a
    path between them, a container without shared IPC), and a refusal found
    at the first receive would end the run in its middle, the sender left
    waiting.  Each pair exports a granule each way, maps and unmaps the
    other's, then frees its own once the other has let go.
    """
    problem = None
    for peer in sorted(peers):  # (in rank order: a pipe's pairs meet one after the other)
        try:
            mine, handle = memory.alloc(GRANULE)
        except Exception as err:  # (any failure of the device's means "not here")
            mine, handle = None, bytes(HANDLE_BYTES)
            problem = problem or f"device memory to export could not be had ({type(err).__name__}: {err})"
        theirs = np.zeros(HANDLE_BYTES, np.uint8)
        mpi.sendrecv(acks, np.frombuffer(handle, np.uint8).copy(), peer, theirs, peer, PROBING)
        try:
            memory.close(memory.open(theirs.tobytes()))
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
            problem = problem or f"rank {peer}'s device memory could not be mapped ({why})"
        mpi.sendrecv(acks, np.zeros(1, np.int64), peer, np.zeros(1, np.int64), peer, PROBING)
        if mine is not None:
            memory.free(mine)
    refused = np.array([0.0 if problem is None else 1.0])
    mpi.allreduce_max(acks, refused)
    if not refused[0]:
        return None
    return problem or "two other stages could not map each other's device memory"
