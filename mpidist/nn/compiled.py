"""Compiled kernels (numba, the ``jit`` extra) for the layers whose numpy form is many short passes.

numpy computes a max pool over channels-last activations in ``k*k`` passes
per direction, each a ufunc over strided views whose contiguous runs are one
pixel's channels (16 values in the cnn's first pool): the overhead per run,
not the arithmetic, is their time.  One compiled loop reads each input once
and writes each output once instead (docs/performance.rst has the figures).

The kernels give the numpy path's results exactly (the same comparisons in
the same order, so the same winners, ties and NaNs); tests/test_compiled.py
holds them to that.  The numpy path stays the default where numba is
missing, on GPUs (cupy arrays), and where ``MPIDIST_JIT=0`` is set (to rule
the kernels out, or to skip their compilation: about a second, once where
numba can cache it beside this module, else in every process).
"""

import functools
import os

import numpy as np


def kernels(xp):
    """The compiled kernels' module for arrays of ``xp``, or None: cupy, no numba, or ``MPIDIST_JIT=0``."""
    if xp is not np or os.environ.get("MPIDIST_JIT", "1") == "0":
        return None
    return _loaded()


@functools.cache
def _loaded():
    try:  # (numba is imported on the first use of a kernel, never by importing mpidist)
        from . import compiled_pooling
    except ImportError:  # numba missing, or one that does not support this numpy
        return None
    return compiled_pooling


def version():
    """``numba X.Y.Z`` where the kernels are in use on the host, else why not (for bench's header)."""
    if os.environ.get("MPIDIST_JIT", "1") == "0":
        return "off (MPIDIST_JIT=0)"
    if _loaded() is None:
        return "none (pip install 'mpidist[jit]' adds them)"
    import numba

    return f"numba {numba.__version__}"
