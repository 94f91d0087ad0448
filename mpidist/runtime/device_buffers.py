"""How an array becomes a buffer MPI may use: numpy as it is, a device (cupy) array directly or through the
host.

numpy arrays go to MPI as they are.  cupy arrays go directly when the MPI
library is CUDA-aware, after synchronising the stream that produced them (MPI
reads device memory outside cupy's stream order); otherwise they are staged
through pinned host memory.  The path is decided once per process
(:func:`cuda_aware`) and shown by ``python -m mpidist info``.  Its own module
because which path a device array takes, and the pinned memory and streams it
needs, is one concern apart from the calls that hand the buffers to MPI
(:mod:`~mpidist.runtime.comm`, which re-exports :func:`cuda_aware`,
:func:`transfer_path` and :func:`mpi_library_path`): nothing here calls MPI.
"""

import ctypes
import functools
import os

import numpy as np

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


def _staged(array):
    """``(host copy of the device array, function copying the host copy back into it)``.

    The copy is in pinned (page-locked) host memory from cupy's pool.  Measured
    on an H200 (gpu/check.sh) for 64 MiB: 50 GB/s device to pinned host against
    3 GB/s to freshly allocated pageable memory, which made a host-staged
    pipeline send 5 times slower than MPI between the same host buffers.  Both
    copies wait for the device: a copy from pinned memory is asynchronous,
    and the pool hands the block out again (``cupy.asarray`` of the next batch
    writes into it at once) as soon as the host copy is dropped.  Where pinned
    memory cannot be had, and without cupy (an array that only looks like a
    device one), the array's own ``get()`` copies into pageable memory.
    """
    memory = _pinned(array)
    if memory is None:
        host = array.get()
        return host, lambda: array.set(host)
    import cupy

    stream = cupy.cuda.get_current_stream()
    host = np.frombuffer(memory, array.dtype, array.size).reshape(array.shape)
    array.get(out=host, stream=stream)
    stream.synchronize()

    def back():
        array.set(host, stream=stream)
        stream.synchronize()

    return host, back


def _pinned(array):
    """Pinned memory from cupy's pool the size of the device ``array``, or None without cupy or where none can
    be had (page-locked memory is a limited resource)."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        return cupy.cuda.alloc_pinned_memory(array.nbytes)
    except cupy.cuda.runtime.CUDARuntimeError:
        return None


def for_mpi(array, host_op=False):
    """``(buffer MPI may use, function copying results back or None)``; ``host_op``: a reduction by an
    operation of mpidist's own, whose Python callback reads host memory only (always staged)."""
    if not is_device_array(array):
        return array, None
    if cuda_aware() and not host_op:
        return _synchronize(array), None
    return _staged(array)
