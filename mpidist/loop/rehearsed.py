"""What a rank's passes hold under a run's layout: its layers rehearsed on the run's batches, and what runs
beside them (the loss, the batches in flight, a pipeline stage's buffers).

:func:`~mpidist.nn.rehearsal.rehearse` measures the layers; this module says
which layers a rank runs (the whole model, a pipeline stage's, a tensor
part's: :func:`layers_of`), on how many samples (a slice of ``--accumulate``,
a pipeline's micro-batch, held once for each micro-batch its schedule keeps
in flight: :func:`in_flight`), and adds what the layers' rehearsal does not
see, each a product of shapes the run fixes:

* the loss's arrays: a training step keeps the log-probabilities, the
  probabilities and their gradient (three of the model's outputs) in the
  workspace; an evaluation makes two, the scores a mask and a row each;
* the batches in flight: a prefetcher's queue of two, the one it fills, the
  one the step trains on, each a whole local batch (a global one on the
  in-graph chief), as the data holds them;
* a pipeline stage's buffers: the activations it receives and the gradients
  it sends back, for each micro-batch in flight, and an evaluation's.
"""

import dataclasses
import math

import numpy as np

from ..nn import rehearsal, tensor
from ..parallel.mesh import MeshShape
from ..parallel.pipeline import schedule
from ..parallel.pipeline.balance import balance_by_parameters, layer_costs, parse_balance
from ..parallel.pipeline.stage import StageLayout

BATCHES_IN_FLIGHT = 4  # (data.batches.Prefetcher's depth of two, the one it fills, the one trained on)
EVALUATION_BATCH = 1024  # samples an evaluation runs through the model at once (data.batches.eval_batches)
LOSS_ARRAYS = 3  # a loss's arrays of the model's outputs a training step keeps (softmax cross-entropy's)


@dataclasses.dataclass(frozen=True)
class Arrays:
    """Bytes a rank's passes hold: a training step's, an evaluation batch's, and the largest activations it
    hands to MPI (a tensor group's sum, a stage's send)."""

    step: int = 0
    evaluation: int = 0
    activations: int = 0


def rank_arrays(settings, rank, size, model, info, local_batch, evaluated, whole_batch=None):
    """The :class:`Arrays` of rank ``rank`` of ``size`` running ``model`` (a map of shapes) under
    ``settings``: ``local_batch`` samples a step (0: none), ``evaluated`` an evaluation batch (0: none),
    ``whole_batch`` the samples of a batch its data hands it (default ``local_batch``; the in-graph chief's
    are global)."""
    itemsize = model.dtype.itemsize
    layers, layout = layers_of(settings, rank, size, model)
    slots, batch = 1, max(1, local_batch // max(1, int(getattr(settings, "accumulate", 1))))
    if layout is not None:
        micro = int(settings.micro_batches)
        batch = max(1, math.ceil(local_batch / micro))
        slots = in_flight(settings.schedule, layout.stage, layout.stages, micro)
    passes = rehearsal.rehearse(layers, batch if local_batch else 0, evaluated)
    outputs = int(np.prod(model.output_shape))
    sample = int(np.prod(model.input_shape)) * itemsize + 8 * (info.target_width + 1)
    step = evaluation = 0
    if local_batch:
        inflight = BATCHES_IN_FLIGHT * (whole_batch or local_batch) * sample
        step = passes.step * slots + LOSS_ARRAYS * batch * outputs * itemsize + inflight
    if evaluated:
        evaluation = passes.evaluation + evaluated * (outputs * (2 * itemsize + 1) + 16 + 2 * sample)
    if layout is not None:  # (what a stage receives and sends back, a slot each; an evaluation's receipt)
        edges = int(np.prod(layout.in_shape)) + int(np.prod(layout.out_shape))
        step += slots * batch * edges * itemsize if local_batch else 0
        evaluation += evaluated * int(np.prod(layout.in_shape)) * itemsize
    widest = max(int(np.prod(shape)) for shape in [*model.shapes[1:], model.output_shape])
    return Arrays(step, evaluation, max(batch, evaluated) * widest * itemsize)


def layers_of(settings, rank, size, model):
    """``(layers, layout)``: the model whose layers this rank of ``size`` runs under ``settings`` (a map of
    shapes: ``model``, a pipeline stage's, or a tensor part's), and its stage's
    :class:`~mpidist.parallel.pipeline.stage.StageLayout` (None outside a pipeline)."""
    parts, layers, layout = max(1, int(settings.tensor)), model, None
    part = MeshShape(size, parts=parts).coordinates(rank)[2]
    if settings.strategy == "pipeline":
        balance = parse_balance(settings, model) or balance_by_parameters(layer_costs(model), settings.stages)
        layout = StageLayout(model, balance, rank, size, parts)
        layers, part = layout.stage_model(model), layout.part
    if parts > 1:  # (this part's layers: a split layer's arrays are its part's)
        layers = tensor.split_model(layers, part, parts, buffers=False)[0]
    return layers, layout


def in_flight(name, stage, stages, micro_batches):
    """The most micro-batches stage ``stage`` holds at once under schedule ``name``."""
    held = peak = 0
    for op, _ in schedule.schedule(name, stage, stages, micro_batches):
        held += {"fwd": 1, "bwd": -1}.get(op, 0)
        peak = max(peak, held)
    return max(peak, 1)
