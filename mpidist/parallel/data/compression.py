"""Gradient compression: an exchange that moves 16-bit gradients, with error feedback.

``--compress fp16`` or ``bf16`` halves the bytes an ``allreduce`` step moves.
Each bucket of gradients is rounded to 16 bits before it is sent and summed in
16 bits (an MPI reduction operation of mpidist's own, since MPI has no 16-bit
float sum), then widened back into the float32 buffer.  What the rounding
drops is not lost: each worker keeps it (*error feedback*, as in 1-bit SGD and
Horovod's compressors with residuals) and adds it to its next step's gradients
before they are rounded, so over steps every bit of every gradient arrives.

The weighted loss rides in its own float32 reduction: it is a figure the run
reports, not a gradient to round.

* ``fp16``: IEEE half precision, 10-bit mantissa, range up to 65504 (gradients
  beyond it become Inf, and the step is skipped as any non-finite step is);
* ``bf16``: bfloat16, float32's range with an 8-bit mantissa (rounded to
  nearest even).
"""

import numpy as np
from mpi4py import MPI

from ...runtime import bfloat16, comm as mpi
from ...runtime.bfloat16 import from_bf16, to_bf16
from ...runtime.errors import RunError
from .exchange import Exchange


class Codec:
    """One 16-bit format: how float32 narrows to it and widens back, and how MPI sums it.

    Its working arrays are kept between calls (grown to the largest part
    seen): fresh multi-megabyte arrays would be page-faulted in on every call.
    """

    def __init__(self, name):
        self.name = name
        # (bfloat16's sum is the runtime's, shared with --precision bf16; fp16's rounds once, from float32)
        self._own = name == "fp16"
        self.op = MPI.Op.Create(self._sum, commute=True) if self._own else bfloat16.sum_op()
        self._work = np.empty((3, 0), np.float32)

    def _arrays(self, size):
        """Three float32 working arrays of ``size`` elements (the third doubles as uint32)."""
        if self._work.shape[1] < size:
            self._work = np.empty((3, size), np.float32)
        return self._work[0, :size], self._work[1, :size], self._work[2, :size]

    def narrow(self, values, out):
        if self.name == "fp16":
            # beyond 65504 is Inf: the step is then skipped, as any non-finite one
            with np.errstate(over="ignore"):
                out.view(np.float16)[...] = values
            return out
        return to_bf16(values, out, self._arrays(values.size)[2].view(np.uint32))

    def widen(self, patterns, out):
        if self.name == "fp16":
            out[...] = patterns.view(np.float16)
            return out
        return from_bf16(patterns, out)

    def _sum(self, incoming, inout, datatype):
        """fp16's reduction callback (bf16's op is the runtime's, the same arithmetic): ``inout += incoming``,
        both 16-bit patterns, summed in float32 and rounded."""
        a = np.frombuffer(incoming, dtype=np.uint16)
        b = np.frombuffer(inout, dtype=np.uint16)
        wide_a, wide_b, _ = self._arrays(a.size)
        self.widen(a, wide_a)
        self.widen(b, wide_b)
        wide_b += wide_a
        self.narrow(wide_b, b)

    def free(self):
        if self._own and self.op != MPI.OP_NULL:
            self.op.Free()


class CompressedExchange(Exchange):
    """:class:`Exchange` of 16-bit buckets with error feedback (``compress``: "fp16" or "bf16")."""

    def __init__(self, comm, buffer, bucket_bytes, compress, overlap=True):
        if not isinstance(buffer, np.ndarray):
            raise RunError(
                f"--compress {compress} works on host (numpy) gradients; run with --compress none on GPUs"
            )
        self.gradients = buffer[:-1]
        # a bucket of 16-bit values is half as long in bytes: cut the same element ranges a float32 one would
        super().__init__(comm, buffer, bucket_bytes, overlap)
        self.buckets = [
            (lo, min(hi, self.gradients.size)) for lo, hi in self.buckets if lo < self.gradients.size
        ]
        self.codec = Codec(compress)
        self.residual = np.zeros_like(self.gradients)  # what rounding dropped, sent next step
        self.patterns = np.empty(self.gradients.size, np.uint16)  # the 16-bit values sent
        self.bytes_per_step = int(self.patterns.nbytes + buffer.itemsize)
        self._loss = None

    def own_state(self):
        """The rounding error this worker sends with its next step: each worker's own, kept in checkpoints."""
        return {"residual": self.residual}

    def begin(self):
        super().begin()
        self._loss = None

    def _start(self, lo, hi):
        self._mark(lo, hi)
        if self._loss is None:  # the first bucket is the top one: the loss is known by now
            self._loss = mpi.iallreduce_sum(self.comm, self.buffer[-1:])
        part, residual, patterns = self.gradients[lo:hi], self.residual[lo:hi], self.patterns[lo:hi]
        part += residual  # error feedback: last step's rounding error goes out now
        self.codec.narrow(part, patterns)
        self.codec.widen(patterns, residual)  # (the residual array holds the rounded values for a moment)
        with np.errstate(invalid="ignore"):  # (Inf - Inf: a step that will be skipped, its residual dropped)
            np.subtract(part, residual, out=residual)
        pending = mpi.iallreduce(
            self.comm, patterns, self.codec.op, then=lambda: self.codec.widen(patterns, part)
        )
        self._pending.append(((lo, hi), pending))

    def finish(self):
        super().finish()
        if self._loss is not None:
            self._loss.wait()
        if not self.finite():
            # the step is skipped, its gradients dropped: so is what they left behind (an fp16 overflow
            # would otherwise leave an infinite residual that poisons every later step)
            self.residual[...] = 0

    def free(self):
        self.codec.free()
