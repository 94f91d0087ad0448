"""Compiled kernels (numba, the ``jit`` extra) for the layers whose numpy form is many short passes.

numpy computes a max pool over channels-last activations in ``k*k`` passes
per direction, each a ufunc over strided views whose contiguous runs are one
pixel's channels (16 values in the cnn's first pool): the overhead per run,
not the arithmetic, is their time.  One compiled loop reads each input once
and writes each output once instead (docs/performance.rst has the figures).

The kernels give the numpy path's results exactly (the same comparisons in
the same order, so the same winners, ties and NaNs); tests/test_compiled.py
holds them to that.  The numpy path stays the default where numba is
missing, on GPUs (cupy arrays), where ``MPIDIST_JIT=0`` is set (to rule the
kernels out), and where numba has nowhere to keep them: they compile once, in
about a second, into a cache beside this module or else the user's
(``NUMBA_CACHE_DIR`` names another), and bench's header says why they are off.
"""

import functools
import os

import numpy as np


def kernels(xp):
    """The compiled kernels' module for arrays of ``xp``, or None: cupy, no numba, or ``MPIDIST_JIT=0``."""
    if xp is not np or os.environ.get("MPIDIST_JIT", "1") == "0":
        return None
    return _loaded()[0]


@functools.cache
def _loaded():
    """``(the kernels' module, None)``, or ``(None, why not)``: the numpy path then runs, with the same
    results."""
    try:  # (numba is imported on the first use of a kernel, never by importing mpidist)
        from . import compiled_pooling
    except ModuleNotFoundError as error:
        if error.name != "numba":
            raise
        return None, "none (pip install 'mpidist[jit]' adds them)"
    except ImportError as error:  # a numba that does not support this numpy
        return None, f"none (numba does not load: {error})"
    except RuntimeError as error:  # nowhere to cache them: neither beside this module nor in the user's cache
        return None, f"none (numba cannot keep them: {error}; NUMBA_CACHE_DIR names a writable place)"
    return compiled_pooling, None


def version():
    """``numba X.Y.Z`` where the kernels are in use on the host, else why not (for bench's header)."""
    if os.environ.get("MPIDIST_JIT", "1") == "0":
        return "off (MPIDIST_JIT=0)"
    module, why_not = _loaded()
    if module is None:
        return why_not
    import numba

    return f"numba {numba.__version__}"
