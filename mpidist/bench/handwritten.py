"""A minimal hand-written numpy training loop: the floor ``bench`` measures mpidist against.

What a careful person writes by hand for one MLP (``Dense``-``ReLU`` layers
and a ``Dense`` head, softmax cross-entropy, SGD with heavy-ball momentum),
knowing the whole graph: every array preallocated, ``out=`` everywhere, ReLU
in place on the layer's output, the parameters and gradients in one flat
buffer each (so data parallelism is one ``Allreduce`` after backward).  No
NaN checks, no callbacks, no generality: whatever mpidist spends beyond this
loop is framework overhead.
"""

import numpy as np


class HeavyBallSGD:
    """SGD with heavy-ball momentum over one flat buffer, as written by hand: ``v = m v + g; p -= lr v``.

    The optimizer's state and its one scratch array, apart from the network's
    arrays; made once, so a step allocates nothing.

    Args:
        size: elements of the parameters it updates.
        lr, momentum: SGD's.
        dtype: float32 or float64.
    """

    def __init__(self, size, lr, momentum, dtype):
        self.lr, self.momentum = lr, momentum
        self.velocity, self.scaled = np.zeros(size, dtype), np.zeros(size, dtype)

    def update(self, params, grads):
        """``params`` (a view of ``size`` elements) take one step along ``grads``, in place."""
        v = self.velocity
        v *= self.momentum
        v += grads
        params -= np.multiply(v, self.lr, out=self.scaled)


class HandwrittenMLP:
    """``sizes[0] -> sizes[1] -> ... -> sizes[-1]`` with ReLU between, trained on batches of ``batch``.

    Args:
        sizes: layer widths, input first, classes last.
        batch: samples per step.
        lr, momentum: SGD's.
        dtype: float32 or float64.
        seed: initialisation seed.
    """

    def __init__(self, sizes, batch, lr=0.01, momentum=0.9, dtype=np.float32, seed=0):
        shapes = [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]
        total = sum(a * b + b for a, b in shapes)
        self.params, self.grads = np.zeros(total + 1, dtype), np.zeros(total + 1, dtype)  # + the loss slot
        self.optimizer = HeavyBallSGD(total, lr, momentum, dtype)
        self.weights, self.biases, self.weight_grads, self.bias_grads = [], [], [], []
        offset, rng = 0, np.random.default_rng(seed)
        for a, b in shapes:
            for views, grads, shape in (
                (self.weights, self.weight_grads, (a, b)),
                (self.biases, self.bias_grads, (b,)),
            ):
                size = int(np.prod(shape))
                views.append(self.params[offset : offset + size].reshape(shape))
                grads.append(self.grads[offset : offset + size].reshape(shape))
                offset += size
            self.weights[-1][...] = rng.normal(0, np.sqrt(2 / a), (a, b))
        self.outputs = [np.empty((batch, b), dtype) for _, b in shapes]
        self.deltas = [np.empty((batch, b), dtype) for _, b in shapes]
        self.rows = np.arange(batch)

    def backprop(self, x, y, scale=1.0):
        """Forward and backward: fills the flat gradient buffer (the loss, times ``scale``, in its last
        slot)."""
        h = x
        last = len(self.weights) - 1
        for i, (w, b, out) in enumerate(zip(self.weights, self.biases, self.outputs)):
            np.matmul(h, w, out=out)
            out += b
            if i < last:
                np.maximum(out, 0, out=out)
            h = out
        # softmax cross-entropy and its gradient, in the head's output array
        logits, n = self.outputs[-1], len(x)
        logits -= logits.max(axis=1, keepdims=True)
        picked = logits[self.rows, y]
        np.exp(logits, out=logits)
        sums = logits.sum(axis=1, keepdims=True)
        self.grads[-1] = (np.log(sums[:, 0]) - picked).mean() * scale
        logits /= sums
        delta = self.deltas[-1]
        np.copyto(delta, logits)
        delta[self.rows, y] -= 1.0
        delta *= scale / n
        for i in range(last, -1, -1):
            below = x if i == 0 else self.outputs[i - 1]
            np.matmul(below.T, delta, out=self.weight_grads[i])
            np.sum(delta, axis=0, out=self.bias_grads[i])
            if i:
                up = self.deltas[i - 1]
                np.matmul(delta, self.weights[i].T, out=up)
                np.multiply(up, below > 0, out=up)
                delta = up

    def update(self):
        """SGD with momentum over the flat buffer (the loss slot left out): ``v = m v + g; p -= lr v``."""
        self.optimizer.update(self.params[:-1], self.grads[:-1])

    def step(self, x, y):
        self.backprop(x, y)
        self.update()


def handwritten_for(model, batch):
    """A :class:`HandwrittenMLP` of ``model``'s shape and starting parameters, or None if it is not an MLP.

    The same start gives the same trajectory, so both meet the same numbers
    (a model that has fit its batch meets tiny gradients, and tiny numbers
    can be slow): the comparison stays like for like however long it runs.
    """
    kinds = [type(layer).__name__ for layer in model.layers]
    if (
        kinds[:1] != ["Flatten"]
        or kinds[-1:] != ["Dense"]
        or kinds[1:-1] != ["Dense", "ReLU"] * ((len(kinds) - 2) // 2)
    ):
        return None
    sizes = [int(np.prod(model.input_shape))] + [
        layer.units for layer in model.layers if hasattr(layer, "units")
    ]
    hand = HandwrittenMLP(sizes, batch)
    hand.params[:-1] = model.params
    return hand
