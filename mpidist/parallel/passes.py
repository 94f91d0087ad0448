"""A worker's training passes: forward and backward over its batch, in ``--accumulate``'s slices, and the
training figures they count.

Every strategy whose workers compute gradients of a whole model (all but a
pipeline's stages, which run their schedule) takes its gradients from
:meth:`Passes.backprop`; the loop reads the figures through
:meth:`Passes.take_counts`.  No MPI here.
"""

import numpy as np

from ..nn import SoftmaxCrossEntropy
from ..runtime.recorder import tracer

TRACER = tracer()


class Passes:
    """Forward and backward passes of ``model`` under ``loss``.

    Args:
        accumulate: slices a batch goes through one after the other (``--accumulate``).
        seed: the run's seed (dropout streams derive from it, the worker and the step).
    """

    def __init__(self, model, loss, accumulate=1, seed=0):
        self.model, self.loss, self.accumulate, self.seed = model, loss, accumulate, seed
        self.accumulated = None  # --accumulate: the earlier slices' gradients (made on the first such step)
        self.counts = [0.0, 0]  # (correct or absolute error, samples) of this worker's batches, since read
        #: a GPU's pass as a CUDA graph (:class:`~mpidist.parallel.data.graphed_passes.GraphedPasses`), set
        #: by a strategy whose passes may be; None: eager
        self.graphed = None

    def backprop(self, x, y, weight, step, stream, before_backward=None, ready=None):
        """Forward and backward on this worker's batch; fills ``model.grads``; returns the loss.

        With ``--accumulate K`` the batch goes through in ``K`` slices, one after
        the other, each weighted by its share: ``model.grads`` ends as the
        gradient of the whole batch (equal to one pass, to rounding), while the
        activations held at any time are one slice's.

        Args:
            stream: the worker's dropout stream (its index among the workers that see different data).
            before_backward: called with the loss once it is known, before backward starts.
            ready: called with ``lo`` each time backward has finished ``grads[lo:]``
                (see :meth:`mpidist.nn.Sequential.backward`).
        """
        model = self.model
        if self.graphed is not None:  # (no --accumulate there; dropout's keys are written before the launch)
            model.reseed(self.seed, stream, step)
            with TRACER.span("forward and backward", "compute"):
                return self.graphed.backprop(x, y, weight, before_backward, ready)
        if min(self.accumulate, len(x)) <= 1:
            model.reseed(self.seed, stream, step)
            with TRACER.span("forward", "compute"):
                loss = self.forward(x, y)
            if before_backward is not None:
                before_backward(loss)
            with TRACER.span("backward", "compute"):
                model.backward(self.loss.backward(scale=weight), input_grad=False, ready=ready)
            return loss
        if self.accumulated is None:
            self.accumulated = model.xp.zeros(model.num_params, dtype=model.dtype)
        accumulated, grads, n = self.accumulated, model.grads, len(x)
        loss = 0.0
        for index, lo, hi, last in self.slices(n, step, stream):
            with TRACER.span("forward", "compute", slice=index):
                loss += float(self.forward(x[lo:hi], y[lo:hi])) * (hi - lo) / n
            if last and before_backward is not None:
                before_backward(loss)
            top = [model.num_params]

            def add_earlier(lo_ready):  # the last slice: add the earlier ones' sum as each part is final
                grads[lo_ready : top[0]] += accumulated[lo_ready : top[0]]
                top[0] = lo_ready
                if ready is not None:
                    ready(lo_ready)

            with TRACER.span("backward", "compute", slice=index):
                model.backward(
                    self.loss.backward(scale=weight * (hi - lo) / n),
                    input_grad=False,
                    ready=add_earlier if last else None,
                )
            if index == 0:
                accumulated[...] = grads
            elif not last:
                accumulated += grads
        return loss

    def slices(self, n, step, stream):
        """``(index, lo, hi, last)`` of each ``--accumulate`` slice of a batch of ``n`` samples, the model
        reseeded for it and its workspace slot set (back to 0 once they are through).

        One slice where the batch is not cut; its dropout streams are then the step's own, as they were
        before ``--accumulate`` existed."""
        model, slices = self.model, min(self.accumulate, n)
        if slices <= 1:
            model.reseed(self.seed, stream, step)
            yield 0, 0, n, True
            return
        bounds = np.linspace(0, n, slices + 1).round().astype(int)
        largest = int(np.diff(bounds).max())
        for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            model.reseed(self.seed, stream, step, index)
            # slices of two sizes (an uneven split) each keep their own arrays: none is reallocated per slice
            model.workspace.slot = 0 if hi - lo == largest else 1
            yield index, int(lo), int(hi), index == slices - 1
        model.workspace.slot = 0

    def in_step(self, items):
        """``items`` (a pass's batches, or anything a forward pass is run for), as this worker must run them:
        as they come, or where its model's forward passes are collective (its ``gate``: ``--shard
        parameters``), in step with the other workers
        (:meth:`~mpidist.parallel.data.gathering.UnitGathers.in_step`)."""
        gate = self.model.gate
        return items if gate is None else gate.in_step(items)

    def forward(self, x, y):
        """A training forward pass and its loss; counts this worker's training accuracy (or absolute
        error)."""
        out = self.model.forward(x, training=True)
        loss = self.loss.forward(out, y)
        self.count(out, y)
        return loss

    def count(self, out, y):
        """Add a batch's correct answers (classification) or absolute error (regression) to the training
        figures.

        Call right after the loss's forward on ``out``: regression reads the loss's differences.  The sum
        stays where the arrays are: on a GPU a device scalar, read once by :meth:`take_counts` (a read per
        step made the host wait for the forward pass before it could queue the backward).
        """
        self.counts[0] = self.counts[0] + self.tally(out, y)
        self.counts[1] += self.positions(y, len(out))

    def tally(self, out, y):
        """A batch's correct answers, or its absolute error averaged over the outputs (right after the loss's
        forward on ``out``): a 0-d array where the arrays are."""
        if isinstance(self.loss, SoftmaxCrossEntropy):  # samples (or tokens) whose top output is the label
            return self.loss.correct(out, y)
        # (summed in float64, as the figures are: a float32 sum drifts over many steps)
        error = abs(self.loss.diff).sum(dtype=np.float64)
        return error / max(out.size // max(len(out), 1), 1)

    def positions(self, y, samples):
        """What :meth:`tally` counts over: labelled positions (classification), or ``samples``."""
        return self.loss.positions(y) if isinstance(self.loss, SoftmaxCrossEntropy) else samples

    def take_counts(self):
        """``(correct or summed absolute error, samples)`` since the last call, this worker's own."""
        counts, self.counts = self.counts, [0.0, 0]
        return [float(counts[0]), counts[1]]
