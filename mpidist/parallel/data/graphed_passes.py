"""A worker's forward and backward pass on a GPU, replayed as one CUDA graph where the model allows it.

:class:`GraphedPasses` gives :class:`~mpidist.parallel.passes.Passes` a pass
that reads its batch from fixed device buffers and leaves its loss and its
training count in fixed scalars (:class:`PassRecord`), so that
:class:`~mpidist.nn.graphs.PassGraphs` may capture it once per shape and
replay it after.  What the pass does is the eager pass's, step for step;
only where its figures land differs, and the loss's scale is a device
scalar (the last partial batch's weight and fp16's loss scale change without
a capture).

A dropout layer's draws read their key from device memory
(:mod:`mpidist.nn.draws`): a replay draws the step's own mask.  A model's
passes stay eager (:func:`why_eager` says why) where a pass cannot be a
graph: MPI inside the pass (tensor parts, synchronised batch norms,
gathered parameter shards), ``--accumulate``'s slices (their loss is summed
on the host), an Embedding (its token ids are checked on the host), or
``MPIDIST_GRAPHS=0``.  No MPI here: a data-parallel exchange starts once
the pass's launch is queued (every bucket is then ready at once).
"""

import dataclasses

import numpy as np

from ...nn.capture import PassKey
from ...nn.embedding import Embedding
from ...nn.graphs import CudaGraphs, PassGraphs
from ...nn.parameter_map import walk
from ...runtime.xp import turned_off


@dataclasses.dataclass
class PassRecord:
    """The fixed arrays of one shape's pass: its inputs, the loss's scale, and its figures."""

    x: object
    y: object
    scale: object  # 0-d, float64: the gradient is that of ``scale x loss``
    loss: object  # 0-d, the loss's dtype
    tally: object  # 0-d, float64: correct answers, or the summed absolute error


def why_eager(model, accumulate=1, collective=False):
    """Why ``model``'s training passes run eagerly (None: they may be graphs).

    Args:
        accumulate: ``--accumulate``'s slices.
        collective: whether the pass holds MPI calls of the strategy's (a tensor part's).
    """
    if turned_off("MPIDIST_GRAPHS"):
        return "MPIDIST_GRAPHS=0"
    if model.xp is np:
        return "arrays on the host"
    synced = any(getattr(node, "reduce", None) is not None for _, node in walk(model.layers))
    if collective or synced or model.gate is not None:
        return "MPI inside the pass (tensor parts, synchronised batch norms or gathered parameters)"
    if accumulate > 1:
        return "--accumulate (each slice's loss is read on the host)"
    if any(isinstance(node, Embedding) for _, node in walk(model.layers)):
        return "an Embedding (it checks each batch's token ids on the host)"
    return None


def address(array):
    """Where ``array``'s data starts (device or host memory): a key's buffers."""
    face = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return face["data"][0]


class GraphedPasses:
    """The training pass of :class:`~mpidist.parallel.passes.Passes` through ``graphs``.

    Args:
        passes: the worker's passes (their model, loss and training figures).
        device: what captures (default: :class:`~mpidist.nn.graphs.CudaGraphs` of the model's cupy).
    """

    def __init__(self, passes, device=None):
        self.passes = passes
        device = CudaGraphs(passes.model.xp) if device is None else device
        self.graphs = PassGraphs(device, objects=self.objects)

    def objects(self):
        """The objects a pass changes: what its graph pins, and a refused capture puts back."""
        passes = self.passes
        layers = (node for _, node in walk(passes.model.layers))
        return [self, passes, passes.loss, passes.model.workspace, *layers]

    def backprop(self, x, y, weight, before_backward=None, ready=None):
        """:meth:`~mpidist.parallel.passes.Passes.backprop`'s single pass as a graph's launch; returns the
        loss (a 0-d device array, overwritten by the next pass of this shape)."""
        passes, model = self.passes, self.passes.model
        key = PassKey(
            "train",
            (tuple(x.shape), tuple(y.shape), str(x.dtype), str(y.dtype)),
            str(model.dtype),
            buffers=(address(model.params), address(model.grads)),
        )
        record = self.graphs.record(key, lambda: self._made(x, y))
        record.x[...] = x
        record.y[...] = y
        record.scale[...] = weight
        self.graphs.run(key, self._work)
        passes.counts[0] = passes.counts[0] + record.tally
        passes.counts[1] += passes.positions(y, len(x))
        if before_backward is not None:  # (after the pass: its gradients are all ready together)
            before_backward(record.loss)
        if ready is not None:
            ready(0)
        return record.loss

    def _made(self, x, y):
        xp = self.passes.model.xp
        return PassRecord(
            xp.empty(x.shape, x.dtype),  # (the batch may come from the host: its copy lands here)
            xp.empty(y.shape, y.dtype),
            xp.zeros((), np.float64),
            xp.zeros((), np.float64),
            xp.zeros((), np.float64),
        )

    def _work(self, record):
        """The pass, from and into ``record``: what a capture records and a replay recomputes."""
        passes = self.passes
        out = passes.model.forward(record.x, training=True)
        record.loss[...] = passes.loss.forward(out, record.y)
        record.tally[...] = passes.tally(out, record.y)
        passes.model.backward(passes.loss.backward(scale=record.scale), input_grad=False)
