"""``bench --layers``: where a training step's time goes, layer by layer, in mpidist and in torch.

Both frameworks take whole training steps of the same model from the same
parameters, alternating step by step on one process; inside each step a
clock reads the time at every top-level layer's boundaries:

* mpidist: each layer of the model's list is wrapped (:class:`TimedLayer`)
  for the step, so its ``forward`` and ``backward`` calls are timed exactly;
* torch: forward hooks before and after each module, and a hook on each
  module's output tensor, called when its gradient arrives (a module's
  backward runs from there to the same moment of the module before it, or
  to the end of ``backward()`` for the first).

What is left of the step (the loss, the update, the framework's own
bookkeeping) is its own row.  On a GPU (``device="cuda"``: gpu/bench.py's
``layers``) each clock reading waits for the GPU first, so a layer's time is
its kernels', not their launches' (the waits slow both frameworks' steps
alike).  A layer that computes no input gradient (the
first trained one: nothing below it learns) shows only its parameters'.
"""

import time

import numpy as np

from ..parallel import LocalStrategy
from . import reference, rows


class TimedLayer:
    """``layer``, its ``forward``, ``backward`` and ``backward_params`` calls adding their seconds to
    ``times``; every other attribute is the layer's own.  ``clock``: the time now, once the device has
    done what it was given (:func:`clock_of`)."""

    def __init__(self, layer, times, clock=time.perf_counter):
        self.layer, self.times, self.clock = layer, times, clock

    def forward(self, x, training=False):
        start = self.clock()
        y = self.layer.forward(x, training)
        self.times[0] += self.clock() - start
        return y

    def backward(self, dy):
        start = self.clock()
        dx = self.layer.backward(dy)
        self.times[1] += self.clock() - start
        return dx

    def backward_params(self, dy):
        start = self.clock()
        self.layer.backward_params(dy)
        self.times[1] += self.clock() - start

    def __getattr__(self, name):
        return getattr(self.layer, name)


def clock_of(wait=None):
    """A clock reading the time once ``wait()`` (a device's synchronisation) returned; the host's clock
    alone for None."""
    if wait is None:
        return time.perf_counter

    def clock():
        wait()
        return time.perf_counter()

    return clock


def _mpidist_clock(local, x, y, clock=time.perf_counter):
    """A step function of ``local`` (mpidist's one process) training on ``(x, y)``, returning ``(per-layer
    [forward, backward] seconds, step seconds)``; its model's layers are timed from now on."""
    model = local.model
    times = np.zeros((len(model.layers), 2))
    model.layers = [TimedLayer(layer, times[index], clock) for index, layer in enumerate(model.layers)]
    counter = iter(range(1 << 30))

    def step():
        times[...] = 0
        start = clock()
        local.train_step(x, y, 1.0, next(counter))
        return times.copy(), clock() - start

    return step


def _torch_clock(model, x, y, device="cpu"):
    """The same for torch, from ``model``'s parameters; None without torch or a translation."""
    made = reference.torch_trainer(model, x, y, device=device)
    if made is None:
        return None
    import torch

    net, train = made
    modules = list(net)
    marks = {}
    now = clock_of(torch.cuda.synchronize if device != "cpu" else None)

    def mark(key):
        def hook(*_):
            marks[key] = now()

        return hook

    def leaving(index):
        def hook(module, inputs, output):
            marks[("out", index)] = now()
            if output.requires_grad:  # its gradient arrives: the module's backward starts
                output.register_hook(mark(("back", index)))

        return hook

    # (a hook on each output tensor rather than torch's module backward hooks, which wrap every output in
    # autograd functions of their own and cost the cnn's step a third more)
    for index, module in enumerate(modules):
        module.register_forward_pre_hook(mark(("in", index)))
        module.register_forward_hook(leaving(index))

    def step():
        marks.clear()
        start = now()
        train(mark("done"))
        times = np.zeros((len(modules), 2))
        following = marks["done"]  # the lowest module's backward ends where backward() returned
        for index in range(len(modules)):
            times[index, 0] = marks[("out", index)] - marks[("in", index)]
            if ("back", index) in marks:  # (none for a module below every parameter: a Flatten first)
                times[index, 1] = following - marks[("back", index)]
                following = marks[("back", index)]
        return times, now() - start

    return step


def layer_rows(name, batch, seconds, xp=np):
    """Rows of ``name``'s layers (and the rest of the step, and the step), medians of ``seconds`` of
    steps alternating between mpidist and torch; on a GPU with ``xp`` cupy (torch on ``"cuda"``)."""
    model, x, y = rows._problem(name, batch, 0, xp)
    optimizer = lambda size: rows.nn.make_optimizer("sgd", size, 0.01, xp=xp)  # noqa: E731
    local = LocalStrategy(model, rows.nn.loss_for(10, xp), optimizer, seed=0)
    local.initialize()
    device = "cpu" if xp is np else "cuda"
    theirs = _torch_clock(model, x, y, device)  # (from the parameters mpidist starts with)
    clock = clock_of(None if xp is np else xp.cuda.get_current_stream().synchronize)
    layers, ours = list(model.layers), _mpidist_clock(local, xp.asarray(x), xp.asarray(y), clock)
    clocks = {"mpidist": ours} if theirs is None else {"mpidist": ours, "torch": theirs}
    samples = {label: [] for label in clocks}
    for clock in clocks.values():
        clock()  # warm-up: first-touch allocations, caches
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples["mpidist"]) < 5:
        for label, clock in clocks.items():
            samples[label].append(clock())
    medians = {}
    for label, taken in samples.items():
        per_layer = np.median(np.stack([times for times, _ in taken]), axis=0)
        step = float(np.median([total for _, total in taken]))
        rest = float(np.median([total - times.sum() for times, total in taken]))
        medians[label] = (per_layer, step, rest)
    table = [
        _row(name, str(index), repr(layer), index_of=index, medians=medians)
        for index, layer in enumerate(layers)
    ]
    table.append(_row(name, "", "loss, update, the rest", medians=medians, rest=True))
    table.append(_row(name, "", "training step", medians=medians, whole=True))
    return table


def _row(name, index, what, medians, index_of=None, rest=False, whole=False):
    row = {"model": name, "layer": index, "what": what[:48]}
    totals = {}
    for label, (per_layer, step, left) in medians.items():
        if whole:
            totals[label] = step
        elif rest:
            totals[label] = left
        else:
            forward, backward = (float(t) for t in per_layer[index_of])
            row[f"{label}_forward_ms"], row[f"{label}_backward_ms"] = 1e3 * forward, 1e3 * backward
            totals[label] = forward + backward
        row[f"{label}_ms"] = 1e3 * totals[label]
    if totals.get("mpidist") and "torch" in totals:
        row["vs_torch"] = totals["torch"] / totals["mpidist"]
    return row


COLUMNS = [
    ("model", "model", "{}"),
    ("layer", "#", "{}"),
    ("what", "layer", "{}"),
    ("mpidist_forward_ms", "mpidist fwd ms", "{:.3f}"),
    ("torch_forward_ms", "torch fwd ms", "{:.3f}"),
    ("mpidist_backward_ms", "mpidist bwd ms", "{:.3f}"),
    ("torch_backward_ms", "torch bwd ms", "{:.3f}"),
    ("mpidist_ms", "mpidist ms", "{:.3f}"),
    ("torch_ms", "torch ms", "{:.3f}"),
    ("vs_torch", "vs torch", "{:.2f}"),
]
