"""Compiled kernels (numba, the ``jit`` extra) for the layers whose numpy form is many short passes.

numpy computes a max pool over channels-last activations in ``k*k`` passes
per direction, each a ufunc over strided views whose contiguous runs are one
pixel's channels (16 values in the cnn's first pool): the overhead per run,
not the arithmetic, is their time.  One compiled loop reads each input once
and writes each output once instead (docs/performance.rst has the figures).

The kernels give the numpy path's results (the same comparisons in the same
order: the same winners, ties and NaNs; the winners and gradients to the bit,
the maxima equal, a zero's sign as numpy's maximum keeps it on x86);
tests/test_compiled.py holds them to that.  The numpy path stays the default
where numba is missing, on GPUs (cupy arrays), for dtypes numba does not
compile, where ``MPIDIST_JIT=0`` is set (to rule the kernels out), and in a
process where a kernel failed (its compilation, or numba's cache: a full
disk, a quota).  The kernels compile once, in about a second, into numba's
cache beside this module or else the user's (``NUMBA_CACHE_DIR`` names
another; where neither can be written, in every process); bench's header
says whether they are on.
"""

import functools
import os
import warnings

import numpy as np

#: what the kernels are compiled for: numba refuses float16 and byte-swapped arrays, which numpy's path takes
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

_failed = []  # why a kernel's call failed, where one did: numpy's path from then on, in this process


def kernels(xp, *arrays):
    """The compiled kernels' module for ``arrays`` of ``xp``, or None: cupy's, a dtype they are not compiled
    for, no numba, ``MPIDIST_JIT=0``, or a kernel that failed in this process."""
    if xp is not np or any(array.dtype not in DTYPES for array in arrays) or _why_off():
        return None
    return _loaded()[0]


def _why_off():
    """Why the kernels are off for every array (bench's words), or None where they are on."""
    if os.environ.get("MPIDIST_JIT", "1") == "0":
        return "off (MPIDIST_JIT=0)"
    if _failed:
        return f"none ({_failed[0]})"
    return _loaded()[1]


def ran(kernel, *args):
    """``kernel(*args)``; False where it raised, and the kernels off in this process from then on, with a
    warning.

    A kernel's first call compiles it, or loads it from numba's cache, and
    either can fail where importing numba did not (a full disk, a quota):
    numpy's path then computes the same, so a run goes on.
    """
    try:
        kernel(*args)
    except Exception as error:  # (whatever numba raises: the numpy path is the answer to all of it)
        _failed.append(f"{type(error).__name__}: {error}")
        warnings.warn(f"mpidist: compiled kernels off, numpy's path instead ({_failed[0]})", stacklevel=2)
        return False
    return True


@functools.cache
def _loaded():
    """``(the kernels' module, None)``, or ``(None, why not)``: the numpy path then runs, with the same
    results."""
    try:  # (numba is imported on the first use of a kernel, never by importing mpidist)
        from . import compiled_pooling
    except (ImportError, RuntimeError) as error:  # e.g. a numba that does not support this numpy
        missing = (error.name or "") if isinstance(error, ModuleNotFoundError) else ""
        if missing.startswith("mpidist"):
            raise
        if missing == "numba":
            return None, "none (pip install 'mpidist[jit]' adds them)"
        return None, f"none (numba does not load: {error})"
    return compiled_pooling, None


def version():
    """``numba X.Y.Z`` where the kernels are on for numpy's arrays, else why not (for bench's header)."""
    why_off = _why_off()
    if why_off:
        return why_off
    import numba

    return f"numba {numba.__version__}"
