"""Optimizers that update a flat parameter array from a flat gradient array.

They know nothing of layers or MPI: a strategy hands them the whole buffer, or
the contiguous shard a parameter server owns, and their state is a flat array
of the same length (so it shards, checkpoints and reshards with the params).
"""

import numpy as np


class Optimizer:
    """Base class. ``step(params, grads)`` updates ``params`` in place."""

    def __init__(self, size, xp=np, dtype=np.float32):
        self.xp, self.size, self.dtype = xp, int(size), np.dtype(dtype)
        self.steps = 0

    def step(self, params, grads):
        raise NotImplementedError

    def state_arrays(self):
        """Named flat state arrays (for checkpoints)."""
        return {}

    def load_state(self, arrays, steps):
        """Restore from :meth:`state_arrays` output and a step count."""
        for name, value in arrays.items():
            self.state_arrays()[name][...] = self.xp.asarray(value)
        self.steps = int(steps)


class SGD(Optimizer):
    """Stochastic gradient descent with heavy-ball momentum.

    ``v = momentum * v + g``; ``p -= lr * v``.
    """

    def __init__(self, size, lr=0.01, momentum=0.9, xp=np, dtype=np.float32):
        super().__init__(size, xp, dtype)
        self.lr, self.momentum = float(lr), float(momentum)
        self.velocity = xp.zeros(self.size, dtype=self.dtype)
        self._scratch = xp.zeros(self.size, dtype=self.dtype)   # lr * v without a new array each step

    def step(self, params, grads):
        v = self.velocity
        if self.momentum:
            v *= self.momentum
            v += grads
        else:
            v[...] = grads
        v_scaled = self.xp.multiply(v, self.lr, out=self._scratch)
        params -= v_scaled
        self.steps += 1

    def state_arrays(self):
        return {"velocity": self.velocity}


class Adam(Optimizer):
    """Adam (Kingma & Ba), bias-corrected first and second moments."""

    def __init__(self, size, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8, xp=np, dtype=np.float32):
        super().__init__(size, xp, dtype)
        self.lr, self.beta1, self.beta2, self.eps = float(lr), float(beta1), float(beta2), float(eps)
        self.m = xp.zeros(self.size, dtype=self.dtype)
        self.v = xp.zeros(self.size, dtype=self.dtype)

    def step(self, params, grads):
        xp, b1, b2 = self.xp, self.beta1, self.beta2
        term, denom = self._scratch()
        self.steps += 1
        self.m *= b1
        self.m += xp.multiply(grads, 1 - b1, out=term)
        self.v *= b2
        term = xp.multiply(grads, grads, out=term)
        term *= 1 - b2
        self.v += term
        # textbook form (as PyTorch): lr * m_hat / (sqrt(v_hat) + eps)
        xp.sqrt(self.v, out=denom)
        denom *= 1.0 / np.sqrt(1 - b2 ** self.steps)
        denom += self.eps
        step = xp.divide(self.m, denom, out=term)
        step *= self.lr / (1 - b1 ** self.steps)
        params -= step

    def _scratch(self):
        """Two arrays of the update's size for its intermediate terms, made on the first step (not in checkpoints)."""
        if getattr(self, "_terms", None) is None:
            self._terms = (self.xp.empty(self.size, dtype=self.dtype), self.xp.empty(self.size, dtype=self.dtype))
        return self._terms

    def state_arrays(self):
        return {"m": self.m, "v": self.v}


OPTIMIZERS = {"sgd": SGD, "adam": Adam}


def make_optimizer(name, size, lr, momentum=0.9, xp=np, dtype=np.float32):
    """Build the optimizer called ``name`` ("sgd" or "adam") for ``size`` parameters."""
    if name == "sgd":
        return SGD(size, lr=lr, momentum=momentum, xp=xp, dtype=dtype)
    if name == "adam":
        return Adam(size, lr=lr, xp=xp, dtype=dtype)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
