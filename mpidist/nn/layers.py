"""Layers: pure array code on an ``xp`` module (numpy or cupy), no MPI.

A layer declares its parameters with :meth:`Layer.param_specs`; ``Sequential``
allocates one flat buffer for all parameters and one for all gradients and
binds views of them into ``layer.params`` / ``layer.grads``.  ``backward``
*overwrites* its gradient views, so one backward pass fills the flat gradient
buffer completely and nothing needs zeroing between steps.

Shapes in docstrings are per batch: ``N`` samples first.
"""

import numpy as np

from . import init
from .precision import master_dtype
from .rectifier import rectify
from .workspace import UsesWorkspace


class ShapeError(ValueError):
    """A layer cannot accept the shape it is given (a model/data mismatch)."""


class Layer(UsesWorkspace):
    """Base class: no parameters, shape-preserving.

    ``cache`` names the attributes ``forward`` leaves for ``backward``; a
    pipeline stashes them per micro-batch (:meth:`Sequential.stash`).
    """

    cache = ()
    #: ``forward`` returns an array that nothing else holds or reads later (not its input, not a cache),
    #: and ``backward`` likewise a gradient of its own: the next layer may overwrite them.  A subclass of
    #: a layer that sets it (Dense, the convolutions, max pooling) and keeps its output must set it False.
    hands_over = False
    #: Set by :class:`~mpidist.nn.Sequential` where the layer before hands its output over
    #: (``overwrite_input``) and the layer after its gradient (``overwrite_grad``):
    #: an elementwise layer may then work in place.
    overwrite_input = overwrite_grad = False

    def __init__(self):
        self.params = {}
        self.grads = {}
        self.xp = None

    def build(self, input_shape):
        """Check the per-sample ``input_shape`` and return the output shape."""
        return tuple(input_shape)

    def param_specs(self):
        """List of ``(name, shape, initialiser)``; call after :meth:`build`."""
        return []

    def forward(self, x, training=False):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def backward_params(self, dy):
        """Fill the parameter gradients only (the first layer's input gradient is never used)."""
        self.backward(dy)

    def decays(self, name, shape):
        """Whether ``--weight-decay`` shrinks this layer's parameter ``name`` of ``shape``.

        The rule: matrices and kernels decay (two axes or more); biases and the
        scales and shifts of normalisation layers (one axis) do not.  Change it
        for one layer with ``layer.weight_decay = {"b": True}`` (by parameter
        name), or for a class of your own by overriding this method.
        """
        chosen = getattr(self, "weight_decay", None) or {}
        return bool(chosen.get(name, len(shape) >= 2))

    def sublayers(self):
        """Layers this one applies inside itself (a residual block's), in order.

        ``Sequential`` walks this tree depth-first to allocate and bind their
        parameters, reseed them and stash their caches; ``[]`` for a leaf.
        """
        return []

    def __repr__(self):
        return f"{type(self).__name__}()"


class Dense(Layer):
    """Fully connected on the last axis: ``(N, ..., in) -> (N, ..., units)``, ``y = x W + b``.

    Flat samples ``(N, in)`` are the common case; a sequence ``(N, L, in)``
    is mapped token by token with the same ``W``.  ``bias=False`` leaves
    ``b`` out (a row-parallel shard adds its bias after the sum, see
    :mod:`mpidist.nn.tensor`).
    """

    cache = ("x",)
    hands_over = True

    def __init__(self, units, init="he", bias=True):
        super().__init__()
        self.units = int(units)
        self.init = init
        self.bias = bool(bias)

    def build(self, input_shape):
        if len(input_shape) < 1:
            raise ShapeError(
                f"Dense needs samples with a feature axis, got per-sample shape {tuple(input_shape)}"
            )
        if len(input_shape) > 2:
            raise ShapeError(
                f"Dense maps flat samples (in,) or sequences (L, in), got per-sample shape "
                f"{tuple(input_shape)} (put a Flatten before it)"
            )
        self.fan_in = int(input_shape[-1])
        return tuple(input_shape[:-1]) + (self.units,)

    def param_specs(self):
        if self.init == "he":
            w_init = init.he_normal(self.fan_in)
        else:
            w_init = init.glorot_uniform(self.fan_in, self.units)
        return [("W", (self.fan_in, self.units), w_init)] + (
            [("b", (self.units,), init.zeros)] if self.bias else []
        )

    def forward(self, x, training=False):
        self.x = x
        w = self.params["W"]
        y = self.xp.matmul(
            x, w, out=self.scratch("y", x.shape[:-1] + (self.units,), self.xp.result_type(x, w))
        )
        if self.bias:
            y += self.params["b"]
        return y

    def backward(self, dy):
        self.backward_params(dy)
        w = self.params["W"]
        return self.xp.matmul(
            dy, w.T, out=self.scratch("dx", dy.shape[:-1] + (self.fan_in,), self.xp.result_type(dy, w))
        )

    def backward_params(self, dy):
        # (tokens of every sample as rows)
        x, dy = (
            self.x.reshape(-1, self.fan_in),
            dy.reshape(-1, self.units),
        )
        self.xp.matmul(x.T, dy, out=self.grads["W"])
        if self.bias:
            # the method: np.sum's argument handling costs more than the sum
            dy.sum(axis=0, out=self.grads["b"])

    def __repr__(self):
        return f"Dense({self.units}{'' if self.bias else ', bias=False'})"


class Flatten(Layer):
    """``(N, *shape) -> (N, prod(shape))``."""

    def build(self, input_shape):
        self.input_shape = tuple(input_shape)
        size = 1
        for d in input_shape:
            size *= int(d)
        return (size,)

    def forward(self, x, training=False):
        if x.flags.c_contiguous:
            return x.reshape(x.shape[0], -1)
        # a channels-last view (a convolution's output): gathered in (C, H, W) order, into an array kept for
        # it
        flat = self.scratch("y", (x.shape[0], x[0].size), x.dtype)
        flat.reshape(x.shape)[...] = x
        return flat

    def backward(self, dy):
        return dy.reshape((dy.shape[0],) + self.input_shape)


class ReLU(Layer):
    """``max(x, 0)`` elementwise."""

    cache = ("mask",)

    def forward(self, x, training=False):
        xp = self.xp
        self.mask = xp.greater(x, 0, out=self.scratch_like("mask", x, bool))
        # in place where the layer before handed its output over: one array less to stream through the cache
        return rectify(xp, x, x if self.overwrite_input else self.scratch_like("y", x))

    def backward(self, dy):
        out = dy if self.overwrite_grad else self.scratch_like("dx", dy)
        return self.xp.multiply(dy, self.mask, out=out)


class Tanh(Layer):
    """``tanh(x)`` elementwise."""

    cache = ("y",)

    def forward(self, x, training=False):
        self.y = self.xp.tanh(x)
        return self.y

    def backward(self, dy):
        return dy * (1 - self.y * self.y)


class Dropout(Layer):
    """Inverted dropout: zero a fraction ``rate`` in training, scale the rest.

    Its random stream is set per step by :meth:`Sequential.reseed`, so a run
    resumed at step ``s`` draws the same masks as an uninterrupted one.
    """

    cache = ("mask",)

    def __init__(self, rate):
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
        self.rate = float(rate)
        self.rng = None

    def forward(self, x, training=False):
        if not training or self.rate == 0.0:
            self.mask = None
            return x
        xp, keep = self.xp, 1.0 - self.rate
        # (random < keep) / keep, in the dtype of x, drawn and computed into arrays kept from step to step
        mask = self.scratch("mask", x.shape, x.dtype)
        # (a generator draws float32 and float64 only: a 16-bit layer draws in float32)
        draw = mask if mask.dtype == master_dtype(x.dtype) else self.scratch("draw", x.shape, np.float32)
        self.rng.random(x.shape, dtype=draw.dtype, out=draw)
        mask[...] = xp.less(draw, keep, out=self.scratch("kept", x.shape, bool))
        mask /= keep
        self.mask = mask
        return xp.multiply(x, mask, out=self.scratch("y", x.shape, x.dtype))

    def backward(self, dy):
        if self.mask is None:
            return dy
        return self.xp.multiply(dy, self.mask, out=self.scratch("dx", dy.shape, dy.dtype))

    def __repr__(self):
        return f"Dropout({self.rate})"
