"""Smooth elementwise activations (ReLU and Tanh live in :mod:`.layers`)."""

import math

from .layers import Layer

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class GELU(Layer):
    """Gaussian error linear unit, tanh approximation: ``(N, ...) -> (N, ...)``.

    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``: the same function as
    PyTorch's ``GELU(approximate="tanh")``, not the exact erf form (cupy and
    numpy share ``tanh`` but numpy has no ``erf``).
    """

    cache = ("x", "h")

    # (in place, in arrays kept from step to step, and in as few passes over memory as the algebra allows:
    # GELU was the costliest layer of a transformer block's backward). With u = c (x + a x^3) and
    # h = (1 + tanh u) / 2, y = x h, and dy/dx = h + 2 x u' h (1 - h), since 1 - tanh^2 u = 4 h (1 - h).
    def forward(self, x, training=False):
        xp = self.xp
        self.x = x
        h = self.h = self.scratch_like("h", x)
        y = self.scratch_like("y", x)
        for xs, hs, ys in _in_blocks(x, h, y):
            xp.multiply(xs, xs, out=hs)
            hs *= _GELU_C * _GELU_A
            hs += _GELU_C
            hs *= xs  # u
            xp.tanh(hs, out=hs)
            hs *= 0.5
            hs += 0.5
            xp.multiply(xs, hs, out=ys)
        return y

    def backward(self, dy):
        xp, x, h = self.xp, self.x, self.h
        grad, part = self.scratch_like("dx", dy), self.scratch_like("part", dy)
        for xs, hs, dys, grads, parts in _in_blocks(x, h, dy, grad, part):
            xp.multiply(xs, xs, out=grads)
            grads *= 6 * _GELU_C * _GELU_A
            grads += 2 * _GELU_C
            grads *= xs  # 2 x u'
            xp.subtract(1, hs, out=parts)
            parts *= hs
            grads *= parts
            grads += hs
            grads *= dys
        return grad


#: elements an elementwise chain works on at once: its passes then run in the core's cache, where a whole
#: transformer's activation (5 MiB at batch 128) went out to memory and back once per operation
BLOCK_ELEMENTS = 1 << 16


def _in_blocks(*arrays):
    """Matching flat blocks of ``arrays`` (one shape, each contiguous), or the arrays whole where one is
    not contiguous (a view) or they are on a GPU (one kernel per operation is what it wants)."""
    first = arrays[0]
    contiguous = all(array.flags.c_contiguous for array in arrays)
    if not contiguous or type(first).__module__ != "numpy" or first.size <= BLOCK_ELEMENTS:
        yield arrays
        return
    flat = [array.reshape(-1) for array in arrays]
    for start in range(0, first.size, BLOCK_ELEMENTS):
        yield tuple(array[start : start + BLOCK_ELEMENTS] for array in flat)


class Sigmoid(Layer):
    """Logistic ``1 / (1 + exp(-x))`` elementwise: ``(N, ...) -> (N, ...)``.

    Computed from ``exp(-|x|)``, which never overflows, so huge ``|x|`` give
    exactly 0 or 1 without warnings.
    """

    cache = ("y",)

    def forward(self, x, training=False):
        xp = self.xp
        e = xp.exp(-xp.abs(x))
        # x >= 0: 1 / (1 + e^-x); x < 0: e^x / (1 + e^x); both with e = exp(-|x|) <= 1
        self.y = xp.where(x >= 0, 1, e) / (1 + e)
        return self.y

    def backward(self, dy):
        return dy * self.y * (1 - self.y)
