"""Convolutions on NCL signals and NCHW images, written against ``xp``.

Both lower to matrix products (im2col), computed in channels-last memory:
the padded input, the column matrix and the gradients are ``(N, H, W, C)``
arrays, so gathering a window and scattering its gradient back move whole
runs of channels, and the layer's ``(N, F, Ho, Wo)`` output is a transposed
view of the product, with no copy.

The batch is lowered a block of samples at a time (:func:`block_of`): a
block's column matrix, about 1 MiB, is still in the core's cache when the
product reads it, where a whole batch's (15 MiB for the cnn's second
convolution at batch 128) went out to memory and back.  Per pass:

* forward: the input into a zero-bordered buffer (one copy, kept for
  backward; the borders are zeroed once), then per block its windows into
  the column matrix through a strided view (one copy) and one GEMM into the
  block's rows of the output; the bias added in place;
* backward: per block, the windows gathered again and one GEMM adding to the
  weight gradient; the input gradient a convolution of the padded output
  gradient with the flipped kernel, per block one gather and one GEMM (at
  stride 1), or per block one GEMM to columns and ``kh * kw`` strided adds
  back into the input gradient (any stride).

Every array comes from the model's workspace (:mod:`mpidist.nn.workspace`):
once warm, a training step allocates nothing.  A Conv1D is a Conv2D of height 1.

``padding="same"`` pads ``k - 1`` in total, ``(k - 1) // 2`` before and the
rest after (as TensorFlow does), so even kernels keep the size too; at stride
``s`` the output has ``ceil(L / s)`` positions.
"""

from . import cudnn_conv, init
from .layers import Layer, ShapeError


def _padding(kernel, padding):
    """``(before, after)`` zero padding of each spatial axis: ``"same"`` or an int for both sides."""
    if padding == "same":
        return (kernel - 1) // 2, kernel - 1 - (kernel - 1) // 2
    return int(padding), int(padding)


def _padding_text(pads):
    """``1`` for symmetric padding, ``(1, 2)`` for the asymmetric "same" of an even kernel."""
    return pads[0] if pads[0] == pads[1] else pads


def window_gatherer(xp, padded, kernel_hw, stride, out_hw):
    """im2col by blocks: a function ``gather(start, stop, cols)`` setting ``cols[i, y, x, a, b, :] =
    padded[start + i, stride * y + a, stride * x + b, :]``, ``cols`` of ``(stop - start, Ho, Wo, kh, kw,
    C)``.

    One copy through a strided view of every window (made once for the whole
    batch: a view per block would leave reference cycles behind, garbage
    that grows with the batch until the collector runs), whose innermost runs
    are ``kw * C`` values; with one channel those runs are a few values long,
    and a copy per kernel offset, running along whole rows of ``Wo``
    positions, is 4x faster.
    """
    (kh, kw), (ho, wo) = kernel_hw, out_hw
    if padded.shape[-1] > 1:
        # N, ., ., C, kh, kw
        windows = xp.lib.stride_tricks.sliding_window_view(padded, (kh, kw), axis=(1, 2))
        windows = windows[:, ::stride, ::stride][:, :ho, :wo].transpose(0, 1, 2, 4, 5, 3)

        def gather(start, stop, cols):
            cols[...] = windows[start:stop]

        return gather

    def gather_offsets(start, stop, cols):
        block = padded[start:stop]
        for a in range(kh):
            for b in range(kw):
                cols[:, :, :, a, b, :] = block[
                    :, a : a + stride * ho : stride, b : b + stride * wo : stride, :
                ]

    return gather_offsets


#: bytes lowered at once: a block of the column matrix that fits the core's cache with room for the product
BLOCK_BYTES = 1 << 20


def block_of(xp, samples, bytes_per_sample):
    """Samples per block of the lowering: as many as fit :data:`BLOCK_BYTES` (at least one); the whole
    batch on a GPU, where one large product beats many small ones and there is no cache to keep."""
    if xp.__name__ != "numpy":
        return samples
    return max(1, min(samples, BLOCK_BYTES // max(1, bytes_per_sample)))


def _blocks(samples, block):
    """``(start, stop)`` of each block of ``block`` samples (the last one shorter)."""
    return [(start, min(samples, start + block)) for start in range(0, samples, block)]


class _ChannelsLastConv(Layer):
    """The 2-D convolution both layers run: ``(N, C, H, W)`` in and out, channels-last inside.

    Subclasses set ``kernel_hw``, ``stride``, ``pads_hw`` (``((top, bottom),
    (left, right))``), ``in_channels`` and ``out_hw`` in ``build``, and map
    their own shapes onto 4-D ones (:meth:`_as_images`, :meth:`_from_images`).

    The column matrix has one more column than the kernel has weights, all
    ones, and the weight matrix the bias as its last column: the products
    add the bias in forward and sum its gradient in backward, where a pass of
    its own over the output cost as much as a third of the product.
    """

    cache = ("cols", "padded_shape", "images", "cudnn")
    hands_over = True
    #: on a GPU through cuDNN (:mod:`mpidist.nn.cudnn_conv`): the pass's plans and its 4-D input, for backward
    cudnn = images = None

    def _as_images(self, x):
        return x

    def _from_images(self, y):
        return y

    @property
    def _window_size(self):
        """``kh * kw * C``: the weights of one filter, the columns of the column matrix but its last."""
        (kh, kw), c = self.kernel_hw, self.in_channels
        return kh * kw * c

    def _weights(self):
        """``[W | b]`` as an ``(F, kh kw C + 1)`` matrix, in the order of the column matrix's columns (a
        small copy)."""
        f, (kh, kw), c, k = self.filters, self.kernel_hw, self.in_channels, self._window_size
        w = self.params["W"].reshape(f, c, kh, kw)
        out = self.scratch("w_hwc", (f, k + 1), w.dtype)
        out[:, :k].reshape(f, kh, kw, c)[...] = w.transpose(0, 2, 3, 1)
        out[:, k] = self.params["b"]
        return out

    def forward(self, x, training=False):
        x = self._as_images(x)
        ran = cudnn_conv.forward(self, x)
        if ran is not None:
            y, self.cudnn, self.images = ran
            return self._from_images(y)
        self.cudnn = self.images = None
        return self._from_images(self._im2col_forward(x))

    def _im2col_forward(self, x):
        """The output for ``x`` (4-D) by windows gathered into the column matrix and one product a block."""
        xp = self.xp
        n, c, h, w = x.shape
        (kh, kw), s, ((top, bottom), (left, right)) = self.kernel_hw, self.stride, self.pads_hw
        (ho, wo), k = self.out_hw, self._window_size
        dtype = xp.result_type(x, self.params["W"])
        padded = self.scratch("padded", (n, h + top + bottom, w + left + right, c), dtype, fill=0)
        padded[:, top : top + h, left : left + w, :] = x.transpose(0, 2, 3, 1)
        self.padded_shape = padded.shape
        # (the windows fill the first k columns: the last keeps the ones it was made with)
        cols = self.cols = self.scratch("cols", (n * ho * wo, k + 1), dtype, fill=1)
        windows = cols[:, :k].reshape(n, ho, wo, kh, kw, c)
        weights = self._weights().T
        y = self.scratch("y", (n * ho * wo, self.filters), dtype)
        gather = window_gatherer(xp, padded, self.kernel_hw, s, self.out_hw)
        # block by block: the product reads each block of columns while the copy has left it in the cache
        for start, stop in _blocks(n, block_of(xp, n, ho * wo * (k + 1) * dtype.itemsize)):
            gather(start, stop, windows[start:stop])
            rows = slice(start * ho * wo, stop * ho * wo)
            xp.matmul(cols[rows], weights, out=y[rows])
        return y.reshape(n, ho, wo, self.filters).transpose(0, 3, 1, 2)

    def _dy_rows(self, dy):
        """``(N, F, Ho, Wo)`` gradient as the ``(N Ho Wo, F)`` matrix (a view when it is channels-last
        already)."""
        dy = self._as_images(dy)
        n, f, ho, wo = dy.shape
        return dy.transpose(0, 2, 3, 1).reshape(n * ho * wo, f)

    def backward_params(self, dy):
        if self.cudnn is not None:
            return cudnn_conv.backward_params(self, self.cudnn, self.images, self._as_images(dy))
        xp, f, (kh, kw), c, k = self.xp, self.filters, self.kernel_hw, self.in_channels, self._window_size
        rows = self._dy_rows(dy)
        grad = xp.matmul(rows.T, self.cols, out=self.scratch("dw_hwc", (f, k + 1), rows.dtype))
        self.grads["W"].reshape(f, c, kh, kw)[...] = grad[:, :k].reshape(f, kh, kw, c).transpose(0, 3, 1, 2)
        self.grads["b"][...] = grad[:, k]  # (the ones column's: the bias's gradient)
        return rows

    def backward(self, dy):
        rows = self.backward_params(dy)
        if self.cudnn is not None:
            return self._from_images(cudnn_conv.input_grad(self, self.cudnn, rows))
        dx = self._input_grad_stride_1(rows) if self.stride == 1 else self._input_grad_strided(rows)
        return self._from_images(dx.transpose(0, 3, 1, 2))

    def _input_grad_stride_1(self, rows):
        """At stride 1 the input gradient is a convolution too: ``dy`` zero-padded, against the flipped
        kernel.

        Block by block, one im2col of ``dy`` and one GEMM, instead of a GEMM to
        columns and ``kh * kw`` strided adds of short channel runs (measured
        3x slower).
        """
        xp, (kh, kw), ((top, bottom), (left, right)) = self.xp, self.kernel_hw, self.pads_hw
        n, hp, wp, c = self.padded_shape
        (ho, wo), f = self.out_hw, self.filters
        h, w = hp - top - bottom, wp - left - right
        # dx_padded[p] = sum over (a, b) of dy_full[p + (a, b)] W[:, :, kh-1-a, kw-1-b]; dy_full has dy at
        # (kh-1, kw-1)
        full = self.scratch("dy_full", (n, ho + 2 * (kh - 1), wo + 2 * (kw - 1), f), rows.dtype, fill=0)
        full[:, kh - 1 : kh - 1 + ho, kw - 1 : kw - 1 + wo, :] = rows.reshape(n, ho, wo, f)
        flipped = self.scratch("w_flipped", (kh, kw, f, c), rows.dtype)
        flipped[...] = self.params["W"].reshape(f, c, kh, kw)[:, :, ::-1, ::-1].transpose(2, 3, 0, 1)
        flipped = flipped.reshape(-1, c)
        dx = self.scratch("dx", (n * h * w, c), rows.dtype)
        block = block_of(xp, n, h * w * kh * kw * f * rows.dtype.itemsize)
        cols = self.scratch("dy_cols", (block, h, w, kh, kw, f), rows.dtype)
        gather = window_gatherer(xp, full[:, top:, left:], self.kernel_hw, 1, (h, w))
        for start, stop in _blocks(n, block):
            part = cols[: stop - start]
            gather(start, stop, part)
            xp.matmul(part.reshape(-1, flipped.shape[0]), flipped, out=dx[start * h * w : stop * h * w])
        return dx.reshape(n, h, w, c)

    def _input_grad_strided(self, rows):
        """Any stride: the column gradient, added back window offset by window offset (``kh * kw``
        strided adds)."""
        xp, (kh, kw), s, ((top, bottom), (left, right)) = self.xp, self.kernel_hw, self.stride, self.pads_hw
        n, hp, wp, c = self.padded_shape
        ho, wo = self.out_hw
        weights = self._weights()[:, : self._window_size]
        dcols = xp.matmul(
            rows, weights, out=self.scratch("dcols", (rows.shape[0], weights.shape[1]), rows.dtype)
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
