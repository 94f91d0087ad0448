"""Gradients against finite differences: the check every layer of :mod:`mpidist.nn` passes, for your own."""

import numpy as np

from .sequential import Sequential, walk


class GradientError(AssertionError):
    """A backward pass that disagrees with finite differences; the message names the worst entry."""


def numeric_gradient(f, array, eps=1e-6):
    """Central differences ``(f(a + eps) - f(a - eps)) / 2 eps`` of scalar ``f()`` for every entry of
    ``array``.

    ``array`` is changed in place, one entry at a time, and put back.
    """
    grad = np.zeros_like(array)
    flat, out = array.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        saved = flat[i]
        flat[i] = saved + eps
        plus = f()
        flat[i] = saved - eps
        minus = f()
        flat[i] = saved
        out[i] = (plus - minus) / (2 * eps)
    return grad


def _worst(analytic, numeric, rtol, atol):
    """``(excess, flat index)`` of the entry furthest outside ``|a - n| <= atol + rtol |n|`` (excess <= 0:
    none)."""
    excess = np.abs(analytic - numeric) - (atol + rtol * np.abs(numeric))
    index = int(np.argmax(excess)) if excess.size else 0
    return (float(excess.reshape(-1)[index]) if excess.size else -np.inf), index


def check_gradients(
    layers,
    input_shape,
    batch=3,
    seed=0,
    training=False,
    x=None,
    input_grad=True,
    rtol=1e-5,
    atol=1e-7,
    eps=1e-6,
):
    """Check the backward pass of ``layers`` against central finite differences, in float64.

    The layers (one :class:`~mpidist.nn.Layer` or a list, blocks included)
    become a :class:`~mpidist.nn.Sequential` on numpy in float64, with
    parameters from their initialisers plus N(0, 0.1) noise (so that zero
    biases and unit scales are not a special case).  For the scalar
    ``sum(forward(x) * r)``, ``r`` a fixed random array of the output's shape,
    the gradients ``backward(r)`` writes for every parameter, and the input
    gradient it returns, must match central differences of step ``eps``
    entry by entry: ``|backward - numeric| <= atol + rtol * |numeric|``
    (numpy's ``assert_allclose`` rule).  In float64 a correct backward is
    within about 1e-9; a wrong one is off by far more than the tolerance.

    Random layers (Dropout) are reseeded before every forward pass, so each
    pass draws the same mask.  The check costs two forward passes per
    parameter and input entry: keep the layers and the batch small.

    Args:
        layers: a layer or a list of layers, applied in order.
        input_shape: one sample's shape (no batch axis).
        batch: samples in the batch.
        seed: for the parameters, the input and ``r``.
        training: run ``forward(x, training=True)`` (Dropout active).
        x: the input in place of N(0, 1) samples (e.g. token ids: an
            ``Embedding``'s ids, with ``input_grad=False``).
        input_grad: also check the input gradient.
        rtol, atol: tolerances, as above.
        eps: the finite-difference step.

    Returns:
        The checked :class:`~mpidist.nn.Sequential` (float64, on numpy).

    Raises:
        GradientError: an ``AssertionError`` naming the worst entry: which
            parameter of which layer (or the input), its index, both values.
    """
    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    rng = np.random.default_rng(seed)
    model = Sequential(layers, input_shape, xp=np, dtype=np.float64)
    model.init_params(seed)
    model.params += rng.normal(0, 0.1, model.num_params)
    x = rng.normal(size=(batch,) + tuple(input_shape)) if x is None else np.array(x, dtype=np.float64)
    r = rng.normal(size=(x.shape[0],) + model.output_shape)

    def objective():
        model.reseed(7)
        return float((model.forward(x, training) * r).sum())

    objective()
    dx = model.backward(r.copy(), input_grad=input_grad)
    analytic = model.grads.copy()
    numeric = numeric_gradient(objective, model.params, eps)
    excess, index = _worst(analytic, numeric, rtol, atol)
    if excess > 0:
        where = _parameter_at(model, index)
        raise GradientError(
            f"{where}: backward gives {analytic[index]:.9g}, finite differences "
            f"{numeric[index]:.9g} (off by {abs(analytic[index] - numeric[index]):.3g}, more than "
            f"atol {atol:g} + rtol {rtol:g} x |numeric|)"
        )
    if input_grad:
        if dx is None or np.shape(dx) != x.shape:
            raise GradientError(
                f"backward returns an input gradient of shape {np.shape(dx)}, the input is {x.shape}"
            )
        numeric = numeric_gradient(objective, x, eps)
        excess, index = _worst(np.asarray(dx), numeric, rtol, atol)
        if excess > 0:
            at = np.unravel_index(index, x.shape)
            raise GradientError(
                f"the input gradient at {tuple(int(i) for i in at)}: backward gives "
                f"{np.asarray(dx)[at]:.9g}, finite differences {numeric[at]:.9g} (off by "
                f"{abs(np.asarray(dx)[at] - numeric[at]):.3g}, more than atol {atol:g} + rtol "
                f"{rtol:g} x |numeric|)"
            )
    return model


def _parameter_at(model, index):
    """Which parameter entry flat ``index`` of ``model.params`` is, in words."""
    paths = {id(layer): path for path, layer in walk(model.layers)}
    for layer, name, lo, shape, _ in model.entries:
        size = int(np.prod(shape))
        if lo <= index < lo + size:
            at = tuple(int(i) for i in np.unravel_index(index - lo, shape))
            path = ".".join(map(str, paths[id(layer)]))
            return f"parameter {name!r}{list(at)} of layer {path} ({layer!r})"
    return f"parameter entry {index}"
