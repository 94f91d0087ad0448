"""Pooling on NCL signals and NCHW images, written against ``xp``.

Windows do not overlap: a ``k``-pool cuts each spatial axis into whole blocks
of ``k`` and drops the remainder (``L // k`` outputs), so one reshape turns the
input into ``(N, C, *out, k**d)`` blocks and both passes are plain reductions
and broadcasts, with no Python loop over positions.
"""

from . import compiled, pool_kernels
from .layers import Layer, ShapeError
from .workspace import inverse, memory_order


def _blocks(x, k, dims):
    """``(N, C, *spatial) -> (N, C, *spatial // k, k**dims)``: each window's values on the last axis."""
    n, c, *spatial = x.shape
    out = [size // k for size in spatial]
    x = x[(slice(None), slice(None)) + tuple(slice(0, o * k) for o in out)]
    split = x.reshape([n, c] + [d for o in out for d in (o, k)])  # N, C, o1, k, o2, k
    order = [0, 1] + [2 + 2 * i for i in range(dims)] + [3 + 2 * i for i in range(dims)]
    return split.transpose(order).reshape([n, c] + out + [k**dims])


def _unblocks(xp, blocks, k, dims, input_shape):
    """Inverse of :func:`_blocks` into zeros of ``input_shape`` (the cropped remainder gets no gradient)."""
    n, c, *out = blocks.shape[:-1]
    split = blocks.reshape([n, c] + out + [k] * dims)
    order = [0, 1] + [d for i in range(dims) for d in (2 + i, 2 + dims + i)]
    dx = xp.zeros((n,) + tuple(input_shape), dtype=blocks.dtype)
    dx[(slice(None), slice(None)) + tuple(slice(0, o * k) for o in out)] = split.transpose(order).reshape(
        [n, c] + [o * k for o in out]
    )
    return dx


class _Pool(Layer):
    """Shared shape checks of the ``dims``-dimensional ``k``-pools."""

    dims = 2

    def __init__(self, size=2):
        super().__init__()
        self.size = int(size)

    def build(self, input_shape):
        what = "signal samples (C, L)" if self.dims == 1 else "image samples (C, H, W)"
        if len(input_shape) != self.dims + 1:
            raise ShapeError(f"{type(self).__name__} needs {what}, got per-sample shape {tuple(input_shape)}")
        c, *spatial = (int(d) for d in input_shape)
        if min(spatial) < self.size:
            size = "x".join(str(d) for d in spatial)
            raise ShapeError(f"{self!r} does not fit {what.split()[0]}s of {size}")
        self.input_shape = (c, *spatial)
        return (c, *(d // self.size for d in spatial))

    def __repr__(self):
        return f"{type(self).__name__}({self.size})"


class _MaxPool(_Pool):
    """Ties send the gradient to the first maximum only, so gradients match finite differences.

    Both passes walk the ``k**dims`` offsets of a window, each a strided view
    of the whole batch (no copy into blocks, no loop over positions): forward
    keeps a running maximum and the offset it came from, backward writes
    ``dy`` into the input gradient at each window's winning offset.  Where
    numba is installed (the ``jit`` extra), compiled kernels
    (:mod:`mpidist.nn.compiled`) do each pass in one loop, with the same
    results; on a GPU, one cupy kernel each (:mod:`mpidist.nn.pool_kernels`).
    """

    cache = ("argmax", "input_order")
    hands_over = True

    def _offsets(self, x):
        """``(offset index, strided view of x at that window offset)`` for every offset, in row-major
        order."""
        k, out = self.size, [d // self.size for d in self.input_shape[1:]]
        grid = [()]
        for _ in range(self.dims):
            grid = [g + (i,) for g in grid for i in range(k)]
        for index, offset in enumerate(grid):
            yield (
                index,
                x[(slice(None), slice(None)) + tuple(slice(i, o * k, k) for i, o in zip(offset, out))],
            )

    def _channels_last(self, array):
        """``array`` (``(N, C, *spatial)``) as the ``(N, H, W, C)`` view the compiled kernels take (a 1-D
        pool's as ``(N, 1, L, C)``)."""
        return (array[:, :, None, :] if self.dims == 1 else array).transpose(0, 2, 3, 1)

    def _image(self, array):
        """``array`` (``(N, C, *spatial)``) as ``(N, C, H, W)``: a 1-D pool's as an image of one row."""
        return array[:, :, None, :] if self.dims == 1 else array

    @property
    def _window(self):
        """``(kh, kw)``: a 1-D pool's window is one row."""
        return (1, self.size) if self.dims == 1 else (self.size, self.size)

    def forward(self, x, training=False):
        xp = self.xp
        views = self._offsets(x)
        _, first = next(views)
        self.input_order = memory_order(x)  # the input gradient is made in the same order
        best = self.scratch_like("y", first)
        index_type = xp.uint8 if self.size**self.dims < 256 else xp.int64
        self.argmax = self.scratch_like("argmax", first, index_type)
        if pool_kernels.usable(xp, x) and pool_kernels.forward(
            xp, self._image(x), *self._window, self._image(best), self._image(self.argmax)
        ):
            return best
        kernels, last = compiled.kernels(xp, x), self._channels_last
        if kernels and compiled.ran(
            kernels.max_pool_forward, last(x), *self._window, last(best), last(self.argmax)
        ):
            return best
        best[...] = first
        self.argmax[...] = 0
        higher = self.scratch_like("higher", first, bool)
        candidate = self.scratch_like("candidate", first, index_type)
        for index, view in views:
            xp.greater(view, best, out=higher)  # strictly: an equal value later in the window does not win
            # argmax = index where higher: offsets come in increasing order, so the maximum with ``higher *
            # index`` sets it (a masked copyto was 7x slower on these short runs); the scalar has the array's
            # own type, as cupy before 13.3 refuses a Python int here under NumPy 2
            xp.multiply(higher, index_type(index), out=candidate)
            xp.maximum(self.argmax, candidate, out=self.argmax)
            xp.maximum(best, view, out=best)
        return best

    def backward(self, dy):
        xp, order = self.xp, self.input_order
        shape = (dy.shape[0],) + tuple(self.input_shape)
        dx = self.scratch("dx", tuple(shape[axis] for axis in order), dy.dtype).transpose(inverse(order))
        if pool_kernels.usable(xp, dy) and pool_kernels.backward(
            xp, self._image(dy), self._image(self.argmax), *self._window, self._image(dx)
        ):
            return dx  # (the kernel writes the cropped remainder's zeros too)
        if any(d % self.size for d in self.input_shape[1:]):
            dx[...] = 0  # the cropped remainder gets no gradient
        kernels, last = compiled.kernels(xp, dy), self._channels_last
        if kernels and compiled.ran(
            kernels.max_pool_backward, last(dy), last(self.argmax), *self._window, last(dx)
        ):
            return dx
        won = self.scratch_like("won", dy, bool)
        for index, view in self._offsets(dx):
            xp.multiply(dy, xp.equal(self.argmax, index, out=won), out=view)
        return dx


class _AvgPool(_Pool):
    """Each output is its window's mean; the gradient spreads evenly over the window."""

    def forward(self, x, training=False):
        return _blocks(x, self.size, self.dims).mean(axis=-1)

    def backward(self, dy):
        window = self.size**self.dims
        blocks = self.xp.broadcast_to((dy / window)[..., None], dy.shape + (window,))
        return _unblocks(self.xp, blocks, self.size, self.dims, self.input_shape)


class MaxPool1D(_MaxPool):
    """Non-overlapping max pooling: ``(N, C, L) -> (N, C, L//k)``; positions past the last whole window are
    dropped."""

    dims = 1


class MaxPool2D(_MaxPool):
    """Non-overlapping max pooling: ``(N, C, H, W) -> (N, C, H//k, W//k)``.

    Rows and columns past the last whole window are dropped; ties send the
    gradient to the first maximum only, so gradients match finite differences.
    """

    dims = 2


class AvgPool1D(_AvgPool):
    """Non-overlapping mean pooling: ``(N, C, L) -> (N, C, L//k)``; positions past the last whole window are
    dropped."""

    dims = 1


class AvgPool2D(_AvgPool):
    """Non-overlapping mean pooling: ``(N, C, H, W) -> (N, C, H//k, W//k)``; the remainder is dropped."""

    dims = 2


class GlobalAvgPool(Layer):
    """Mean over every spatial axis: ``(N, C, *spatial) -> (N, C)`` (signals, images, volumes)."""

    def build(self, input_shape):
        if len(input_shape) < 2:
            raise ShapeError(
                f"GlobalAvgPool needs samples (C, *spatial), got per-sample shape {tuple(input_shape)}"
            )
        self.input_shape = tuple(int(d) for d in input_shape)
        self.count = 1
        for d in self.input_shape[1:]:
            self.count *= d
        return self.input_shape[:1]

    def forward(self, x, training=False):
        return x.reshape(x.shape[0], x.shape[1], -1).mean(axis=-1)

    def backward(self, dy):
        n, c = dy.shape
        dx = self.xp.empty((n,) + self.input_shape, dtype=dy.dtype)
        dx[...] = (dy / self.count).reshape((n, c) + (1,) * (len(self.input_shape) - 1))
        return dx
