"""Sums over the GPUs of an MPI communicator's ranks by NCCL, bootstrapped over MPI.

MPI without CUDA support sums device arrays by staging them through host
memory (3.3-6 GB/s on an H200); NCCL sums them where they are, over NVLink
or the network, on a stream of its own.  :func:`nccl_group` makes a
:class:`NcclSum` over ``comm`` where every rank can take part (collective,
the same answer everywhere), or says why not: host arrays, no NCCL, a type
NCCL does not sum, two ranks of a node on one GPU (NCCL needs a GPU per
rank), MPI with fault tolerance on (a lost worker must surface as MPI's
error), ``MPIDIST_NCCL=0``, or rank 0 could not make NCCL's unique id.  The
ranks agree on that before any of them calls NCCL's initialisation, which
waits for every rank of the group: a rank that could not join would leave
the others waiting there.  (A rank whose initialisation fails once all
have entered it ends the job: the others wait in NCCL, where no MPI error
reaches them.)

MPI carries NCCL's unique id once (128 bytes, rank 0's, broadcast) and the
facts each rank checks; the sums themselves never touch MPI.
:class:`NcclSum` orders its stream after the caller's: :meth:`NcclSum.sum`
starts once the caller's stream has written the array, and after
:meth:`NcclSum.join` the caller's stream reads the sums.  Needs several
GPUs: on the development machine its tests reach it through a stand-in
that sums over MPI (``tests/test_nccl_sum.py``).
"""

import hashlib

import numpy as np
from mpi4py import MPI

from . import comm as mpi
from .ulfm import ulfm_support
from .xp import turned_off

#: NCCL's name of each type it sums (bfloat16 where the library has it)
TYPES = {
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16",
}

#: the bytes of NCCL's unique id
ID_BYTES = 128


class NcclSum:
    """In-place sums of device arrays over ``comm``'s ranks, one GPU each (collective to make).

    Args:
        comm: the ranks (mpi4py communicator).
        nccl: ``cupy.cuda.nccl``.
        cupy: the cupy module.
        uid: NCCL's unique id, rank 0's (:func:`nccl_group` broadcasts it).
    """

    def __init__(self, comm, nccl, cupy, uid):
        self.nccl, self.cupy = nccl, cupy
        self.communicator = _communicator(nccl, comm.Get_size(), uid, comm.Get_rank())
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def sum(self, array):
        """Start summing ``array`` (contiguous, on this rank's GPU) in place, after what the caller's stream
        has queued."""
        written = self.cupy.cuda.get_current_stream().record()
        self.stream.wait_event(written)
        code = getattr(self.nccl, TYPES[array.dtype.name])
        ptr = array.data.ptr
        self.communicator.allReduce(ptr, ptr, array.size, code, self.nccl.NCCL_SUM, self.stream.ptr)

    def join(self):
        """The caller's stream waits for every sum started."""
        self.cupy.cuda.get_current_stream().wait_event(self.stream.record())

    def free(self):
        """Let go of NCCL's communicator (once; after the last sum)."""
        if self.communicator is not None:
            self.stream.synchronize()
            self.communicator.destroy()
            self.communicator = None


def _as_bytes(uid):
    """NCCL's unique id as its bytes (cupy 14 gives bytes; earlier versions a tuple of signed chars)."""
    if isinstance(uid, bytes):
        return uid
    return np.asarray(uid, np.int64).astype(np.int8).tobytes()


def _communicator(nccl, size, uid, rank):
    """``NcclCommunicator(size, uid, rank)``, the id in the form this cupy takes (bytes, or a tuple)."""
    try:
        return nccl.NcclCommunicator(size, uid, rank)
    except TypeError:  # (cupy before 14)
        return nccl.NcclCommunicator(size, tuple(np.frombuffer(uid, np.int8).tolist()), rank)


def nccl_group(comm, buffer):
    """Collective over ``comm``: ``(NcclSum, None)`` where every rank can sum ``buffer`` by NCCL, else
    ``(None, why)``: None on every rank alike, the reason a rank's own (or the first refusing rank's
    number)."""
    why, nccl, cupy, device = _local_facts(buffer)
    if _shares_a_gpu(comm, device if why is None else None) and why is None:  # (collective: every rank)
        why = "two ranks of a node share a GPU (NCCL needs one GPU per rank)"
    refusals = np.zeros(comm.Get_size(), np.int32)
    mpi.allgather(comm, np.array([0 if why is None else 1], np.int32), refusals)
    if refusals.any():
        first = int(np.flatnonzero(refusals)[0])
        return None, why if why is not None else f"rank {first} of the group cannot use NCCL"
    uid, why = _unique_id(comm, nccl)
    if uid is None:
        return None, why
    return NcclSum(comm, nccl, cupy, uid), None


def _shares_a_gpu(comm, device):
    """Collective over ``comm``: whether ``device`` (this rank's GPU, or None: not taking part) is another
    rank's of its node too."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ids = np.zeros((node.Get_size(), 2), np.int64)
        mine = np.array([[0, 0] if device is None else [1, device]], np.int64)
        mpi.allgather(node, mine, ids)
    finally:
        node.Free()
    taking_part = ids[ids[:, 0] == 1, 1]
    return device is not None and int(np.count_nonzero(taking_part == device)) > 1


def _unique_id(comm, nccl):
    """Collective over ``comm``: ``(rank 0's NCCL unique id, None)``, or ``(None, why)`` on every rank where
    rank 0 could not make one (NCCL's bootstrap found no network: ``NCCL_SOCKET_IFNAME``)."""
    message, why = np.zeros(1 + ID_BYTES, np.uint8), None
    if comm.Get_rank() == 0:
        try:
            message[1:] = np.frombuffer(_as_bytes(nccl.get_unique_id()), np.uint8)
            message[0] = 1
        except Exception as error:  # (a reason for every rank, never a rank left in the broadcast)
            why = f"NCCL's unique id: {type(error).__name__}: {error}"
    mpi.bcast(comm, message)
    if message[0] != 1:
        return None, why or "rank 0 could not make NCCL's unique id"
    return message[1:].tobytes(), None


def _local_facts(buffer):
    """``(why not, nccl, cupy, device id)`` on this rank (``why not`` None where it can take part)."""
    if turned_off("MPIDIST_NCCL"):
        return "MPIDIST_NCCL=0", None, None, 0
    if ulfm_support()[0]:
        return (
            "MPI runs with fault tolerance on, and a lost worker must surface as MPI's process-failure "
            "error, which NCCL's sums do not give",
            None,
            None,
            0,
        )
    if buffer is None or not hasattr(buffer, "__cuda_array_interface__"):
        return "host arrays", None, None, 0
    if buffer.dtype.name not in TYPES:
        return f"NCCL does not sum {buffer.dtype.name}", None, None, 0
    try:
        import cupy
        from cupy.cuda import nccl

        if not nccl.available or nccl.get_version() <= 0:
            return "no NCCL (pip install nvidia-nccl-cu13)", None, None, 0
        if not hasattr(nccl, TYPES[buffer.dtype.name]):
            return f"this NCCL does not sum {buffer.dtype.name}", None, None, 0
        device = _device_id(cupy)
    except Exception as error:  # (no NCCL library, no cupy: a reason, never a crash)
        return f"no NCCL ({type(error).__name__}: {error})", None, None, 0
    return None, nccl, cupy, device


def _device_id(cupy):
    """This rank's GPU as a number every process of its node computes alike (its PCI bus id, hashed)."""
    bus = cupy.cuda.Device().pci_bus_id
    return int.from_bytes(hashlib.blake2b(bus.encode(), digest_size=8).digest(), "little", signed=True)
