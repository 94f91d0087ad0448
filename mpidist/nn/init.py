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


def zeros(rng, shape):
    """All zeros (biases)."""
    return np.zeros(shape)
