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

    def forward(self, x, training=False):
        self.x = x
        self.t = self.xp.tanh(_GELU_C * (x + _GELU_A * x * x * x))
        return 0.5 * x * (1 + self.t)

    def backward(self, dy):
        x, t = self.x, self.t
        du = _GELU_C * (1 + 3 * _GELU_A * x * x)
        return dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du)


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
