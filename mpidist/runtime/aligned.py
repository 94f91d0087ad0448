"""Host arrays that start on a cache line (or a page).

numpy places an array where ``malloc`` does: 16 bytes past a page for a
buffer large enough to be ``mmap``-ed (glibc's chunk header), anywhere 16
bytes apart otherwise.  Off a 32-byte boundary, every other AVX2 load splits
a cache line: on the development machine (AMD EPYC, one thread), the squared
norm of mlp-wide's gradient (670 K floats) took 42 us at 16 bytes past a
cache line against 29 at one, SGD's ``v *= momentum`` 8.2 against 6.2 us a
block.  So the arrays a training step streams through (the flat parameters
and gradients, the optimizer's state and scratch, the workspace) are made
here, 64-byte aligned, as PyTorch aligns its CPU tensors.  A device's (cupy)
allocations are aligned already and pass straight through.  A checkpoint
written around the page cache stages its arrays on a page
(:mod:`mpidist.store.bulk`: ``alignment=PAGE``).
"""

import math

import numpy as np

#: bytes every array made here starts at a multiple of: a cache line (the shared-memory exchanges' parts
#: start on one too, :data:`mpidist.parallel.shards.LINE`)
ALIGNMENT = 64


def empty(xp, shape, dtype, alignment=ALIGNMENT):
    """``xp.empty(shape, dtype)``, starting on a multiple of ``alignment`` bytes on the host."""
    return _aligned(xp, shape, dtype, np.empty, alignment)


def zeros(xp, shape, dtype):
    """``xp.zeros(shape, dtype)``, starting on a cache line on the host (its pages untouched until written,
    as numpy's own)."""
    return _aligned(xp, shape, dtype, np.zeros, ALIGNMENT)


def full(xp, shape, fill, dtype):
    """``xp.full(shape, fill, dtype)``, starting on a cache line on the host."""
    array = empty(xp, shape, dtype)
    array[...] = fill
    return array


def _aligned(xp, shape, dtype, make, alignment):
    if xp is not np:
        return getattr(xp, make.__name__)(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    if min(shape, default=0) < 0:
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = make(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)
