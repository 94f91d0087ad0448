"""Losses: a value averaged over the batch, and its gradient.

``backward(scale)`` returns the gradient of ``scale * loss``.  Data-parallel
strategies pass ``scale = local_batch / global_batch`` so that *summing* the
workers' gradients gives exactly the global-batch mean gradient: the exchange
is one in-place ``Allreduce(SUM)`` with no division afterwards, and uneven
shards are weighted correctly.

In a training pass both compute into the model's workspace
(:meth:`~mpidist.nn.Sequential.use_workspace`): the same arrays every step.

A 16-bit model's outputs (``--precision``) are widened: the loss, its
softmax and its gradient are computed in float32 (an fp16 log-probability
underflows to -Inf where float32's does not), and the gradient handed back
is rounded to the outputs' type.
"""

from .precision import master_dtype
from .workspace import UsesWorkspace


class Widening(UsesWorkspace):
    """Mixin of losses: computed in float32 for 16-bit outputs, the gradient handed back in their type."""

    #: the outputs' dtype, which the gradient is handed back in (set by ``forward``)
    compute = None

    def narrowed(self, grad):
        """``grad`` (float32) in the outputs' dtype: itself where they are the same."""
        if self.compute is None or grad.dtype == self.compute:
            return grad
        narrow = self.scratch("narrow", grad.shape, self.compute)
        narrow[...] = grad
        return narrow


class SoftmaxCrossEntropy(Widening):
    """Cross-entropy of softmax(logits) against integer labels, averaged over every labelled position.

    ``logits (N, K)`` and ``labels (N,)`` ints in ``[0, K)``: one class per
    sample.  Sequences are labelled token by token: ``logits (N, L, K)``
    (any axes between the first and the classes) and ``labels (N, L)``
    (next-token prediction), the loss the mean over the ``N * L`` tokens.
    The softmax subtracts each row's maximum first: no logit overflows.
    """

    cache = ("probs", "labels", "shape", "compute")

    def __init__(self, xp):
        self.xp = xp

    def _rows_of(self, logits, labels):
        """``(logits as (M, K), labels as (M,))``: one row per labelled position."""
        k = logits.shape[-1]
        rows = logits.size // k if k else 0
        if labels.size != rows:
            raise ValueError(
                f"cross-entropy of logits {tuple(logits.shape)} needs {rows} labels, one per row of "
                f"{k} classes, got labels {tuple(labels.shape)}"
            )
        return logits.reshape(rows, k), labels.reshape(rows)

    def forward(self, logits, labels):
        xp, dtype = self.xp, master_dtype(logits.dtype)
        self.shape, self.compute = logits.shape, logits.dtype
        logits, labels = self._rows_of(logits, labels)
        n, k = logits.shape
        # log_p = shifted - log(sum(exp(shifted))), shifted = logits - max: computed in two (N, K) arrays
        log_p, probs = self.scratch("log_p", (n, k), dtype), self.scratch("probs", (n, k), dtype)
        row = self.scratch("row", (n, 1), dtype)
        # (array methods rather than np.max / np.sum / np.mean: the same reductions, less argument handling)
        xp.subtract(logits, logits.max(axis=1, keepdims=True, out=row), out=log_p)
        xp.log(xp.exp(log_p, out=probs).sum(axis=1, keepdims=True, out=row), out=row)
        log_p -= row
        self.probs, self.labels = xp.exp(log_p, out=probs), labels
        picked = log_p[self._rows(n), labels].sum()
        # (divided in its own type, as mean() gives it, on NumPy 1 too)
        return -(picked / picked.dtype.type(n))

    def _rows(self, n):
        """``arange(n)``, kept: the row index of every sample's label."""
        rows = getattr(self, "_arange", None)
        if rows is None or rows.shape[0] != n:
            rows = self._arange = self.xp.arange(n)
        return rows

    def backward(self, scale=1.0):
        """The gradient of ``scale * loss``, shaped as the logits."""
        n = self.labels.shape[0]
        grad = self.scratch("grad", self.probs.shape, self.probs.dtype)
        grad[...] = self.probs
        grad[self._rows(n), self.labels] -= 1.0
        grad *= scale / n
        return self.narrowed(grad).reshape(self.shape)

    def correct(self, logits, labels):
        """Number of labelled positions (samples, or tokens) whose top logit is the label."""
        logits, labels = self._rows_of(logits, labels)
        return (logits.argmax(axis=1) == labels).sum()

    def positions(self, labels):
        """Number of labelled positions in ``labels``: samples, or tokens of sequences (what :meth:`correct`
        counts)."""
        return int(labels.size)


class MeanSquaredError(Widening):
    """Mean over samples and outputs of ``(pred - target)**2``.

    ``pred (N, K)``, ``target (N, K)`` or ``(N,)`` when ``K == 1``.
    """

    cache = ("diff", "compute")

    def __init__(self, xp):
        self.xp = xp

    def forward(self, pred, target):
        xp = self.xp
        target = target.reshape(pred.shape)
        dtype, self.compute = master_dtype(xp.result_type(pred, target)), pred.dtype
        self.diff = xp.subtract(pred, target, out=self.scratch("diff", pred.shape, dtype))
        return xp.multiply(self.diff, self.diff, out=self.scratch("squares", pred.shape, dtype)).mean()

    def backward(self, scale=1.0):
        return self.narrowed(
            self.xp.multiply(
                self.diff,
                2.0 * scale / self.diff.size,
                out=self.scratch("grad", self.diff.shape, self.diff.dtype),
            )
        )

    def correct(self, pred, target):
        """Regression has no accuracy: always 0."""
        return 0

    def positions(self, target):
        """Samples in ``target`` (what a training figure is averaged over)."""
        return len(target)


def loss_for(num_classes, xp):
    """The loss a dataset calls for: cross-entropy for classes, MSE for ``num_classes == 0``."""
    return SoftmaxCrossEntropy(xp) if num_classes > 0 else MeanSquaredError(xp)
