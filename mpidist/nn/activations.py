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

    cache = ("x", "t")

    # (in place, in arrays kept from step to step: the plain expressions made a temporary per operation, and
    # GELU was the costliest layer of a transformer block's backward)
    def forward(self, x, training=False):
        xp = self.xp
        self.x = x
        t = self.t = xp.multiply(x, x, out=self.scratch_like("t", x))
        t *= _GELU_A
        t += 1
        t *= x
        t *= _GELU_C
        xp.tanh(t, out=t)  # tanh(c (x + a x^3))
        y = xp.add(t, 1, out=self.scratch_like("y", x))
        y *= x
        y *= 0.5
        return y

    def backward(self, dy):
        xp, x, t = self.xp, self.x, self.t
        grad = xp.multiply(x, x, out=self.scratch_like("dx", dy))
        grad *= 3 * _GELU_A
        grad += 1
        grad *= 0.5 * _GELU_C
        grad *= x  # 0.5 x du/dx, u = c (x + a x^3)
        part = xp.multiply(t, t, out=self.scratch_like("part", dy))
        xp.subtract(1, part, out=part)
        grad *= part  # 0.5 x (1 - t^2) du/dx
        xp.add(t, 1, out=part)
        part *= 0.5
        grad += part  # + 0.5 (1 + t)
        grad *= dy
        return grad


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
