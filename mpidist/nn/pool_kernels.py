"""Max pooling on a GPU in one kernel per pass (cupy's ``ElementwiseKernel``).

The pooling layers' array form walks a window's ``k x k`` offsets, four
elementwise kernels each: on a GPU a 2x2 pool's forward was 14 kernels and
its backward 8, each a pass over memory.  Here each pass is one kernel that
reads its inputs once, in any memory order (the convolutions hand over
channels-last views): forward, one thread per output, keeps the running
maximum and the offset it came from; backward, one thread per input
element, writes ``dy`` where its offset won and 0 elsewhere (and in the
cropped remainder).

The comparisons are the array form's, in its order: strictly greater wins
(a tie goes to the first offset), and a NaN is the maximum without being
the winner (as ``maximum`` propagates it and ``greater`` never picks it);
backward multiplies ``dy`` by whether the offset won, as the array form
does (a negative gradient's losers get -0.0, a non-finite one's NaN).
1-D pools run as images of one row.  For float32, float64 and float16; any
other type, or a kernel that fails to compile or run (the reason kept in
:data:`FAILED`), takes the array form; ``tests/test_gpu.py`` checks the
kernels against it on a GPU (ties, NaNs, a cropped remainder, 1-D pools,
channels-last inputs).
"""

import functools

import numpy as np

from ..runtime.xp import capturing

#: the types the kernels are compiled for
DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))

#: why a kernel failed in this process, where one did (the array form from then on)
FAILED = []

_FORWARD = r"""
const ptrdiff_t* out = _ind.get();
ptrdiff_t at[4] = {out[0], out[1], out[2] * kh, out[3] * kw};
T best = x[at];
int won = 0;
for (int i = 0; i < kh; ++i) {
    for (int j = 0; j < kw; ++j) {
        at[2] = out[2] * kh + i;
        at[3] = out[3] * kw + j;
        T value = x[at];
        if (value > best) {
            best = value;
            won = i * kw + j;
        } else if (value != value && best == best) {
            best = value;
        }
    }
}
y = best;
arg = won;
"""

_BACKWARD = r"""
const ptrdiff_t* at = _ind.get();
ptrdiff_t ho = at[2] / kh, wo = at[3] / kw;
if (ho < outh && wo < outw) {
    ptrdiff_t o[4] = {at[0], at[1], ho, wo};
    bool won = (ptrdiff_t)arg[o] == (at[2] - ho * kh) * kw + (at[3] - wo * kw);
    dx = dy[o] * (T)(won ? 1 : 0);
} else {
    dx = (T)0;
}
"""


def usable(xp, *arrays):
    """Whether the kernels serve ``arrays``: cupy's, of a type they are compiled for, none failed."""
    return xp.__name__ != "numpy" and not FAILED and all(array.dtype in DTYPES for array in arrays)


def forward(xp, x, kh, kw, best, argmax):
    """``best`` and ``argmax`` (``(N, C, Ho, Wo)``) of the ``kh x kw`` windows of ``x`` (``(N, C, H, W)``,
    any order); False where the kernel failed (the caller takes the array form)."""
    return _ran(xp, _forward(xp), x, np.int32(kh), np.int32(kw), best, argmax)


def backward(xp, dy, argmax, kh, kw, dx):
    """``dx`` (``(N, C, H, W)``, any order) from ``dy`` and the forward's ``argmax``; False where the kernel
    failed."""
    outh, outw = np.int64(dy.shape[2]), np.int64(dy.shape[3])
    return _ran(xp, _backward(xp), dy, argmax, np.int32(kh), np.int32(kw), outh, outw, dx)


def _ran(xp, kernel, *args):
    try:
        kernel(*args)
    except Exception as error:  # (a compilation or launch error: the array form computes the same)
        if capturing(xp):  # (the capture's failure, not the kernel's: the pass runs eagerly)
            raise
        FAILED.append(f"{type(error).__name__}: {error}")
        return False
    return True


@functools.lru_cache(maxsize=None)
def _forward(xp):
    return xp.ElementwiseKernel(
        "raw T x, int32 kh, int32 kw", "T y, U arg", _FORWARD, "mpidist_max_pool_forward", reduce_dims=False
    )


@functools.lru_cache(maxsize=None)
def _backward(xp):
    return xp.ElementwiseKernel(
        "raw T dy, raw U arg, int32 kh, int32 kw, int64 outh, int64 outw",
        "T dx",
        _BACKWARD,
        "mpidist_max_pool_backward",
        reduce_dims=False,
    )
