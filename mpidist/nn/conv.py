"""Convolution and pooling on NCHW images, written against ``xp``.

Conv2D lowers to one matrix product (im2col through a strided window view, no
copy until the reshape), which is what makes it fast enough on numpy; the
backward pass scatters column gradients back with one strided add per kernel
offset (kh * kw adds, each over the whole batch).
"""

import functools

from . import init
from .layers import Layer, ShapeError


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
        padding: zero padding on each side; ``"same"`` keeps ``H, W`` at stride 1.
    """

    cache = ("cols", "padded_shape")

    def __init__(self, filters, kernel=3, stride=1, padding="same"):
        super().__init__()
        self.filters, self.kernel, self.stride = int(filters), int(kernel), int(stride)
        self.padding = (self.kernel - 1) // 2 if padding == "same" else int(padding)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ShapeError(f"Conv2D needs image samples (C, H, W), got per-sample shape {tuple(input_shape)}")
        c, h, w = (int(d) for d in input_shape)
        k, s, p = self.kernel, self.stride, self.padding
        ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        if ho < 1 or wo < 1:
            raise ShapeError(f"Conv2D kernel {k} does not fit images of {h}x{w} with padding {p}")
        self.in_channels, self.out_hw = c, (ho, wo)
        return (self.filters, ho, wo)

    def param_specs(self):
        fan_in = self.in_channels * self.kernel * self.kernel
        shape = (self.filters, self.in_channels, self.kernel, self.kernel)
        return [("W", shape, functools.partial(init.he_normal, fan_in=fan_in)),
                ("b", (self.filters,), init.zeros)]

    def forward(self, x, training=False):
        xp, p = self.xp, self.padding
        if p:
            x = xp.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
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
        xp, k, s, p = self.xp, self.kernel, self.stride, self.padding
        n, f, ho, wo = dy.shape
        dy_cols = self.backward_params(dy)
        dcols = (dy_cols @ self.params["W"].reshape(f, -1)).reshape(n, ho, wo, self.in_channels, k, k)
        dx = xp.zeros(self.padded_shape, dtype=dy.dtype)
        for i in range(k):
            for j in range(k):
                dx[:, :, i:i + s * ho:s, j:j + s * wo:s] += dcols[:, :, :, :, i, j].transpose(0, 3, 1, 2)
        h, w = self.padded_shape[2], self.padded_shape[3]
        return dx[:, :, p:h - p, p:w - p] if p else dx

    def __repr__(self):
        return f"Conv2D({self.filters}, kernel={self.kernel}, stride={self.stride}, padding={self.padding})"


class MaxPool2D(Layer):
    """Non-overlapping max pooling: ``(N, C, H, W) -> (N, C, H//k, W//k)``.

    Rows and columns past the last whole window are dropped; ties send the
    gradient to the first maximum only, so gradients match finite differences.
    """

    cache = ("argmax",)

    def __init__(self, size=2):
        super().__init__()
        self.size = int(size)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ShapeError(f"MaxPool2D needs image samples (C, H, W), got per-sample shape {tuple(input_shape)}")
        c, h, w = (int(d) for d in input_shape)
        if h < self.size or w < self.size:
            raise ShapeError(f"MaxPool2D({self.size}) does not fit images of {h}x{w}")
        self.input_shape = (c, h, w)
        return (c, h // self.size, w // self.size)

    def forward(self, x, training=False):
        k = self.size
        n, c, h, w = x.shape
        ho, wo = h // k, w // k
        blocks = x[:, :, :ho * k, :wo * k].reshape(n, c, ho, k, wo, k)
        blocks = blocks.transpose(0, 1, 2, 4, 3, 5).reshape(n, c, ho, wo, k * k)
        self.argmax = blocks.argmax(axis=-1)
        return self.xp.take_along_axis(blocks, self.argmax[..., None], axis=-1)[..., 0]

    def backward(self, dy):
        xp, k = self.xp, self.size
        n, c, ho, wo = dy.shape
        # one-hot of the winning position times dy: portable to cupy (no put_along_axis)
        blocks = (xp.arange(k * k) == self.argmax[..., None]) * dy[..., None]
        blocks = blocks.reshape(n, c, ho, wo, k, k).transpose(0, 1, 2, 4, 3, 5).reshape(n, c, ho * k, wo * k)
        dx = xp.zeros((n,) + self.input_shape, dtype=dy.dtype)
        dx[:, :, :ho * k, :wo * k] = blocks
        return dx

    def __repr__(self):
        return f"MaxPool2D({self.size})"
