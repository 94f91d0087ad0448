"""Normalisation layers: LayerNorm (per sample) and BatchNorm (per channel over the batch).

BatchNorm's running statistics live in the flat parameter buffer next to
``gamma`` and ``beta``, so checkpoints, broadcasts and pipeline slices carry
them with no extra machinery; they are not trained (their gradients are
always zero, so SGD and Adam leave them alone) and ``Sequential.running_entries``
tells strategies where they are.
"""

import numpy as np

from . import init
from .layers import Layer, ShapeError


class LayerNorm(Layer):
    """Normalise each sample over its last axis: ``(N, ..., D) -> (N, ..., D)``.

    ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` with mean and (biased)
    variance over the last axis only, and ``gamma`` (ones), ``beta`` (zeros)
    of shape ``(D,)``: PyTorch's ``LayerNorm(normalized_shape=D)``.  No batch
    statistics, so training and evaluation are the same function.
    """

    cache = ("xhat", "inv_std")

    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = float(eps)

    def build(self, input_shape):
        if len(input_shape) < 1:
            raise ShapeError("LayerNorm needs at least one per-sample axis")
        self.size = int(input_shape[-1])
        return tuple(input_shape)

    def param_specs(self):
        return [("gamma", (self.size,), init.ones), ("beta", (self.size,), init.zeros)]

    def _row_means(self, name, rows, out_shape):
        """The mean of each row of the 2-D ``rows``, as a product with a vector of ``1 / D``: BLAS reads
        the rows once, where numpy's reduction over a short last axis walks them a row at a time."""
        weights = self.scratch("weights", (self.size,), rows.dtype)
        weights[...] = 1 / self.size
        return self.xp.matmul(rows, weights, out=self.scratch(name, out_shape, rows.dtype).reshape(-1))

    # (in place, in arrays kept from step to step: the plain expressions made six temporaries of the input's
    # size per pass)
    def forward(self, x, training=False):
        xp, d = self.xp, self.size
        stats = x.shape[:-1] + (1,)
        xhat = self.xhat = self.scratch("xhat", x.shape, x.dtype)
        mean = self._row_means("mean", x.reshape(-1, d), stats).reshape(stats)
        xp.subtract(x, mean, out=xhat)
        y = self.scratch("y", x.shape, x.dtype)
        xp.multiply(xhat, xhat, out=y)  # (y holds the squares until the end)
        inv_std = self.inv_std = self._row_means("inv_std", y.reshape(-1, d), stats).reshape(stats)
        inv_std += self.eps
        xp.sqrt(inv_std, out=inv_std)
        xp.reciprocal(inv_std, out=inv_std)
        xhat *= inv_std
        xp.multiply(xhat, self.params["gamma"], out=y)
        y += self.params["beta"]
        return y

    def backward(self, dy):
        xp, d = self.xp, self.size
        product = self._param_grads(dy)  # dy * xhat
        stats = dy.shape[:-1] + (1,)
        # with g = dy * gamma, the row means of g * xhat and of g, as products with gamma / D
        gamma = xp.multiply(self.params["gamma"], 1 / d, out=self.scratch("gamma_d", (d,), dy.dtype))
        along_xhat = xp.matmul(
            product.reshape(-1, d), gamma, out=self.scratch("along_xhat", stats, dy.dtype).reshape(-1)
        ).reshape(stats)
        along_one = xp.matmul(
            dy.reshape(-1, d), gamma, out=self.scratch("along_one", stats, dy.dtype).reshape(-1)
        ).reshape(stats)
        # d/dx of the normalisation: remove the components along 1 and along xhat
        removed = xp.multiply(self.xhat, along_xhat, out=product)
        removed += along_one
        dx = xp.multiply(dy, self.params["gamma"], out=self.scratch("g", dy.shape, dy.dtype))
        dx -= removed
        dx *= self.inv_std
        return dx

    def backward_params(self, dy):
        self._param_grads(dy)

    def _param_grads(self, dy):
        """``gamma``'s and ``beta``'s gradients (column sums, as products with a vector of ones); returns
        ``dy * xhat``, an array of the workspace."""
        xp, d = self.xp, self.size
        rows = dy.reshape(-1, d)
        product = xp.multiply(dy, self.xhat, out=self.scratch("dx", dy.shape, dy.dtype))
        ones = self.scratch("ones", (rows.shape[0],), dy.dtype)
        ones[...] = 1
        xp.matmul(ones, product.reshape(-1, d), out=self.grads["gamma"])
        xp.matmul(ones, rows, out=self.grads["beta"])
        return product

    def __repr__(self):
        return f"LayerNorm(eps={self.eps:g})"


class BatchNorm(Layer):
    """Batch normalisation per channel: ``(N, C)`` or ``(N, C, *spatial)``, shape kept.

    Training normalises with the batch's mean and biased variance over every
    axis but the channel axis 1, and moves the running statistics
    ``running = (1 - momentum) * running + momentum * batch`` (unbiased
    variance for ``running_var``, as PyTorch); evaluation uses the running
    statistics.  Parameters: ``gamma`` (ones), ``beta`` (zeros), and the
    untrained ``running_mean`` (zeros), ``running_var`` (ones), all ``(C,)``.

    Synchronised statistics (``sync=True``): a strategy sets ``layer.reduce``
    to a callable that sums one contiguous float64 array *in place* across the
    data-parallel workers.  Forward then calls it once on
    ``[sum x (C), sum x^2 (C), count (1)]`` and normalises with the global
    batch's statistics; backward calls it once on ``[sum dy (C), sum dy*xhat (C)]``.
    Each worker's ``dy`` is the gradient of the *global* loss for its own
    samples (the loss is scaled by the worker's share), so with ``m`` the global
    count the input gradient is
    ``gamma / sigma * (dy - sum_g(dy) / m - xhat * sum_g(dy * xhat) / m)``,
    while ``gamma``/``beta`` get the *local* sums, which the strategy's gradient
    Allreduce adds up.  With ``reduce`` unset, ``sync=True`` is per-worker
    BatchNorm.
    """

    cache = ("xhat", "inv_std", "count")
    running = ("running_mean", "running_var")

    def __init__(self, momentum=0.1, eps=1e-5, sync=False):
        super().__init__()
        self.momentum, self.eps, self.sync = float(momentum), float(eps), bool(sync)
        self.reduce = None

    def build(self, input_shape):
        if len(input_shape) < 1:
            raise ShapeError("BatchNorm needs samples (C,) or (C, *spatial)")
        self.channels = int(input_shape[0])
        # parameters broadcast against (N, C, *spatial); statistics reduce every other axis
        self.param_shape = (self.channels,) + (1,) * (len(input_shape) - 1)
        self.axes = (0,) + tuple(range(2, len(input_shape) + 1))
        return tuple(input_shape)

    def param_specs(self):
        c = (self.channels,)
        return [
            ("gamma", c, init.ones),
            ("beta", c, init.zeros),
            ("running_mean", c, init.zeros),
            ("running_var", c, init.ones),
        ]

    def _synced(self):
        return self.sync and self.reduce is not None

    def _statistics(self, x):
        """Batch ``(mean, biased var, count)`` per channel: this worker's, or the global batch's."""
        xp, c = self.xp, self.channels
        count = x.size // c
        if not self._synced():
            return x.mean(axis=self.axes), x.var(axis=self.axes), count
        x64 = x.astype(np.float64, copy=False)
        packed = xp.empty(2 * c + 1, dtype=np.float64)
        xp.sum(x64, axis=self.axes, out=packed[:c])
        xp.sum(x64 * x64, axis=self.axes, out=packed[c : 2 * c])
        packed[2 * c] = count
        self.reduce(packed)
        total = float(packed[2 * c])  # one device sync: the count decides the unbiased factor
        mean = packed[:c] / total
        var = xp.maximum(packed[c : 2 * c] / total - mean * mean, 0)  # cancellation must not go negative
        return mean.astype(x.dtype), var.astype(x.dtype), total

    def forward(self, x, training=False):
        xp, p = self.xp, self.params
        if training:
            mean, var, self.count = self._statistics(x)
            m = self.momentum
            p["running_mean"] *= 1 - m
            p["running_mean"] += m * mean
            p["running_var"] *= 1 - m
            p["running_var"] += (m * self.count / max(self.count - 1, 1)) * var
        else:
            mean, var, self.count = p["running_mean"], p["running_var"], None
        inv_std = 1 / xp.sqrt(var + self.eps)
        self.inv_std = inv_std.reshape(self.param_shape)
        self.xhat = (x - mean.reshape(self.param_shape)) * self.inv_std
        return self.xhat * p["gamma"].reshape(self.param_shape) + p["beta"].reshape(self.param_shape)

    def backward_params(self, dy):
        xp = self.xp
        xp.sum(dy * self.xhat, axis=self.axes, out=self.grads["gamma"])
        xp.sum(dy, axis=self.axes, out=self.grads["beta"])
        self.grads["running_mean"][...] = 0
        self.grads["running_var"][...] = 0

    def backward(self, dy):
        """Input gradient through the batch statistics of the last ``forward(training=True)``.

        (After an evaluation forward it would be the gradient through the
        fixed running statistics: ``gamma / sigma * dy``.)
        """
        xp, c = self.xp, self.channels
        self.backward_params(dy)
        if self.count is None:
            return dy * (self.params["gamma"].reshape(self.param_shape) * self.inv_std)
        # the parameter gradients are this worker's sums of dy and dy * xhat
        sum_dy, sum_dy_xhat = self.grads["beta"], self.grads["gamma"]
        if self._synced():
            sums = xp.empty(2 * c, dtype=np.float64)
            sums[:c], sums[c:] = sum_dy, sum_dy_xhat
            self.reduce(sums)
            sum_dy, sum_dy_xhat = sums[:c].astype(dy.dtype), sums[c:].astype(dy.dtype)
        sum_dy, sum_dy_xhat = sum_dy.reshape(self.param_shape), sum_dy_xhat.reshape(self.param_shape)
        scale = self.params["gamma"].reshape(self.param_shape) * self.inv_std
        return scale * (dy - sum_dy / self.count - self.xhat * (sum_dy_xhat / self.count))

    def __repr__(self):
        return f"BatchNorm(momentum={self.momentum:g}, eps={self.eps:g}" + (
            ", sync=True)" if self.sync else ")"
        )
