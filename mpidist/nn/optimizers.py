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

from ..runtime import aligned
from . import fused

#: Elements an update on the host takes at a time (128 Ki: its terms, 512 KiB each in float32, stay in the
#: cache; measured against whole-buffer updates: within 5% on 0.7 M parameters, a third faster on 17 M).
BLOCK = 1 << 17


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
        self.decay_ranges = (
            [(0, self.size)] if decay_ranges is None else [(int(lo), int(hi)) for lo, hi in decay_ranges]
        )

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

    def blocks(self):
        """``(lo, hi)`` blocks an update goes through, with scratch arrays of one block: on the host, blocks
        of :data:`BLOCK` (the intermediate terms stay in the cache, and take no memory in proportion to the
        model); on a device, one kernel per operation over the whole."""
        block = BLOCK if self.xp is np else max(self.size, 1)
        return [(lo, min(lo + block, self.size)) for lo in range(0, self.size, block)]

    def scratch(self, count):
        """``count`` arrays of one block's size for an update's intermediate terms (made on first use, never
        in checkpoints)."""
        if getattr(self, "_scratch", None) is None:
            block = BLOCK if self.xp is np else self.size
            self._scratch = tuple(
                aligned.empty(self.xp, min(block, self.size), self.dtype) for _ in range(count)
            )
        return self._scratch

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
        self.velocity = aligned.zeros(xp, self.size, self.dtype)

    def update(self, params, grads):
        if self.xp is not np and self.momentum:  # (one kernel on a GPU: mpidist.nn.fused)
            return fused.on_device(fused.sgd_update)(params, grads, self.velocity, self.momentum, self.lr)
        (scratch,) = self.scratch(1)  # lr * v without a new array each step
        for lo, hi in self.blocks():
            v, g = self.velocity[lo:hi], grads[lo:hi]
            if self.momentum:
                v *= self.momentum
                v += g
            else:
                v[...] = g
            params[lo:hi] -= self.xp.multiply(v, self.lr, out=scratch[: hi - lo])

    def state_arrays(self):
        return {"velocity": self.velocity}


class Adam(Optimizer):
    """Adam (Kingma & Ba), bias-corrected first and second moments."""

    def __init__(self, size, lr=0.001, beta1=0.9, beta2=0.999, eps=1e-8, xp=np, dtype=np.float32, **decay):
        super().__init__(size, xp, dtype, **decay)
        self.lr, self.beta1, self.beta2, self.eps = float(lr), float(beta1), float(beta2), float(eps)
        self.m = aligned.zeros(xp, self.size, self.dtype)
        self.v = aligned.zeros(xp, self.size, self.dtype)

    def update(self, params, grads):
        xp, b1, b2 = self.xp, self.beta1, self.beta2
        t = self.steps + 1  # (the count is moved on by step(), after this)
        unbias, step_size = 1.0 / np.sqrt(1 - b2**t), self.lr / (1 - b1**t)
        # (on a GPU one kernel, mpidist.nn.fused; the scalars of the types the blocks take them in)
        if xp is not np:
            args = (b1, b2, step_size, unbias, self.eps)
            return fused.on_device(fused.adam_update)(params, grads, self.m, self.v, *args)
        terms, denoms = self.scratch(2)
        for lo, hi in self.blocks():
            m, v, g, term, denom = (
                self.m[lo:hi],
                self.v[lo:hi],
                grads[lo:hi],
                terms[: hi - lo],
                denoms[: hi - lo],
            )
            m *= b1
            m += xp.multiply(g, 1 - b1, out=term)
            v *= b2
            term = xp.multiply(g, g, out=term)
            term *= 1 - b2
            v += term
            # textbook form (as PyTorch): lr * m_hat / (sqrt(v_hat) + eps)
            xp.sqrt(v, out=denom)
            denom *= unbias
            denom += self.eps
            step = xp.divide(m, denom, out=term)
            step *= step_size
            params[lo:hi] -= step

    def state_arrays(self):
        return {"m": self.m, "v": self.v}


OPTIMIZERS = {"sgd": SGD, "adam": Adam}


def make_optimizer(
    name, size, lr, momentum=0.9, xp=np, dtype=np.float32, weight_decay=0.0, decay_ranges=None
):
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
