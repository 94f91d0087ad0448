"""Uniform draws on a GPU from a key held in device memory: a dropout mask a CUDA graph can replay.

A random generator's state lives on the host side of cupy's generator
objects: a pass captured into a graph would replay the capture's draws, the
same mask every step.  :class:`KeyedDraws` draws instead by hashing each
element's index with a 64-bit key it keeps in device memory
(SplitMix64's finaliser over ``key + (index + 1) x golden ratio``: a
counter-based generator, as Philox is, each element independent of the
others).  :meth:`~mpidist.nn.Sequential.reseed` writes each step's key there;
the kernel reads it when it runs, so a replay draws the step's own mask.

A run's masks on a GPU are a function of the seed, the worker, the step and
the layer (a resumed run draws the uninterrupted run's), as the host's are;
they are not the host's own draws (those come from numpy's PCG64).
:func:`uniforms` is the same function in numpy: the tests check its
statistics on the host, and ``tests/test_gpu.py`` the kernel against it.
"""

import functools

import numpy as np

_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

#: the kernel's body: ``out`` (float32 or float64) the uniform of element ``i`` under ``key[0]``
_BODY = f"""
unsigned long long z = key[0] + (unsigned long long)(i + 1) * {_GOLDEN}ULL;
z = (z ^ (z >> 30)) * {_MIX1}ULL;
z = (z ^ (z >> 27)) * {_MIX2}ULL;
z = z ^ (z >> 31);
out = BITS == 24 ? (T)((float)(z >> 40) * 5.9604644775390625e-08f)
                 : (T)((double)(z >> 11) * 1.1102230246251565e-16);
"""

#: significant bits of a draw of each dtype (a draw is a multiple of 2^-bits in [0, 1))
BITS = {np.dtype(np.float32): 24, np.dtype(np.float64): 53}


def uniforms(key, size, dtype=np.float32):
    """``size`` draws in [0, 1) of ``dtype`` (float32 or float64) under ``key``: the kernel's, on the host."""
    dtype = np.dtype(dtype)
    z = np.arange(1, size + 1, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    bits = BITS[dtype]
    return ((z >> np.uint64(64 - bits)).astype(np.float64) * 2.0**-bits).astype(dtype)


class KeyedDraws:
    """A layer's draws on a GPU: :meth:`random` as a numpy ``Generator``'s, from the key in :attr:`key`.

    Args:
        xp: cupy (numpy for the tests: :func:`uniforms`).
    """

    def __init__(self, xp):
        self.xp = xp
        #: the key (one uint64 in device memory), rewritten each step by :meth:`set`
        self.key = xp.zeros(1, dtype=np.uint64)

    def set(self, key):
        """Draw from ``key`` from now on (a write to device memory: a replayed graph reads it)."""
        self.key[...] = np.uint64(key)

    def random(self, shape, dtype=np.float32, out=None):
        """Draws in [0, 1) of ``shape`` into ``out`` (contiguous), as ``Generator.random`` does."""
        if out is None:
            out = self.xp.empty(shape, dtype=dtype)
        if self.xp is np:
            out.reshape(-1)[...] = uniforms(int(self.key[0]), out.size, out.dtype)
        else:
            _kernel(self.xp, out.dtype)(self.key, out)
        return out


@functools.lru_cache(maxsize=None)
def _kernel(cupy, dtype):
    """The draw kernel of ``dtype`` (compiled once)."""
    body = _BODY.replace("BITS", str(BITS[np.dtype(dtype)]))
    return cupy.ElementwiseKernel("raw uint64 key", "T out", body, f"mpidist_draws_{np.dtype(dtype).name}")
