"""Parameter initialisers whose every element is a function of (key, element index).

A parameter's ``key`` comes from the run's seed and the parameter's place in
the whole model (:meth:`mpidist.nn.Sequential.parameter_key`); element ``i``
of the whole parameter (C order) is drawn from a counter-based generator at
counter ``i``, with a fixed number of draws per element.  So a rank that holds
a slice of a parameter (a pipeline stage, a tensor part) draws exactly that
slice, with no communication and without the whole, and every layout starts
from bit-identical parameters.

The generator is SplitMix64 read at a counter: ``mix(key + (c + 1) * golden)``,
the sequence SplitMix64 itself produces, reached at any ``c`` at once (a Weyl
sequence through a 64-bit finaliser; Steele, Lea and Flood 2014).  Values are
computed on the host in float64, so they never depend on the device.

An initialiser of one's own may stay a plain ``(rng, shape) -> array``: it is
drawn whole for its parameter (from a generator keyed as above) on the ranks
that hold part of it, and sliced.
"""

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = (np.uint64(shift) for shift in (30, 27, 31, 11))


def uniform_bits(key, counters):
    """64 random bits for each of ``counters`` (int64 array) under ``key`` (a uint64): SplitMix64 at those
    counters."""
    z = np.asarray(counters, dtype=np.int64).astype(np.uint64)  # (a copy: worked on in place below)
    z += np.uint64(1)
    z *= _GOLDEN
    z += np.uint64(key)
    z ^= z >> _S30
    z *= _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


def uniform_open(key, counters):
    """Uniform float64 in the open interval (0, 1), one per counter (53 bits, never 0 or 1)."""
    bits = uniform_bits(key, counters)
    bits >>= _S11
    values = bits.astype(np.float64)
    values += 0.5
    values *= 2.0**-53
    return values


class Initialiser:
    """An initial value for each element of a parameter, a function of ``(key, element index)``.

    Subclasses give :meth:`values`; calling one as a plain initialiser
    ``(rng, shape)`` draws a whole parameter from a key the generator gives.
    """

    def values(self, key, index):
        """float64 values of the elements at flat ``index`` (int64 array) of a parameter keyed ``key``."""
        raise NotImplementedError

    def __call__(self, rng, shape):
        key = rng.integers(0, 2**64, dtype=np.uint64)
        return self.values(key, np.arange(int(np.prod(shape)), dtype=np.int64)).reshape(shape)


class Normal(Initialiser):
    """Normal with mean 0 and std ``std``: Box-Muller on two uniforms per element (counters ``2i``, ``2i +
    1``)."""

    def __init__(self, std):
        self.std = float(std)

    def values(self, key, index):
        counters = 2 * np.asarray(index, dtype=np.int64)
        radius = uniform_open(key, counters)
        np.log(radius, out=radius)
        radius *= -2.0
        np.sqrt(radius, out=radius)
        counters += 1
        angle = uniform_open(key, counters)
        angle *= 2.0 * np.pi
        np.cos(angle, out=angle)
        radius *= angle
        radius *= self.std
        return radius

    def __repr__(self):
        return f"Normal(std={self.std:g})"


class Uniform(Initialiser):
    """Uniform in ``(-limit, limit)``: one uniform per element."""

    def __init__(self, limit):
        self.limit = float(limit)

    def values(self, key, index):
        return self.limit * (2.0 * uniform_open(key, index) - 1.0)

    def __repr__(self):
        return f"Uniform(limit={self.limit:g})"


class Constant(Initialiser):
    """Every element ``value`` (no draw)."""

    def __init__(self, value):
        self.value = float(value)

    def values(self, key, index):
        return np.full(len(index), self.value)

    def __repr__(self):
        return f"Constant({self.value:g})"


def he_normal(fan_in):
    """Normal with std sqrt(2 / fan_in): keeps ReLU activations' variance."""
    return Normal(np.sqrt(2.0 / fan_in))


def glorot_uniform(fan_in, fan_out):
    """Uniform in +-sqrt(6 / (fan_in + fan_out)): for tanh and linear outputs."""
    return Uniform(np.sqrt(6.0 / (fan_in + fan_out)))


def normal(std=1.0):
    """Normal with std ``std`` (embedding tables, as PyTorch's N(0, 1))."""
    return Normal(std)


#: All ones (normalisation scales, running variances).
ones = Constant(1.0)
#: All zeros (biases, shifts, running means).
zeros = Constant(0.0)
