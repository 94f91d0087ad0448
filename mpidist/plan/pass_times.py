"""A training pass's seconds on rank 0 alone, as lines through batch sizes (a fixed cost and a cost per
sample).

What ``plan --calibrate`` times of the model itself, apart from the ranks it runs on
(:mod:`~mpidist.plan.measure` takes these lines into the calibration): each top-level layer's forward and
backward, the loss, and the whole pass, at a few batch sizes timed in interleaved rounds, a line fitted
through each; the layers' lines scaled to add up to the whole pass's, the steadier measurement.  Its own
module because how a pass is timed (rounds, workspace slots, the fit) is one concern, apart from what the
calibration does with the figures and from what two ranks measure together (:mod:`~mpidist.plan.pairs`).
"""

import time

import numpy as np

REPEATS = 7  # timed repeats at least, for a median: every measurement of a calibration, the pairs' too


def median_seconds(fn, repeats=REPEATS):
    """``(median seconds, every repeat's seconds)`` of ``repeats`` calls of ``fn``, after one untimed."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), times


def _interleaved(workspace, sizes, seconds, measure):
    """``{size: [measure(size) each round]}``, in rounds of every size in turn for ``seconds`` (at least
    ``REPEATS`` rounds): a drift of the machine while it measures then moves every size alike, where sizes
    measured one after the other took it as a cost of their samples (a small layer's cost per sample, 0.2 us,
    adds only a few microseconds across the sizes).  Each size keeps its own ``workspace`` slot, as a step's
    slices of two sizes do: no pass reallocates its arrays, as no training pass does."""
    at = {size: [] for size in sizes}
    try:
        for slot, size in enumerate(sizes):  # (a round first, untimed: each slot's arrays are made)
            workspace.slot = slot
            measure(size)
        deadline = time.perf_counter() + seconds
        while len(at[sizes[-1]]) < REPEATS or time.perf_counter() < deadline:
            for slot, size in enumerate(sizes):
                workspace.slot = slot
                at[size].append(measure(size))
    finally:
        workspace.slot = 0
    return at


def layer_lines(model, loss, x, y, sizes, seconds):
    """Per layer, forward and backward ``(fixed, per sample)`` seconds fitted over ``sizes`` from the medians
    of passes interleaved over ``seconds``; the loss's too."""
    at = _interleaved(
        model.workspace, sizes, seconds, lambda size: _timed_pass(model, loss, x[:size], y[:size])
    )
    medians = {size: [np.median(np.array(values), axis=0) for values in zip(*at[size])] for size in sizes}
    lines = [
        [_line(sizes, [medians[size][which][index] for size in sizes]) for index in range(len(model.layers))]
        for which in range(2)
    ]
    return lines[0], lines[1], _line(sizes, [medians[size][2] for size in sizes])


def whole_line(model, loss, x, y, sizes, seconds):
    """``(fixed, per sample)`` of a whole training pass (forward, loss, backward as training runs them), from
    the medians of passes interleaved over ``seconds``: steadier than the sum of the layers' own lines."""

    def timed_pass(n):
        start = time.perf_counter()
        out = model.forward(x[:n], training=True)
        loss.forward(out, y[:n])
        model.backward(loss.backward(), input_grad=False)
        return time.perf_counter() - start

    at = _interleaved(model.workspace, sizes, seconds, timed_pass)
    return _line(sizes, [float(np.median(at[size])) for size in sizes])


def scaled(forward, backward, losses, whole):
    """The layers' lines (and the loss's) scaled so that they add up to the whole pass's ``whole`` line: each
    layer keeps its share, the total is the steadier measurement."""
    parts = list(forward) + list(backward) + [losses]
    factors = []
    for column in range(2):
        total = sum(part[column] for part in parts)
        factors.append(whole[column] / total if total > 0 else 1.0)
    scale = lambda part: (part[0] * factors[0], part[1] * factors[1])  # noqa: E731
    return [scale(f) for f in forward], [scale(b) for b in backward], scale(losses)


def _line(sizes, seconds):
    """``(fixed, per sample)``, neither below zero, through ``seconds`` measured at ``sizes`` samples."""
    if len(sizes) == 1:
        return 0.0, float(seconds[0]) / sizes[0]
    slope, fixed = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), 1)
    if slope < 0:
        return float(np.median(seconds)), 0.0
    if fixed < 0:
        return 0.0, float(np.median(np.asarray(seconds) / np.asarray(sizes)))
    return float(fixed), float(slope)


def _timed_pass(model, loss, x, y):
    """One training pass, each top-level layer timed: ``(forward s per layer, backward s per layer, loss
    s)``."""
    model.workspace.active = True
    forward, backward = np.zeros(len(model.layers)), np.zeros(len(model.layers))
    out = x
    for index, layer in enumerate(model.layers):
        start = time.perf_counter()
        out = layer.forward(out, True)
        forward[index] = time.perf_counter() - start
    start = time.perf_counter()
    loss.forward(out, y)
    grad = loss.backward()
    spent = time.perf_counter() - start
    # as training runs it: backward stops at the first layer with parameters, without its input gradient
    for index in range(len(model.layers) - 1, model.first_trained - 1, -1):
        start = time.perf_counter()
        if index == model.first_trained:
            model.layers[index].backward_params(grad)
        else:
            grad = model.layers[index].backward(grad)
        backward[index] = time.perf_counter() - start
    return forward, backward, spent
