"""Optimizers that update a flat parameter array from a flat gradient array.

They know nothing of layers or MPI: a strategy hands them the whole buffer, or
the contiguous shard a parameter server owns, and their state is a flat array
of the same length (so it shards, checkpoints and reshards with the params).

Each step takes the learning rate of its step (a schedule's, see
:mod:`mpidist.nn.schedules`).  Weight decay is decoupled from the gradient
(Loshchilov & Hutter, "Decoupled Weight Decay Regularization"): before the
gradient's update, every parameter in ``decay_ranges`` shrinks by
``lr x weight_decay`` of itself, ``p -= lr * weight_decay * p``, as PyTorch's
AdamW does.  In the paper's notation that is ``eta_t * lambda`` with the
schedule multiplier ``eta_t = lr_t / lr`` and ``lambda = lr * weight_decay``.
Adam with weight decay is AdamW; SGD with it is SGDW.
"""

import numpy as np


class Optimizer:
    """Base class. ``step(params, grads)`` updates ``params`` in place.

    Args:
        size: the parameters it updates (a flat array of this length).
        xp: array module (numpy or cupy).
        dtype: dtype of its state.
        weight_decay: decoupled weight decay ``w``: each step, before the
            gradient's update, the parameters in ``decay_ranges`` become
            ``p - lr x w x p`` (0: none).
        decay_ranges: ``(lo, hi)`` ranges of the ``size`` parameters that
            decay (default: all of them). Strategies pass the model's
            :meth:`~mpidist.nn.Sequential.decay_ranges` within the slice the
            optimizer holds, so biases and normalisation parameters do not decay.

    :class:`SGD` and :class:`Adam` take these as keyword arguments after their own.
    """

    def __init__(self, size, xp=np, dtype=np.float32, weight_decay=0.0, decay_ranges=None):
        self.xp, self.size, self.dtype = xp, int(size), np.dtype(dtype)
        self.steps = 0
        self.weight_decay = float(weight_decay)
        #: ``(lo, hi)`` ranges of this optimizer's slice that decay (default: all of it)
        self.decay_ranges = [(0, self.size)] if decay_ranges is None else [(int(lo), int(hi))
                                                                          for lo, hi in decay_ranges]

    def step(self, params, grads, lr=None):
        """Update ``params`` in place from ``grads``, at learning rate ``lr`` (default: the one set last)."""
        if lr is not None:
            self.lr = float(lr)
        if self.weight_decay:
            keep = 1.0 - self.lr * self.weight_decay
            for lo, hi in self.decay_ranges:
                params[lo:hi] *= keep
        self.update(params, grads)
        self.steps += 1

    def update(self, params, grads):
        """The gradient's part of a step, at ``self.lr`` (subclasses)."""
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

    def __init__(self, size, lr=0.01, momentum=0.9, xp=np, dtype=np.float32, **decay):
        super().__init__(size, xp, dtype, **decay)
        self.lr, self.momentum = float(lr), float(momentum)
        self.velocity = xp.zeros(self.size, dtype=self.dtype)
        self._scratch = xp.zeros(self.size, dtype=self.dtype)   # lr * v without a new array each step

    def update(self, params, grads):
        v = self.velocity
        if self.momentum:
            v *= self.momentum
            v += grads
        else:
            v[...] = grads
        v_scaled = self.xp.multiply(v, self.lr, out=self._scratch)
        params -= v_scaled

    def state_arrays(self):
        return {"velocity": self.velocity}


class Adam(Optimizer):
    """Adam (Kingma & Ba), bias-corrected first and second moments."""

    def __init__(self, size, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8, xp=np, dtype=np.float32, **decay):
        super().__init__(size, xp, dtype, **decay)
        self.lr, self.beta1, self.beta2, self.eps = float(lr), float(beta1), float(beta2), float(eps)
        self.m = xp.zeros(self.size, dtype=self.dtype)
        self.v = xp.zeros(self.size, dtype=self.dtype)

    def update(self, params, grads):
        xp, b1, b2 = self.xp, self.beta1, self.beta2
        term, denom = self._scratch()
        t = self.steps + 1   # (the count is moved on by step(), after this)
        self.m *= b1
        self.m += xp.multiply(grads, 1 - b1, out=term)
        self.v *= b2
        term = xp.multiply(grads, grads, out=term)
        term *= 1 - b2
        self.v += term
        # textbook form (as PyTorch): lr * m_hat / (sqrt(v_hat) + eps)
        xp.sqrt(self.v, out=denom)
        denom *= 1.0 / np.sqrt(1 - b2 ** t)
        denom += self.eps
        step = xp.divide(self.m, denom, out=term)
        step *= self.lr / (1 - b1 ** t)
        params -= step

    def _scratch(self):
        """Two arrays of the update's size for its intermediate terms, made on the first step (not in checkpoints)."""
        if getattr(self, "_terms", None) is None:
            self._terms = (self.xp.empty(self.size, dtype=self.dtype), self.xp.empty(self.size, dtype=self.dtype))
        return self._terms

    def state_arrays(self):
        return {"m": self.m, "v": self.v}


OPTIMIZERS = {"sgd": SGD, "adam": Adam}


def make_optimizer(name, size, lr, momentum=0.9, xp=np, dtype=np.float32, weight_decay=0.0, decay_ranges=None):
    """Build the optimizer called ``name`` ("sgd" or "adam") for ``size`` parameters.

    ``weight_decay`` applies to ``decay_ranges`` (``(lo, hi)`` within the ``size``
    parameters; default: all of them).
    """
    decay = {"weight_decay": weight_decay, "decay_ranges": decay_ranges}
    if name == "sgd":
        return SGD(size, lr=lr, momentum=momentum, xp=xp, dtype=dtype, **decay)
    if name == "adam":
        return Adam(size, lr=lr, xp=xp, dtype=dtype, **decay)
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
