"""The only place that hands array buffers to MPI.

Every call here is buffer-based: no pickle ever touches array data.  A
device (cupy) array reaches MPI directly when the library is CUDA-aware, else
through pinned host memory: :mod:`~mpidist.runtime.device_buffers` decides
which (:func:`cuda_aware`, re-exported here) and makes the buffer these calls
hand over.
"""

import os
import threading

import numpy as np
from mpi4py import MPI

from . import bfloat16
from .device_buffers import for_mpi

# (re-exported: users, gpu/bench.py and the tests ask this module which path device arrays take)
from .device_buffers import cuda_aware as cuda_aware, mpi_library_path as mpi_library_path
from .device_buffers import transfer_path as transfer_path


class InFlight:
    """The non-blocking operations started here that may not have completed, each with its buffer.

    A buffer must outlive its operation (MPI reads or writes it until then),
    and mpi4py lets go of a buffer with the last reference to its request,
    completed or not.  That only matters after a lost rank: on a revoked
    communicator an operation in flight may never complete (measured under
    Open MPI's ULFM: an ``Iallreduce`` over 4 ranks, one killed, was still
    active on 2 of the 3 survivors after their shrink), and the objects that
    started it are dropped as the survivors build the loop again: a round of
    it whose data had arrived could still be applied at MPI's next progress,
    into freed memory (the MPI standard leaves that undefined).  So
    :func:`keep_in_flight` keeps every such operation for the rest of the
    process.  Completed ones are dropped as more are started, once the list
    has doubled since the last pass (a few entries per step, amortised; never
    a copy of a buffer).
    """

    FIRST_PASS = 64  # entries before the first pass that drops the completed ones

    def __init__(self):
        self.started, self.kept = [], []
        self.next_pass = self.FIRST_PASS
        self.lock = threading.Lock()  # (the stall monitor's thread starts sends too)

    def track(self, request, buffer):
        """Note ``request`` (an mpi4py request) and the ``buffer`` it uses; returns the request."""
        with self.lock:
            if len(self.started) >= self.next_pass:
                self.started = self._not_completed()
                self.next_pass = max(self.FIRST_PASS, 2 * len(self.started))
            self.started.append((request, buffer))
        return request

    def keep(self):
        """Keep every operation not yet completed, and its buffer, until the process ends; returns their
        count."""
        with self.lock:
            pending = self._not_completed()
            self.kept.extend(pending)
            self.started = []
        return len(pending)

    def _not_completed(self):
        return [item for item in self.started if item[0] != MPI.REQUEST_NULL]


_IN_FLIGHT = InFlight()


def keep_in_flight():
    """After a lost rank: the operations still in flight (and their buffers) are kept until the process ends.

    Returns how many were.  See :class:`InFlight`.
    """
    return _IN_FLIGHT.keep()


def _typed(buffer, counts, displs):
    from mpi4py.util.dtlib import from_numpy_dtype

    return [buffer, list(counts), list(displs), from_numpy_dtype(buffer.dtype)]


def _allreduce_in_place(comm, array, op):
    buffer, back = for_mpi(array, host_op=not op.is_predefined)
    comm.Allreduce(MPI.IN_PLACE, buffer, op=op)
    if back:
        back()
    return array


def allreduce_sum(comm, array):
    """Sum ``array`` (contiguous) over ``comm`` in place (a bfloat16 one as its bit patterns, summed by
    :func:`~mpidist.runtime.bfloat16.sum_op`)."""
    if bfloat16.is_bfloat16(array):
        _allreduce_in_place(comm, array.view(np.uint16), bfloat16.sum_op())
        return array
    return _allreduce_in_place(comm, array, MPI.SUM)


def iallreduce_sum(comm, array):
    """Start summing ``array`` (contiguous) over ``comm`` in place; returns a :class:`Pending` to complete.

    Device arrays on MPI without CUDA support travel through a host copy,
    copied back when the reduction completes.  A bfloat16 array is summed as
    its bit patterns (:func:`~mpidist.runtime.bfloat16.sum_op`).
    """
    if bfloat16.is_bfloat16(array):
        return iallreduce(comm, array.view(np.uint16), bfloat16.sum_op())
    buffer, back = for_mpi(array)
    return Pending(_IN_FLIGHT.track(comm.Iallreduce(MPI.IN_PLACE, buffer), buffer), buffer, back)


class Pending:
    """A started non-blocking operation: its request, the buffer MPI uses, and what completes it."""

    __slots__ = ("request", "buffer", "back")

    def __init__(self, request, buffer, back=None):
        self.request, self.buffer, self.back = request, buffer, back

    def test(self):
        """Drive MPI's progress; whether the operation has completed (then finished as :meth:`wait` would)."""
        if self.request.Test():
            self.wait()
            return True
        return False

    def wait(self):
        """Block until the operation completes; copy a host-staged result back once."""
        self.request.Wait()
        if self.back is not None:
            self.back()
            self.back = None


def yielding_wait(pending):
    """Complete ``pending`` (anything with ``test()``), yielding this rank's core between polls: ranks that
    share cores (more ranks than cores: emulated nodes) let the rank they wait for run, where MPI's own wait
    would spin on the core it needs."""
    while not pending.test():
        os.sched_yield()


def yielding_barrier(comm):
    """``comm``'s barrier, waited for as :func:`yielding_wait` waits."""
    yielding_wait(Pending(comm.Ibarrier(), None))


def bcast(comm, array, root=0):
    """Broadcast ``array`` (contiguous) from ``root`` in place."""
    buffer, back = for_mpi(array)
    comm.Bcast(buffer, root=root)
    if back:
        back()
    return array


def reduce_scatter_sum(comm, send, recv, counts):
    """Sum ``send`` over ``comm``; rank ``r`` receives the ``counts[r]`` elements at ``sum(counts[:r])``.

    Ranks with a count of 0 contribute and receive nothing (workers, for the ps).
    """
    send_buffer, _ = for_mpi(send)
    recv_buffer, back = for_mpi(recv)
    comm.Reduce_scatter(send_buffer, recv_buffer, recvcounts=list(counts), op=MPI.SUM)
    if back:
        back()
    return recv


def allgatherv_inplace(comm, array, counts, displs):
    """Every rank gets every rank's ``array[displs[r]:displs[r] + counts[r]]``, in place."""
    buffer, back = for_mpi(array)
    comm.Allgatherv(MPI.IN_PLACE, _typed(buffer, counts, displs))
    if back:
        back()
    return array


def iallgather_inplace(comm, array):
    """Start gathering, in place, every rank's block of ``array`` (``comm``'s size equal blocks, rank ``r``'s
    the ``r``-th) into every rank's; returns a :class:`Pending` to complete."""
    buffer, back = for_mpi(array)
    request = comm.Iallgather(MPI.IN_PLACE, buffer)
    return Pending(_IN_FLIGHT.track(request, buffer), buffer, back)


def ireduce_scatter_block_sum(comm, send, recv):
    """Start summing ``send`` (``comm``'s size equal blocks) over ``comm``, rank ``r`` receiving the sum of
    the ``r``-th block in ``recv``; returns a :class:`Pending` to complete (``send`` must outlive it)."""
    send_buffer, _ = for_mpi(send)
    recv_buffer, back = for_mpi(recv)
    request = comm.Ireduce_scatter_block(send_buffer, recv_buffer, op=MPI.SUM)
    return Pending(_IN_FLIGHT.track(request, (send_buffer, recv_buffer)), recv_buffer, back)


def gatherv(comm, send, recv, counts, displs, root):
    """``root`` gets every rank's ``send`` (``counts[r]`` elements) at ``displs[r]`` of ``recv``."""
    send_buffer, _ = for_mpi(send)
    if comm.Get_rank() == root:
        recv_buffer, back = for_mpi(recv)
        comm.Gatherv(send_buffer, _typed(recv_buffer, counts, displs), root=root)
        if back:
            back()
    else:
        comm.Gatherv(send_buffer, None, root=root)
    return recv


def scatterv(comm, send, recv, counts, displs, root):
    """Rank ``r`` receives ``counts[r]`` elements of ``root``'s ``send`` from ``displs[r]`` into ``recv``."""
    recv_buffer, back = for_mpi(recv)
    if comm.Get_rank() == root:
        send_buffer, _ = for_mpi(send)
        comm.Scatterv(_typed(send_buffer, counts, displs), recv_buffer, root=root)
    else:
        comm.Scatterv(None, recv_buffer, root=root)
    if back:
        back()
    return recv


def allreduce_max(comm, array):
    """Each element of ``array`` (contiguous, host) becomes its maximum over ``comm``, in place."""
    return _allreduce_in_place(comm, array, MPI.MAX)


def allreduce_min(comm, array):
    """Each element of ``array`` (contiguous, host) becomes its minimum over ``comm``, in place."""
    return _allreduce_in_place(comm, array, MPI.MIN)


def isend(comm, array, dest, tag):
    """Start sending ``array``; returns ``(request, buffer)``: keep the buffer until the request is done."""
    buffer, _ = for_mpi(array)
    return _IN_FLIGHT.track(comm.Isend(buffer, dest=dest, tag=tag), buffer), buffer


def send(comm, array, dest, tag):
    """Send ``array`` (contiguous) to ``dest`` and return when its buffer may be reused."""
    buffer, _ = for_mpi(array)
    comm.Send(buffer, dest=dest, tag=tag)


def sendrecv(comm, send_array, dest, recv_array, source, tag=0):
    """Send ``send_array`` to ``dest`` while receiving ``recv_array`` from ``source`` (host arrays,
    contiguous)."""
    comm.Sendrecv(send_array, dest=dest, sendtag=tag, recvbuf=recv_array, source=source, recvtag=tag)


def recv(comm, array, source, tag):
    """Receive into ``array`` (contiguous) from the rank ``source``.

    Always from a named rank: mpidist's protocols never receive from
    ``MPI_ANY_SOURCE``.  The standard makes such a receive as safe as a named
    one, but MPICH's UCX network module (ranks on other nodes, or every rank
    with ``MPIR_CVAR_NOLOCAL=1``) leaves a posted any-source receive unmatched
    while the message it should take waits (an mpi4py program of twenty lines
    hangs so), which hung backup workers' coordinator.  Where messages may
    come from any of several ranks, :func:`irecv` posts one receive per rank
    and :func:`wait_any` takes whichever completes.
    """
    buffer, back = for_mpi(array)
    comm.Recv(buffer, source=source, tag=tag)
    if back:
        back()
    return array


def irecv(comm, array, source, tag):
    """Start receiving into ``array`` (host, contiguous: keep it untouched until done) from the rank
    ``source``.

    Returns the request, for :func:`wait_any` or :func:`wait_all`.
    """
    return _IN_FLIGHT.track(comm.Irecv(array, source=source, tag=tag), array)


def wait_any(requests, first=0):
    """Block until one of ``requests`` (None: nothing posted there) completes; its index (None if none is
    posted).

    The requests are looked at from index ``first`` on, round the end and back:
    where several have completed, which one is taken is up to the caller
    (MPI takes the lowest index, which would always favour the same one).
    """
    count = len(requests)
    order = [(first + step) % count for step in range(count)]
    posted = [requests[index] if requests[index] is not None else MPI.REQUEST_NULL for index in order]
    found = MPI.Request.Waitany(posted) if posted else MPI.UNDEFINED
    if found == MPI.UNDEFINED:
        return None
    requests[order[found]] = None  # (MPI has freed it)
    return order[found]


def wait_all(requests):
    """Block until every request of :func:`isend` (the first item of its answer) has completed."""
    MPI.Request.Waitall(list(requests))


def allgather(comm, send, recv):
    """Every rank's ``send`` (the same size on all) into ``recv``, in rank order (host arrays)."""
    comm.Allgather(send, recv)
    return recv


def sum_float64(comm, values):
    """Sum a few scalars over ``comm`` (metrics, evaluation counts).

    Each value is taken with ``float()``: a loss computed on a GPU is a cupy
    0-d array, which ``float()`` copies to the host and numpy refuses to
    convert implicitly.
    """
    if isinstance(values, np.ndarray):
        buffer = values.astype(np.float64)  # a copy, of the same shape
    else:
        buffer = np.array([float(value) for value in values], dtype=np.float64)
    if comm is not None:
        comm.Allreduce(MPI.IN_PLACE, buffer)
    return buffer


def bcast_text(comm, text, root=0):
    """``text`` (a str on ``root``, anything elsewhere) on every rank: its length, then its UTF-8 bytes.

    A path's bytes that are not UTF-8 (lone surrogates in ``text``) travel as the bytes they stand for.
    """
    data = text.encode("utf-8", "surrogateescape") if comm.Get_rank() == root else b""
    length = np.array([len(data)], dtype=np.int64)
    comm.Bcast(length, root=root)
    buffer = (
        np.frombuffer(data, dtype=np.uint8).copy()
        if comm.Get_rank() == root
        else np.empty(int(length[0]), dtype=np.uint8)
    )
    comm.Bcast(buffer, root=root)
    return buffer.tobytes().decode("utf-8", "surrogateescape")


def iallreduce(comm, array, op, then=None):
    """Start reducing ``array`` (contiguous) over ``comm`` in place with ``op``; returns a :class:`Pending`.

    ``op`` may be one of mpidist's own (``MPI.Op.Create``: a 16-bit float sum
    over ``uint16`` bit patterns, say).  ``then`` is called once the
    reduction has completed (after a host-staged result is copied back).
    A device array is staged through the host even where MPI is CUDA-aware:
    the callback of an operation of mpidist's own reads host memory.
    """
    buffer, back = for_mpi(array, host_op=not op.is_predefined)

    def complete():
        if back is not None:
            back()
        then()

    request = _IN_FLIGHT.track(comm.Iallreduce(MPI.IN_PLACE, buffer, op=op), buffer)
    return Pending(request, buffer, back if then is None else complete)
