"""Max pooling's compiled kernels (numba): one pass over the input forward, one over its gradient backward.

Arrays come as ``(N, H, W, C)`` views whatever their memory order (a 1-D
pool's as ``(N, 1, L, C)``); the channel loop is innermost, so the
channels-last activations of a convolution are walked in memory order.  The
comparisons are numpy's path's (:class:`mpidist.nn.pooling._MaxPool`):
offsets in row-major order, a later value wins only when strictly greater,
and a NaN anywhere in a window makes its maximum NaN without moving its
argmax; backward multiplies ``dy`` by 1 or 0, so a NaN or infinite ``dy``
spreads as numpy's product spreads it.  Each memory order and dtype compiles
once (about half a second each).
"""

from numba import njit


def _compiled(function):
    """``function`` compiled by numba and kept in its cache; compiled afresh in every process where numba
    finds nowhere to keep it (it refuses ``cache=True`` with a RuntimeError)."""
    try:
        return njit(cache=True, nogil=True)(function)
    except RuntimeError:
        return njit(nogil=True)(function)


@_compiled
def max_pool_forward(x, kh, kw, y, argmax):
    """``y`` and ``argmax`` (``(N, Ho, Wo, C)``): each ``kh x kw`` window's maximum and the offset it came
    from (``a * kw + b``)."""
    n_count, rows, cols, channels = y.shape
    for n in range(n_count):
        for i in range(rows):
            for j in range(cols):
                for c in range(channels):
                    y[n, i, j, c] = x[n, i * kh, j * kw, c]
                    argmax[n, i, j, c] = 0
                for a in range(kh):
                    for b in range(kw):
                        if a == 0 and b == 0:
                            continue
                        offset = a * kw + b
                        for c in range(channels):
                            value, best = x[n, i * kh + a, j * kw + b, c], y[n, i, j, c]
                            if value > best:
                                argmax[n, i, j, c] = offset
                            # np.maximum's value: the later of equals (-0.0 and 0.0 as numpy on x86 has
                            # them), a NaN where either is one, the first NaN kept
                            if best == best and not value < best:
                                y[n, i, j, c] = value


@_compiled
def max_pool_backward(dy, argmax, kh, kw, dx):
    """``dx`` over every whole window: ``dy`` at each window's argmax, ``dy * 0`` elsewhere."""
    n_count, rows, cols, channels = dy.shape
    for n in range(n_count):
        for i in range(rows):
            for a in range(kh):
                for j in range(cols):
                    for b in range(kw):
                        offset = a * kw + b
                        for c in range(channels):
                            dx[n, i * kh + a, j * kw + b, c] = dy[n, i, j, c] * (argmax[n, i, j, c] == offset)
