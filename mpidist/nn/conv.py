"""Convolutions on NCL signals and NCHW images, written against ``xp``.

Both lower to one matrix product per pass (im2col), computed in channels-last
memory: the padded input, the column matrix and the gradients are ``(N, H, W,
C)`` arrays, so gathering a window and scattering its gradient back move whole
runs of channels, and the layer's ``(N, F, Ho, Wo)`` output is a transposed
view of the product, with no copy.  Per pass:

* forward: the input into a zero-bordered buffer (one copy; the borders are
  zeroed once), every window into the column matrix through a strided view
  (one copy), one GEMM, the bias added in place;
* backward: one GEMM for the weight gradient, one for the column gradient,
  and the column gradient added back into the input gradient with one
  strided add per kernel offset (``kh * kw`` adds over the whole batch, no
  loop over positions).

Every array comes from the model's workspace (:mod:`mpidist.nn.workspace`):
once warm, a training step allocates nothing.  A Conv1D is a Conv2D of height 1.

``padding="same"`` pads ``k - 1`` in total, ``(k - 1) // 2`` before and the
rest after (as TensorFlow does), so even kernels keep the size too; at stride
``s`` the output has ``ceil(L / s)`` positions.
"""

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


def _gather_windows(xp, padded, cols, stride):
    """im2col: ``cols[n, i, j, a, b, :] = padded[n, stride * i + a, stride * j + b, :]`` for ``cols`` of
    ``(N, Ho, Wo, kh, kw, C)``.

    One copy through a strided view of every window, whose innermost runs are
    ``kw * C`` values; with one channel those runs are a few values long, and
    a copy per kernel offset, running along whole rows of ``Wo`` positions,
    is 4x faster.
    """
    n, ho, wo, kh, kw, c = cols.shape
    if c > 1:
        # N, ., ., C, kh, kw
        windows = xp.lib.stride_tricks.sliding_window_view(padded, (kh, kw), axis=(1, 2))
        cols[...] = windows[:, ::stride, ::stride][:, :ho, :wo].transpose(0, 1, 2, 4, 5, 3)
        return
    for a in range(kh):
        for b in range(kw):
            cols[:, :, :, a, b, :] = padded[:, a : a + stride * ho : stride, b : b + stride * wo : stride, :]


def _column_sums(xp, rows, out, ones):
    """``rows.sum(axis=0)`` into ``out``, as a product with a vector of ones.

    NumPy sums the columns of a tall, narrow matrix one short row at a time
    (3 ms for the first convolution's bias at batch 128); BLAS does it in 0.1 ms.
    """
    ones[...] = 1
    xp.matmul(ones, rows, out=out)


class _ChannelsLastConv(Layer):
    """The 2-D convolution both layers run: ``(N, C, H, W)`` in and out, channels-last inside.

    Subclasses set ``kernel_hw``, ``stride``, ``pads_hw`` (``((top, bottom),
    (left, right))``), ``in_channels`` and ``out_hw`` in ``build``, and map
    their own shapes onto 4-D ones (:meth:`_as_images`, :meth:`_from_images`).
    """

    cache = ("cols", "padded_shape")
    hands_over = True

    def _as_images(self, x):
        return x

    def _from_images(self, y):
        return y

    def _weights(self):
        """``W`` as an ``(F, kh, kw, C)`` matrix, the order of the column matrix's rows (a small copy)."""
        f, (kh, kw), c = self.filters, self.kernel_hw, self.in_channels
        w = self.params["W"].reshape(f, c, kh, kw)
        out = self.scratch("w_hwc", (f, kh, kw, c), w.dtype)
        out[...] = w.transpose(0, 2, 3, 1)
        return out.reshape(f, -1)

    def forward(self, x, training=False):
        xp = self.xp
        x = self._as_images(x)
        n, c, h, w = x.shape
        (kh, kw), s, ((top, bottom), (left, right)) = self.kernel_hw, self.stride, self.pads_hw
        ho, wo = self.out_hw
        dtype = xp.result_type(x, self.params["W"])
        padded = self.scratch("padded", (n, h + top + bottom, w + left + right, c), dtype, zeroed=True)
        padded[:, top : top + h, left : left + w, :] = x.transpose(0, 2, 3, 1)
        self.padded_shape = padded.shape
        cols = self.scratch("cols", (n, ho, wo, kh, kw, c), dtype)
        _gather_windows(xp, padded, cols, s)
        self.cols = cols.reshape(n * ho * wo, -1)
        y = xp.matmul(self.cols, self._weights().T, out=self.scratch("y", (n * ho * wo, self.filters), dtype))
        y += self.params["b"]
        return self._from_images(y.reshape(n, ho, wo, self.filters).transpose(0, 3, 1, 2))

    def _dy_rows(self, dy):
        """``(N, F, Ho, Wo)`` gradient as the ``(N Ho Wo, F)`` matrix (a view when it is channels-last
        already)."""
        dy = self._as_images(dy)
        n, f, ho, wo = dy.shape
        return dy.transpose(0, 2, 3, 1).reshape(n * ho * wo, f)

    def backward_params(self, dy):
        xp, f, (kh, kw), c = self.xp, self.filters, self.kernel_hw, self.in_channels
        rows = self._dy_rows(dy)
        grad = xp.matmul(rows.T, self.cols, out=self.scratch("dw_hwc", (f, kh * kw * c), rows.dtype))
        self.grads["W"].reshape(f, c, kh, kw)[...] = grad.reshape(f, kh, kw, c).transpose(0, 3, 1, 2)
        _column_sums(xp, rows, self.grads["b"], self.scratch("ones", (rows.shape[0],), rows.dtype))
        return rows

    def backward(self, dy):
        rows = self.backward_params(dy)
        dx = self._input_grad_stride_1(rows) if self.stride == 1 else self._input_grad_strided(rows)
        return self._from_images(dx.transpose(0, 3, 1, 2))

    def _input_grad_stride_1(self, rows):
        """At stride 1 the input gradient is a convolution too: ``dy`` zero-padded, against the flipped
        kernel.

        One im2col of ``dy`` and one GEMM, instead of a GEMM to columns and
        ``kh * kw`` strided adds of short channel runs (measured 3x slower).
        """
        xp, (kh, kw), ((top, bottom), (left, right)) = self.xp, self.kernel_hw, self.pads_hw
        n, hp, wp, c = self.padded_shape
        (ho, wo), f = self.out_hw, self.filters
        h, w = hp - top - bottom, wp - left - right
        # dx_padded[p] = sum over (a, b) of dy_full[p + (a, b)] W[:, :, kh-1-a, kw-1-b]; dy_full has dy at
        # (kh-1, kw-1)
        full = self.scratch("dy_full", (n, ho + 2 * (kh - 1), wo + 2 * (kw - 1), f), rows.dtype, zeroed=True)
        full[:, kh - 1 : kh - 1 + ho, kw - 1 : kw - 1 + wo, :] = rows.reshape(n, ho, wo, f)
        cols = self.scratch("dy_cols", (n, h, w, kh, kw, f), rows.dtype)
        _gather_windows(xp, full[:, top:, left:], cols, 1)
        flipped = self.scratch("w_flipped", (kh, kw, f, c), rows.dtype)
        flipped[...] = self.params["W"].reshape(f, c, kh, kw)[:, :, ::-1, ::-1].transpose(2, 3, 0, 1)
        dx = xp.matmul(
            cols.reshape(n * h * w, -1),
            flipped.reshape(-1, c),
            out=self.scratch("dx", (n * h * w, c), rows.dtype),
        )
        return dx.reshape(n, h, w, c)

    def _input_grad_strided(self, rows):
        """Any stride: the column gradient, added back window offset by window offset (``kh * kw`` strided
        adds)."""
        xp, (kh, kw), s, ((top, bottom), (left, right)) = self.xp, self.kernel_hw, self.stride, self.pads_hw
        n, hp, wp, c = self.padded_shape
        ho, wo = self.out_hw
        dcols = xp.matmul(
            rows, self._weights(), out=self.scratch("dcols", (rows.shape[0], kh * kw * c), rows.dtype)
        )
        dcols = dcols.reshape(n, ho, wo, kh, kw, c)
        dx = self.scratch("dx", (n, hp, wp, c), rows.dtype)
        dx[...] = 0
        for i in range(kh):
            for j in range(kw):
                dx[:, i : i + s * ho : s, j : j + s * wo : s, :] += dcols[:, :, :, i, j, :]
        return dx[:, top : hp - bottom, left : wp - right, :]


class Conv2D(_ChannelsLastConv):
    """2-D convolution: ``(N, C, H, W) -> (N, F, Ho, Wo)``.

    Args:
        filters: output channels ``F``.
        kernel: kernel size ``k`` (square).
        stride: step between windows.
        padding: zero padding on each side, or ``"same"`` to keep ``H, W`` at
            stride 1 (asymmetric for even kernels: one more row/column after).
    """

    def __init__(self, filters, kernel=3, stride=1, padding="same"):
        super().__init__()
        self.filters, self.kernel, self.stride = int(filters), int(kernel), int(stride)
        self.pads = _padding(self.kernel, padding)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ShapeError(
                f"Conv2D needs image samples (C, H, W), got per-sample shape {tuple(input_shape)}"
            )
        c, h, w = (int(d) for d in input_shape)
        k, s, p = self.kernel, self.stride, sum(self.pads)
        ho, wo = (h + p - k) // s + 1, (w + p - k) // s + 1
        if ho < 1 or wo < 1:
            raise ShapeError(
                f"Conv2D kernel {k} does not fit images of {h}x{w} with padding {_padding_text(self.pads)}"
            )
        self.in_channels, self.out_hw = c, (ho, wo)
        self.kernel_hw, self.pads_hw = (k, k), (self.pads, self.pads)
        return (self.filters, ho, wo)

    def param_specs(self):
        fan_in = self.in_channels * self.kernel * self.kernel
        shape = (self.filters, self.in_channels, self.kernel, self.kernel)
        return [("W", shape, init.he_normal(fan_in)), ("b", (self.filters,), init.zeros)]

    def __repr__(self):
        return (
            f"Conv2D({self.filters}, kernel={self.kernel}, stride={self.stride}, "
            f"padding={_padding_text(self.pads)})"
        )


class Conv1D(_ChannelsLastConv):
    """1-D convolution: ``(N, C, L) -> (N, F, Lo)``.

    Args:
        filters: output channels ``F``.
        kernel: kernel size ``k``.
        stride: step between windows.
        padding: zero padding on each side, or ``"same"`` to keep ``L`` at
            stride 1 (asymmetric for even kernels: one more position after).
    """

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
            raise ShapeError(
                f"Conv1D kernel {self.kernel} does not fit signals of length {length} "
                f"with padding {_padding_text(self.pads)}"
            )
        self.in_channels, self.out_length = c, lo
        # a signal is an image of height 1: a (1, k) kernel, no padding above or below
        self.kernel_hw, self.pads_hw, self.out_hw = (1, self.kernel), ((0, 0), self.pads), (1, lo)
        return (self.filters, lo)

    def param_specs(self):
        fan_in = self.in_channels * self.kernel
        return [
            ("W", (self.filters, self.in_channels, self.kernel), init.he_normal(fan_in)),
            ("b", (self.filters,), init.zeros),
        ]

    def _as_images(self, x):
        return x[:, :, None, :]

    def _from_images(self, y):
        return y[:, :, 0, :]

    def __repr__(self):
        return (
            f"Conv1D({self.filters}, kernel={self.kernel}, stride={self.stride}, "
            f"padding={_padding_text(self.pads)})"
        )
