"""Parameter initialisers.

Each returns a host (numpy) array drawn from a numpy Generator; the chief
initialises on the host and the flat buffer is then copied to the device and
broadcast, so initial parameters never depend on the array module or rank.
"""

import numpy as np


def he_normal(rng, shape, fan_in):
    """Normal with std sqrt(2 / fan_in): keeps ReLU activations' variance."""
    return rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape)


def glorot_uniform(rng, shape, fan_in, fan_out):
    """Uniform in +-sqrt(6 / (fan_in + fan_out)): for tanh and linear outputs."""
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape)


def normal(rng, shape, std=1.0):
    """Normal with std ``std`` (embedding tables, as PyTorch's N(0, 1))."""
    return rng.normal(0.0, std, size=shape)


def ones(rng, shape):
    """All ones (normalisation scales, running variances)."""
    return np.ones(shape)


def zeros(rng, shape):
    """All zeros (biases, shifts, running means)."""
    return np.zeros(shape)
