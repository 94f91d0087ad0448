"""bfloat16 as MPI sees it: bit patterns (``uint16``), rounded and widened here, summed by an operation of
mpidist's own.

MPI has no bfloat16 type (and mpi4py cannot describe ``ml_dtypes.bfloat16``
buffers), so a bfloat16 array travels as its ``uint16`` bit patterns and is
summed by :func:`sum_op`: both operands widened exactly to float32, added, the
sum rounded to nearest even.  ``--compress bf16`` and ``--precision bf16``
exchanges share these.
"""

import numpy as np
from mpi4py import MPI


def to_bf16(values, out, scratch=None):
    """float32 ``values`` rounded to nearest even bfloat16, as their ``uint16`` bit patterns in ``out``.

    ``scratch``: a ``uint32`` array of the same size for the intermediate (else
    one is made).  Every NaN becomes the quiet NaN: rounding a NaN whose high
    half is ``0x7FFF`` would carry into the sign bit and send it as a zero.
    """
    bits = values.view(np.uint32)
    rounding = np.right_shift(bits, 16, out=scratch)
    rounding &= 1
    rounding += 0x7FFF
    rounding += bits
    rounding >>= 16
    out[...] = rounding
    # (the intermediate is spent: its first bytes hold the NaN mask)
    np.copyto(out, np.uint16(0x7FC0), where=np.isnan(values, out=rounding.view(bool)[: values.size]))
    return out


def from_bf16(patterns, out):
    """bfloat16 bit patterns (``uint16``) widened exactly into float32 ``out``."""
    wide = out.view(np.uint32)
    wide[...] = patterns
    wide <<= 16
    return out


def is_bfloat16(array):
    """Whether ``array`` holds bfloat16 (``ml_dtypes``'), which MPI cannot describe."""
    dtype = getattr(array, "dtype", None)  # (an object that only exposes the buffer protocol has none)
    return dtype is not None and np.dtype(dtype).name == "bfloat16"


class _Sum:
    """The bfloat16 sum over bit patterns, with working arrays kept between calls (grown to the largest
    seen)."""

    def __init__(self):
        self.op = MPI.OP_NULL
        self._work = np.empty((3, 0), np.float32)

    def __call__(self, incoming, inout, datatype):
        a = np.frombuffer(incoming, dtype=np.uint16)
        b = np.frombuffer(inout, dtype=np.uint16)
        if self._work.shape[1] < a.size:
            self._work = np.empty((3, a.size), np.float32)
        wide_a, wide_b, scratch = (row[: a.size] for row in self._work)
        from_bf16(a, wide_a)
        from_bf16(b, wide_b)
        wide_b += wide_a
        to_bf16(wide_b, b, scratch.view(np.uint32))


_SUM = _Sum()


def sum_op():
    """The MPI operation that sums bfloat16 bit patterns (``uint16`` buffers), made on first use."""
    if _SUM.op == MPI.OP_NULL:
        _SUM.op = MPI.Op.Create(_SUM, commute=True)
    return _SUM.op
