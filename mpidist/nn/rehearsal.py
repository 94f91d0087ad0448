"""What a model's passes allocate, measured by running its layers once, one at a time, before a run holds
anything.

A training step keeps its arrays in the model's workspace (activations, masks,
gradients flowing back, a convolution's column matrix), an evaluation
allocates its own (each layer's output, and what it keeps for a backward that
never comes), and both depend on the layer: an attention's scores are heads x
L x L per sample where its output is L x width.  A formula per layer would be
one more place to keep true; running the layer is exact.  :func:`rehearse`
runs each top-level layer of a range, alone, on zeros of the run's batch, with
its parameters in arrays of its own for as long as it runs, and measures with
:mod:`tracemalloc` (numpy reports its arrays' memory to it) what the layer
keeps and what it takes for a moment:

* a step holds every layer's workspace at once, and one layer's passing arrays
  on top (the largest);
* an evaluation holds every layer's output and what it keeps, and one layer's
  passing arrays on top.

A rehearsal holds one layer's parameters and arrays at a time, never more
than the run will, and lets go of all of it before it returns; its numbers
are what :mod:`mpidist.loop.pricing` prices a run's step and evaluations by.
Host arrays only: on a GPU the passes' arrays are the device's.
"""

import contextlib
import dataclasses
import tracemalloc

import numpy as np

from ..runtime.errors import UsageError
from .parameter_map import walk
from .workspace import Workspace


#: samples an evaluation's rehearsal runs, and twice as many, to carry what they hold on to a whole batch
PROBE = 64


@dataclasses.dataclass(frozen=True)
class Passes:
    """Bytes a model's passes hold: a training step's (every layer's workspace and the largest passing
    arrays) and an evaluation batch's (every layer's output and caches, and the largest passing arrays)."""

    step: int = 0
    evaluation: int = 0


def rehearse(model, batch, evaluation_batch, first=0, last=None):
    """The :class:`Passes` of ``model``'s top-level layers ``first`` to ``last`` (exclusive; default: all) on
    ``batch`` samples a step (0: no step) and ``evaluation_batch`` an evaluation (0: no evaluation).

    ``model`` may be a map of shapes (no buffers): each layer gets parameters of its own for its rehearsal,
    and its bindings are put back after.  Host (numpy) models only; a GPU model's passes hold device memory,
    and its rehearsal is :class:`Passes` of nothing.
    """
    if model.xp is not np or (batch <= 0 and evaluation_batch <= 0):
        return Passes()
    last = len(model.layers) if last is None else last
    shapes = list(model.shapes) + [model.output_shape]
    # (zeros make NaN and Inf where a layer divides or a mask hides every position: not the run's business)
    with np.errstate(all="ignore"):
        # (first a pass of one sample, not counted nor traced: what a layer does once in a process, compiling
        # its kernels or loading them, is no step's; then each pass runs the layers in order on one batch
        # size: a layer reading a mask an earlier one made, the padding of a sequence, finds it made for its
        # own batch)
        _pass(model, first, last, shapes, _training(1, model.dtype))
        tracing = not tracemalloc.is_tracing()
        if tracing:
            tracemalloc.start()
        step = _pass(model, first, last, shapes, _training(batch, model.dtype)) if batch else []
        evaluation = (
            _scaled(
                [
                    _pass(model, first, last, shapes, _inference(n, model.dtype))
                    for n in _sizes(evaluation_batch)
                ],
                evaluation_batch,
            )
            if evaluation_batch
            else []
        )
    if tracing:
        tracemalloc.stop()
    return Passes(_total(step), _total(evaluation))


def _pass(model, first, last, shapes, measure):
    """``[(kept, passing)]`` of ``measure(layer, input_shape)`` for each top-level layer, in order, each with
    parameters of its own for the while."""
    held = []
    for index in range(first, last):
        with _alone(model, model.layers[index]):
            try:
                held.append(measure(model.layers[index], shapes[index], shapes[index + 1]))
            except BrokenContract as err:
                raise UsageError(f"layer {index} ({model.layers[index]!r}): {err}") from None
    return held


def _training(batch, dtype):
    return lambda layer, shape, out_shape: _measured(layer, shape, out_shape, batch, dtype, training=True)


def _inference(batch, dtype):
    return lambda layer, shape, out_shape: _measured(layer, shape, out_shape, batch, dtype, training=False)


def _sizes(batch):
    """The evaluation batches a rehearsal runs: ``batch`` itself, or :data:`PROBE` and twice that."""
    return [batch] if batch <= 2 * PROBE else [PROBE, 2 * PROBE]


def _scaled(passes, batch):
    """Each layer's ``(kept, passing)`` for an evaluation of ``batch`` samples: measured, or carried on from
    :data:`PROBE` samples and twice that (an evaluation batch's pass costs a second on a transformer): what a
    pass holds grows with its samples by a constant amount each, or stops growing (a convolution's blocks),
    so the growth from one to the other, carried on to ``batch``, bounds it from above."""
    if len(passes) == 1:
        return passes[0]
    few, more = passes
    return [
        tuple(b + max(0, b - a) * (batch - 2 * PROBE) // PROBE for a, b in zip(small, large))
        for small, large in zip(few, more)
    ]


def _total(layers):
    """What a pass holds at most: every layer's kept bytes, and the largest passing bytes."""
    return sum(kept for kept, _ in layers) + max((passing for _, passing in layers), default=0)


def _measured(layer, input_shape, output_shape, batch, dtype, training):
    """``(kept, passing)`` bytes of one pass of ``layer`` on ``batch`` zeros (a training pass: forward and
    backward, kept in a workspace of its own; else a forward, kept as its output and caches).  A forward
    that returns no array of ``(batch, *output_shape)`` (what the layer's build said) is refused."""
    x = np.zeros((batch, *input_shape), dtype=dtype)
    workspace = Workspace(np)
    workspace.active = training
    with _workspace(layer, workspace):
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = layer.forward(x, training)
        _check_output(layer, out, (batch, *output_shape))
        if training:
            dy = np.zeros(out.shape, dtype=out.dtype)
            start += dy.nbytes  # (the step's own: the next layer's input gradient, counted there)
            layer.backward(dy)
            del dy
        now, peak = tracemalloc.get_traced_memory()
        kept = workspace.nbytes if training else now - start
        result = kept, max(0, peak - start - kept)
        del out
        _forget(layer)
    return result


class BrokenContract(Exception):
    """A layer's forward returned what its build did not promise (the rehearsal names the layer)."""


def _check_output(layer, out, expected):
    """Refuse a forward's result that is not the array of ``expected`` shape its layer's build promised (a
    user's layer that returned None failed later, in another layer, with a traceback)."""
    shape = getattr(out, "shape", None)
    if shape is None or tuple(shape) != tuple(expected):
        got = f"an array of {tuple(shape)}" if shape is not None else repr(type(out).__name__)
        raise BrokenContract(
            f"its forward returned {got} for a batch of {expected[0]} samples, where its build said each "
            f"sample's output is {tuple(expected[1:])}: forward returns the batch's outputs, (N, *the shape "
            "build returned)"
        )


def _forget(layer):
    """Drop what a pass left in ``layer`` and its sublayers for a backward (their caches)."""
    for _, node in walk([layer]):
        for name in getattr(node, "cache", ()):
            if hasattr(node, name):
                setattr(node, name, None)


@contextlib.contextmanager
def _alone(model, layer):
    """``layer`` (and its sublayers) with parameters and gradients of their own, zeros, for the body; their
    bindings as they were after."""
    nodes = {id(node) for _, node in walk([layer])}
    owned = [(node, name, shape) for node, name, _, shape, _ in model.entries if id(node) in nodes]
    saved = [(node, name, node.params.get(name), node.grads.get(name)) for node, name, _ in owned]
    try:
        for node, name, shape in owned:
            node.params[name] = np.zeros(shape, dtype=model.dtype)
            node.grads[name] = np.zeros(shape, dtype=model.dtype)
        yield
    finally:
        for node, name, params, grads in saved:
            for table, value in ((node.params, params), (node.grads, grads)):
                if value is None:
                    table.pop(name, None)
                else:
                    table[name] = value


@contextlib.contextmanager
def _workspace(layer, workspace):
    """``layer``'s tree computing into ``workspace`` for the body, then into its own again."""
    nodes = [node for _, node in walk([layer])]
    saved = [node.workspace for node in nodes]
    try:
        for node in nodes:
            node.workspace = workspace
        yield
    finally:
        for node, before in zip(nodes, saved):
            node.workspace = before
