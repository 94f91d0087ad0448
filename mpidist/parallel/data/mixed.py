"""A data-parallel worker's 16-bit model trained through a float32 master copy (``--precision bf16|fp16``).

The worker's passes, gradients and exchange are the model's, in 16 bits;
this object owns what sits around them: the float32 master the optimizer
updates (:class:`~mpidist.nn.precision.MasterWeights`), fp16's loss scale
(:class:`~mpidist.nn.loss_scale.LossScale`, moved by each step's verdict),
and the start from a draw or a checkpoint, the same on every worker.
"""

import numpy as np

from ...nn.loss_scale import LossScale
from ...nn.precision import MasterWeights, precision_of
from ...runtime import comm as mpi


class MixedPrecision:
    """The master copy and the loss scale of ``model`` (16-bit; ``running``: its ranges forward passes
    write)."""

    def __init__(self, model, running=()):
        self.model = model
        self.master = MasterWeights(model, running)
        #: what the loss is multiplied by before backward (fp16's dynamic scale; 1 under bf16)
        self.loss_scale = LossScale.for_precision(precision_of(model.dtype))

    def initialize(self, comm, seed, checkpoint=None):
        """Collective over ``comm`` (None: this worker alone): the master from the float32 draw of ``seed``
        or ``checkpoint``'s values on the chief, the same on every worker; the model its rounding."""
        model, master = self.model, self.master.params
        if comm is None or comm.Get_rank() == 0:
            if checkpoint is not None:
                master[...] = model.xp.asarray(checkpoint.params)
            elif model.xp is np:  # (drawn in float32: the draw a float32 run starts from)
                model.initial_values(seed, range(model.num_params), out=master)
            else:
                drawn = np.empty(model.num_params, np.float32)
                master[...] = model.xp.asarray(model.initial_values(seed, range(model.num_params), out=drawn))
        if comm is not None:
            mpi.bcast(comm, master, root=0)
        self.master.take(master)

    def judged(self, verdict):
        """After a step's verdict: fp16's scale halves where the step overflowed (was skipped), and grows
        after a run of clean ones."""
        self.loss_scale = self.loss_scale.after(verdict.skip)

    def gradient(self, grads, verdict):
        """The summed 16-bit ``grads`` in float32, multiplied by the verdict's clipping factor with the loss
        scale taken out (widened first: unscaled in fp16, a small gradient would flush to zero)."""
        return self.master.widened(grads, verdict.multiplier)

    def step(self, optimizer, grads, lr):
        """The optimizer's step on the master; the model's parameters become its rounding."""
        optimizer.step(self.master.params, grads, lr)
        self.master.narrow()

    def stats(self):
        """Where fp16's loss scale ended (how close the gradients came to fp16's range); none under bf16."""
        return {"loss_scale": self.loss_scale.value} if self.loss_scale.dynamic else {}
