"""The only place that hands array buffers to MPI.

numpy arrays go to MPI as they are.  cupy arrays go directly when the MPI
library is CUDA-aware, after synchronising the stream that produced them (MPI
reads device memory outside cupy's stream order); otherwise they are staged
through host memory.  The path is decided once per process
(:func:`cuda_aware`) and shown by ``python -m mpidist info``.  Every call here
is buffer-based: no pickle ever touches array data.
"""

import ctypes
import functools
import os

import numpy as np
from mpi4py import MPI

from .xp import is_device_array


def mpi_library_path():
    """Path of the MPI shared library this process loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libmpi" in path and ".so" in path:
                    return path
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)
def cuda_aware():
    """Whether MPI can read and write CUDA device memory.

    ``MPIDIST_CUDA_AWARE=1`` or ``=0`` overrides the detection, which asks
    the library through ``MPIX_Query_cuda_support`` (Open MPI, MPICH >= 4).
    """
    override = os.environ.get("MPIDIST_CUDA_AWARE", "").strip().lower()
    if override in ("1", "true", "yes"):
        return True
    if override in ("0", "false", "no"):
        return False
    path = mpi_library_path()
    if path is None:
        return False
    try:
        return bool(ctypes.CDLL(path).MPIX_Query_cuda_support())
    except (OSError, AttributeError):
        return False


def transfer_path():
    """How device arrays travel: "cuda-aware", or "host-staged"."""
    return "cuda-aware" if cuda_aware() else "host-staged"


def _synchronize(array):
    import cupy
    cupy.cuda.get_current_stream().synchronize()
    return array


def allreduce_sum(comm, array):
    """Sum ``array`` (contiguous) over ``comm`` in place."""
    if not is_device_array(array):
        comm.Allreduce(MPI.IN_PLACE, array)
    elif cuda_aware():
        comm.Allreduce(MPI.IN_PLACE, _synchronize(array))
    else:
        host = array.get()
        comm.Allreduce(MPI.IN_PLACE, host)
        array.set(host)
    return array


def bcast(comm, array, root=0):
    """Broadcast ``array`` (contiguous) from ``root`` in place."""
    if not is_device_array(array):
        comm.Bcast(array, root=root)
    elif cuda_aware():
        comm.Bcast(_synchronize(array), root=root)
    else:
        host = array.get()
        comm.Bcast(host, root=root)
        array.set(host)
    return array


def sum_float64(comm, values):
    """Sum a few host scalars over ``comm`` (metrics, evaluation counts)."""
    buffer = np.asarray(values, dtype=np.float64).copy()
    if comm is not None:
        comm.Allreduce(MPI.IN_PLACE, buffer)
    return buffer
