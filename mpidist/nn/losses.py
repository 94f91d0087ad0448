"""Losses: a value averaged over the batch, and its gradient.

``backward(scale)`` returns the gradient of ``scale * loss``.  Data-parallel
strategies pass ``scale = local_batch / global_batch`` so that *summing* the
workers' gradients gives exactly the global-batch mean gradient: the exchange
is one in-place ``Allreduce(SUM)`` with no division afterwards, and uneven
shards are weighted correctly.
"""


class SoftmaxCrossEntropy:
    """Cross-entropy of softmax(logits) against integer labels.

    ``logits (N, K)``, ``labels (N,)`` ints in ``[0, K)``.
    """

    cache = ("probs", "labels")

    def __init__(self, xp):
        self.xp = xp

    def forward(self, logits, labels):
        xp = self.xp
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_z = xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        log_p = shifted - log_z
        self.probs, self.labels = xp.exp(log_p), labels
        return -log_p[xp.arange(labels.shape[0]), labels].mean()

    def backward(self, scale=1.0):
        n = self.labels.shape[0]
        grad = self.probs.copy()
        grad[self.xp.arange(n), self.labels] -= 1.0
        grad *= scale / n
        return grad

    def correct(self, logits, labels):
        """Number of samples whose top logit is the label."""
        return (logits.argmax(axis=1) == labels).sum()


class MeanSquaredError:
    """Mean over samples and outputs of ``(pred - target)**2``.

    ``pred (N, K)``, ``target (N, K)`` or ``(N,)`` when ``K == 1``.
    """

    cache = ("diff",)

    def __init__(self, xp):
        self.xp = xp

    def forward(self, pred, target):
        target = target.reshape(pred.shape)
        self.diff = pred - target
        return (self.diff * self.diff).mean()

    def backward(self, scale=1.0):
        return self.diff * (2.0 * scale / self.diff.size)

    def correct(self, pred, target):
        """Regression has no accuracy: always 0."""
        return 0


def loss_for(num_classes, xp):
    """The loss a dataset calls for: cross-entropy for classes, MSE for ``num_classes == 0``."""
    return SoftmaxCrossEntropy(xp) if num_classes > 0 else MeanSquaredError(xp)
