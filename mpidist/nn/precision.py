"""Mixed precision: the dtype a run computes in, the float32 master copy it updates, and sums that stay exact.

``--precision bf16`` or ``fp16`` builds the model in that 16-bit type: the
parameters the passes read, the activations, the gradients (and so the
exchange, which moves half the bytes).  The optimizer never sees them: it
updates a float32 *master* copy of the parameters from a float32 copy of the
summed gradient, and the 16-bit parameters are the master rounded after each
step (:class:`MasterWeights`), as NVIDIA's "Mixed Precision Training"
(Micikevicius et al., 2018) and PyTorch's autocast with an fp32 optimizer do.
An update smaller than a 16-bit parameter's spacing is so kept, not lost.

bfloat16 keeps float32's range; fp16 does not (its largest value is 65504,
its smallest normal 6e-5), so fp16 gradients are taken of a scaled loss
(:mod:`mpidist.nn.loss_scale`) and unscaled in float32.  Sums that decide a
step (the squared norm) and the loss are taken in float32 whatever the
compute type (:func:`squared_sum`).

``bf16`` on numpy and cupy is ``ml_dtypes.bfloat16`` (the ``bf16``, ``gpu``
and ``test`` extras install it); ``fp16`` is the arrays' own ``float16``.
"""

import numpy as np

from ..runtime.errors import UsageError
from ..runtime import aligned

#: ``--precision`` values: the compute type (float32: the run's ``--dtype`` everywhere, no master copy)
PRECISIONS = ("float32", "bf16", "fp16")

#: what a block of a squared sum takes at a time in float32 (the scratch stays in the cache)
BLOCK = 1 << 16


def bfloat16():
    """``ml_dtypes.bfloat16``, or a :class:`UsageError` that says how to install it."""
    try:
        import ml_dtypes
    except ImportError:
        raise UsageError(
            "--precision bf16 needs the ml_dtypes package for its bfloat16 arrays "
            "(pip install 'mpidist[bf16]', or 'mpidist[gpu]' on GPUs)"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def compute_dtype(precision, dtype="float32"):
    """The dtype a run of ``--precision precision`` computes in (``dtype``: its ``--dtype``).

    >>> compute_dtype("fp16")
    dtype('float16')
    >>> compute_dtype("float32", "float64")
    dtype('float64')
    """
    if precision == "float32":
        return np.dtype(dtype)
    if np.dtype(dtype) != np.float32:
        raise UsageError(
            f"--precision {precision} keeps float32 master weights: it runs with --dtype float32, got {dtype}"
        )
    if precision == "fp16":
        return np.dtype(np.float16)
    if precision == "bf16":
        return bfloat16()
    raise UsageError(f"--precision {precision!r} is not one of: {', '.join(PRECISIONS)}")


def is_low(dtype):
    """Whether ``dtype`` is a 16-bit compute type, which keeps a float32 master copy."""
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and dtype.kind in "fV" and dtype != np.int16


def precision_of(dtype):
    """The ``--precision`` name a model of ``dtype`` computes in ("float32" for float32 and float64)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "fp16"
    return "bf16" if is_low(dtype) else "float32"


def master_dtype(dtype):
    """The dtype the optimizer updates in for a model of ``dtype``: float32 for a 16-bit one, else itself."""
    return np.dtype(np.float32) if is_low(dtype) else np.dtype(dtype)


def squared_sum(values, scratch=None):
    """``sum(values ** 2)`` as a Python float, accumulated in float32 at least.

    A 16-bit dot product rounds its result to 16 bits: fp16's is Inf past
    65504 (a scaled gradient's squared norm is past it at once), bfloat16's
    keeps 3 digits.  16-bit values are widened a block at a time into
    ``scratch`` (a float32 array of :data:`BLOCK` or more; else one is made).
    """
    if not is_low(values.dtype):
        return float(values.dot(values))
    xp = _array_module(values)
    if xp is not np:  # (a device: one reduction kernel in float32, no host loop)
        return float(xp.sum(xp.square(values, dtype=np.float32), dtype=np.float32))
    if scratch is None:
        scratch = np.empty(min(BLOCK, values.size), np.float32)
    total = 0.0
    for lo in range(0, values.size, scratch.size):
        part = values[lo : lo + scratch.size]
        wide = scratch[: part.size]
        wide[...] = part
        total += float(wide.dot(wide))
    return total


def _array_module(values):
    """numpy, or cupy for a device array."""
    return np if isinstance(values, np.ndarray) else __import__("cupy")


class MasterWeights:
    """The float32 parameters an optimizer updates, for a model that computes in 16 bits.

    Args:
        model: the model (its ``params`` are the 16-bit copy the passes read).
        running: ``(lo, hi)`` ranges of the buffer that forward passes write (BatchNorm's running
            statistics): the model's values are the ones that hold there, taken into the master before it is
            rounded back or read.
    """

    def __init__(self, model, running=()):
        self.model, self.running = model, list(running)
        size = model.num_params
        #: the parameters the optimizer updates (what checkpoints hold)
        self.params = aligned.zeros(model.xp, size, np.float32)
        #: the summed gradient, widened and unscaled (what the optimizer reads)
        self.grads = aligned.zeros(model.xp, size, np.float32)

    @property
    def nbytes(self):
        """Bytes of the two float32 copies."""
        return int(self.params.nbytes + self.grads.nbytes)

    def widened(self, grads, factor):
        """``grads`` (16-bit) times ``factor``, in float32: the gradient the optimizer reads.

        Widened first, multiplied after: an fp16 gradient of a scaled loss
        unscaled in fp16 would underflow where its float32 value does not.
        """
        self.grads[...] = grads
        if factor != 1.0:
            self.grads *= np.float32(factor)
        return self.grads

    def narrow(self):
        """The model's 16-bit parameters become the master rounded (to nearest even)."""
        self.current()
        self.model.params[...] = self.params

    def current(self):
        """The master, with the running statistics the forward passes wrote since: what a checkpoint
        keeps."""
        for lo, hi in self.running:
            self.params[lo:hi] = self.model.params[lo:hi]
        return self.params

    def take(self, values):
        """The master becomes ``values`` (float32, a checkpoint's or a draw's), and the model its rounding."""
        if values is not self.params:
            self.params[...] = values
        self.model.params[...] = self.params
