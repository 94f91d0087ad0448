"""One rule for every strategy: whether a step's update is skipped, and by what factor it is clipped.

Each layout holds its summed gradient its own way -- whole on every worker
(``allreduce``, ``local``), a shard on each ps (``ps-sync``, backup
workers), a stage's or a tensor part's share on each rank (``pipeline``,
``--tensor``), each worker's own under ``local-sgd`` and ``ps-async`` -- so
each sums the squared norm over its own group, inside a collective it makes
anyway where it can (see :mod:`mpidist.parallel.recipe`).  What it decides
from that sum is the same everywhere and is decided here, once:

* the step is skipped where the gradient's squared norm or the loss is not
  finite (a NaN or Inf anywhere makes the squared norm so);
* otherwise the gradient is scaled by :func:`~mpidist.parallel.recipe.clip_factor`
  of the squared norm (1.0: within ``--clip-norm``, or no clipping).

Under fp16's loss scaling (:mod:`mpidist.nn.loss_scale`) the gradient summed
is ``scale`` times the true one: the rule reads the true squared norm (the sum
divided by ``scale**2``), and the factor the update applies divides ``scale``
out too; an overflow is a step that is not finite, skipped like any other.

:func:`decide` is the rule (pure, tested by a table); :func:`agree` sums
each rank's share over a group first, in one ``Allreduce`` that may carry a
few more numbers the strategy needs summed at the same moment (a pipeline's
loss), as torchtitan's one ``clip_grad_norm_`` serves every layout.
"""

import dataclasses
import math

import numpy as np

from ..runtime import comm as mpi
from .recipe import clip_factor


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A step's verdict.

    Attributes:
        skip: no update is applied (a NaN or Inf in the gradients or the loss).
        squared_norm: the gradient's squared global norm, as summed (NaN or Inf where skipped).
        factor: the clipping factor (1.0: not clipped).
        unscale: ``1 / loss scale``: what takes fp16's loss scaling out of the gradient (1.0: none).
    """

    skip: bool
    squared_norm: float
    factor: float = 1.0
    unscale: float = 1.0

    @property
    def clipped(self):
        """Whether the update applied is clipped."""
        return not self.skip and self.factor < 1.0

    @property
    def multiplier(self):
        """What the summed gradient is multiplied by before the update: the clipping factor, the loss scale
        taken out."""
        return self.factor * self.unscale

    def scaled(self, grads, out=None, xp=np):
        """``grads`` multiplied by :attr:`multiplier`: in place, or into ``out`` (of the array module ``xp``)
        where ``grads`` must stay as it is (other workers still read it: the shared-memory exchange);
        ``grads`` itself where the multiplier is 1."""
        multiplier = self.multiplier
        if multiplier == 1.0:
            return grads
        if out is None:
            grads *= multiplier
            return grads
        return xp.multiply(grads, multiplier, out=out)


def decide(squared_norm, loss, clip_norm, scale=1.0):
    """The verdict on a step whose gradient has squared global norm ``squared_norm`` and whose loss is
    ``loss``; ``scale``: the loss scale the gradient was taken at (fp16), 1 elsewhere.

    >>> decide(25.0, 0.5, 1.0)
    Verdict(skip=False, squared_norm=25.0, factor=0.2, unscale=1.0)
    >>> decide(float("nan"), 0.5, 1.0).skip
    True
    >>> decide(400.0, 0.5, 1.0, scale=4.0)
    Verdict(skip=False, squared_norm=25.0, factor=0.2, unscale=0.25)
    """
    squared_norm, loss, scale = float(squared_norm), float(loss), float(scale)
    if not (math.isfinite(squared_norm) and math.isfinite(loss)):
        return Verdict(True, squared_norm, unscale=1.0 / scale)
    squared_norm /= scale * scale
    return Verdict(False, squared_norm, clip_factor(squared_norm, clip_norm), 1.0 / scale)


def agree(group, squares, loss, clip_norm, carry=(), copies=1, scale=1.0):
    """Collective over ``group`` (None: this rank alone): the verdict on the ranks' summed shares.

    Args:
        squares: this rank's share of the gradient's squared norm.
        loss: a loss this rank knows, or 0.0 (only whether it is finite counts: ``0 x loss`` is summed).
        carry: more numbers summed in the same ``Allreduce`` (returned summed).
        copies: how many ranks of ``group`` hold each share alike (a pipeline's replicas): the sum is divided.
        scale: the loss scale the gradient was taken at (see :func:`decide`).

    Returns:
        ``(Verdict, the sums of carry as a float64 array)``.
    """
    values = np.array([squares, 0.0 * float(loss), *carry], dtype=np.float64)
    if group is not None:
        mpi.allreduce_sum(group, values)
    return decide(values[0] / copies, values[1], clip_norm, scale), values[2:]
