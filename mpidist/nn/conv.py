"""Convolutions on NCL signals and NCHW images, written against ``xp``.

Conv1D and Conv2D lower to one matrix product (im2col through a strided
window view, no copy until the reshape), which is what makes them fast enough
on numpy; the backward pass scatters column gradients back with one strided
add per kernel offset (k or kh * kw adds, each over the whole batch).

``padding="same"`` pads ``k - 1`` in total, ``(k - 1) // 2`` before and the
rest after (as TensorFlow does), so even kernels keep the size too; at stride
``s`` the output has ``ceil(L / s)`` positions.
"""

import functools

from . import init
from .layers import Layer, ShapeError


def _padding(kernel, padding):
    """``(before, after)`` zero padding of each spatial axis: ``"same"`` or an int for both sides."""
    if padding == "same":
        return (kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2
    return int(padding), int(padding)


def _padding_text(pads):
    """``1`` for symmetric padding, ``(1, 2)`` for the asymmetric "same" of an even kernel."""
    return pads[0] if pads[0] == pads[1] else pads


def _windows(xp, x, kernel, stride):
    """``(N, C, H, W) -> (N, Ho, Wo, C, kh, kw)`` view of every kernel window."""
    view = xp.lib.stride_tricks.sliding_window_view(x, (kernel, kernel), axis=(2, 3))
    view = view[:, :, ::stride, ::stride]
    return view.transpose(0, 2, 3, 1, 4, 5)


class Conv2D(Layer):
    """2-D convolution: ``(N, C, H, W) -> (N, F, Ho, Wo)``.

    Args:
        filters: output channels ``F``.
        kernel: kernel size ``k`` (square).
        stride: step between windows.
        padding: zero padding on each side, or ``"same"`` to keep ``H, W`` at
            stride 1 (asymmetric for even kernels: one more row/column after).
    """

    cache = ("cols", "padded_shape")

    def __init__(self, filters, kernel=3, stride=1, padding="same"):
        super().__init__()
        self.filters, self.kernel, self.stride = int(filters), int(kernel), int(stride)
        self.pads = _padding(self.kernel, padding)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ShapeError(f"Conv2D needs image samples (C, H, W), got per-sample shape {tuple(input_shape)}")
        c, h, w = (int(d) for d in input_shape)
        k, s, p = self.kernel, self.stride, sum(self.pads)
        ho, wo = (h + p - k) // s + 1, (w + p - k) // s + 1
        if ho < 1 or wo < 1:
            raise ShapeError(f"Conv2D kernel {k} does not fit images of {h}x{w} "
                             f"with padding {_padding_text(self.pads)}")
        self.in_channels, self.out_hw = c, (ho, wo)
        return (self.filters, ho, wo)

    def param_specs(self):
        fan_in = self.in_channels * self.kernel * self.kernel
        shape = (self.filters, self.in_channels, self.kernel, self.kernel)
        return [("W", shape, functools.partial(init.he_normal, fan_in=fan_in)),
                ("b", (self.filters,), init.zeros)]

    def forward(self, x, training=False):
        xp, pads = self.xp, self.pads
        if any(pads):
            x = xp.pad(x, ((0, 0), (0, 0), pads, pads))
        self.padded_shape = x.shape
        n = x.shape[0]
        ho, wo = self.out_hw
        cols = _windows(xp, x, self.kernel, self.stride)[:, :ho, :wo]
        self.cols = cols.reshape(n * ho * wo, -1)
        w = self.params["W"].reshape(self.filters, -1)
        y = self.cols @ w.T + self.params["b"]
        return y.reshape(n, ho, wo, self.filters).transpose(0, 3, 1, 2)

    def backward_params(self, dy):
        xp, n, f, ho, wo = self.xp, *dy.shape
        dy_cols = dy.transpose(0, 2, 3, 1).reshape(n * ho * wo, f)
        xp.matmul(dy_cols.T, self.cols, out=self.grads["W"].reshape(f, -1))
        xp.sum(dy_cols, axis=0, out=self.grads["b"])
        return dy_cols

    def backward(self, dy):
        xp, k, s, (before, after) = self.xp, self.kernel, self.stride, self.pads
        n, f, ho, wo = dy.shape
        dy_cols = self.backward_params(dy)
        dcols = (dy_cols @ self.params["W"].reshape(f, -1)).reshape(n, ho, wo, self.in_channels, k, k)
        dx = xp.zeros(self.padded_shape, dtype=dy.dtype)
        for i in range(k):
            for j in range(k):
                dx[:, :, i:i + s * ho:s, j:j + s * wo:s] += dcols[:, :, :, :, i, j].transpose(0, 3, 1, 2)
        h, w = self.padded_shape[2], self.padded_shape[3]
        return dx[:, :, before:h - after, before:w - after]

    def __repr__(self):
        return (f"Conv2D({self.filters}, kernel={self.kernel}, stride={self.stride}, "
                f"padding={_padding_text(self.pads)})")


class Conv1D(Layer):
    """1-D convolution: ``(N, C, L) -> (N, F, Lo)``.

    Args:
        filters: output channels ``F``.
        kernel: kernel size ``k``.
        stride: step between windows.
        padding: zero padding on each side, or ``"same"`` to keep ``L`` at
            stride 1 (asymmetric for even kernels: one more position after).
    """

    cache = ("cols", "padded_shape")

    def __init__(self, filters, kernel=3, stride=1, padding="same"):
        super().__init__()
        self.filters, self.kernel, self.stride = int(filters), int(kernel), int(stride)
        self.pads = _padding(self.kernel, padding)

    def build(self, input_shape):
        if len(input_shape) != 2:
            raise ShapeError(f"Conv1D needs signal samples (C, L), got per-sample shape {tuple(input_shape)}")
        c, length = (int(d) for d in input_shape)
        lo = (length + sum(self.pads) - self.kernel) // self.stride + 1
        if lo < 1:
            raise ShapeError(f"Conv1D kernel {self.kernel} does not fit signals of length {length} "
                             f"with padding {_padding_text(self.pads)}")
        self.in_channels, self.out_length = c, lo
        return (self.filters, lo)

    def param_specs(self):
        fan_in = self.in_channels * self.kernel
        return [("W", (self.filters, self.in_channels, self.kernel), functools.partial(init.he_normal, fan_in=fan_in)),
                ("b", (self.filters,), init.zeros)]

    def forward(self, x, training=False):
        xp = self.xp
        if any(self.pads):
            x = xp.pad(x, ((0, 0), (0, 0), self.pads))
        self.padded_shape = x.shape
        n, lo = x.shape[0], self.out_length
        # (N, C, L - k + 1, k) window view -> (N, Lo, C, k): rows of the im2col matrix, one copy at the reshape
        windows = xp.lib.stride_tricks.sliding_window_view(x, self.kernel, axis=2)[:, :, ::self.stride][:, :, :lo]
        self.cols = windows.transpose(0, 2, 1, 3).reshape(n * lo, -1)
        y = self.cols @ self.params["W"].reshape(self.filters, -1).T + self.params["b"]
        return y.reshape(n, lo, self.filters).transpose(0, 2, 1)

    def backward_params(self, dy):
        xp, (n, f, lo) = self.xp, dy.shape
        dy_cols = dy.transpose(0, 2, 1).reshape(n * lo, f)
        xp.matmul(dy_cols.T, self.cols, out=self.grads["W"].reshape(f, -1))
        xp.sum(dy_cols, axis=0, out=self.grads["b"])
        return dy_cols

    def backward(self, dy):
        xp, k, s, (before, after) = self.xp, self.kernel, self.stride, self.pads
        n, f, lo = dy.shape
        dy_cols = self.backward_params(dy)
        dcols = (dy_cols @ self.params["W"].reshape(f, -1)).reshape(n, lo, self.in_channels, k)
        dx = xp.zeros(self.padded_shape, dtype=dy.dtype)
        for i in range(k):
            dx[:, :, i:i + s * lo:s] += dcols[:, :, :, i].transpose(0, 2, 1)
        return dx[:, :, before:self.padded_shape[2] - after]

    def __repr__(self):
        return (f"Conv1D({self.filters}, kernel={self.kernel}, stride={self.stride}, "
                f"padding={_padding_text(self.pads)})")
