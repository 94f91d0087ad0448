"""Layers, losses, models and optimizers: gradients against finite differences,
convolution and pooling against straightforward loops."""

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import Conv2D, Dense, Dropout, Flatten, MaxPool2D, ReLU, Sequential, Tanh


def check_model_gradients(layers, input_shape, batch=3, seed=0, training=False, x=None):
    """Backprop of sum(out * r) against finite differences, for params and input
    (:func:`mpidist.nn.check_gradients`).

    ``x`` replaces the random normal input (e.g. token ids); returns the model.
    """
    return nn.check_gradients(layers, input_shape, batch=batch, seed=seed, training=training, x=x)


@pytest.mark.parametrize(
    "layers,shape",
    [
        ([Dense(5)], (4,)),
        ([Dense(5, init="glorot"), Tanh(), Dense(3)], (4,)),
        ([Dense(6), ReLU(), Dense(2)], (3,)),
        ([Flatten(), Dense(3)], (2, 3)),
        ([Dense(5), Tanh(), Dense(3)], (4, 6)),  # a sequence of 4 tokens, mapped token by token
        ([Dense(5, bias=False)], (3,)),
        ([Conv2D(3, 3)], (2, 5, 5)),
        ([Conv2D(2, 3, stride=2, padding=0)], (1, 7, 7)),
        ([Conv2D(2, 2, stride=1, padding=1)], (2, 4, 4)),
        ([MaxPool2D(2)], (2, 4, 4)),
        ([MaxPool2D(2)], (1, 5, 5)),
        ([Conv2D(2, 3), ReLU(), MaxPool2D(2), Flatten(), Dense(3)], (1, 6, 6)),
    ],
)
def test_layer_gradients_match_finite_differences(layers, shape):
    check_model_gradients(layers, shape)


def test_dropout_gradient_matches_finite_differences_with_a_fixed_mask():
    check_model_gradients([Dense(6), Dropout(0.5), Dense(2)], (3,), training=True)


def test_dropout_scales_kept_units_and_is_identity_in_evaluation():
    layer = Dropout(0.25)
    layer.xp, layer.rng = np, np.random.default_rng(0)
    x = np.ones((2000, 10))
    y = layer.forward(x, training=True)
    kept = y != 0
    assert np.allclose(y[kept], 1 / 0.75)
    assert abs(kept.mean() - 0.75) < 0.02
    assert layer.forward(x, training=False) is x


def reference_conv(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    f, _, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    out = np.zeros((n, f, ho, wo))
    for i in range(n):
        for o in range(f):
            for r in range(ho):
                for s in range(wo):
                    patch = xp[i, :, r * stride : r * stride + k, s * stride : s * stride + k]
                    out[i, o, r, s] = (patch * w[o]).sum() + b[o]
    return out


@pytest.mark.parametrize("stride,padding,kernel", [(1, 1, 3), (2, 0, 3), (1, 0, 1), (2, 2, 5)])
def test_conv_matches_a_direct_loop(stride, padding, kernel):
    rng = np.random.default_rng(1)
    layer = Conv2D(4, kernel, stride=stride, padding=padding)
    model = Sequential([layer], (3, 9, 8), xp=np, dtype=np.float64)
    model.params[...] = rng.normal(size=model.num_params)
    x = rng.normal(size=(2, 3, 9, 8))
    expected = reference_conv(x, layer.params["W"], layer.params["b"], stride, padding)
    np.testing.assert_allclose(model.forward(x), expected, rtol=1e-12, atol=1e-12)


def test_maxpool_matches_a_direct_loop_and_crops_partial_windows():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 7, 6))
    pool = Sequential([MaxPool2D(3)], (3, 7, 6), xp=np, dtype=np.float64)
    out = pool.forward(x)
    assert out.shape == (2, 3, 2, 2)
    for r in range(2):
        for s in range(2):
            np.testing.assert_array_equal(
                out[:, :, r, s], x[:, :, 3 * r : 3 * r + 3, 3 * s : 3 * s + 3].max(axis=(2, 3))
            )


def test_maxpool_sends_a_tied_gradient_to_one_position_only():
    pool = Sequential([MaxPool2D(2)], (1, 2, 2), xp=np, dtype=np.float64)
    pool.forward(np.ones((1, 1, 2, 2)))
    dx = pool.backward(np.ones((1, 1, 1, 1)))
    assert dx.sum() == 1.0 and dx[0, 0, 0, 0] == 1.0


def loss_check(loss, out, target):
    value = lambda: float(loss.forward(out, target))  # noqa: E731
    value()
    numeric = nn.gradcheck.numeric_gradient(value, out)
    np.testing.assert_allclose(loss.backward(scale=0.3), 0.3 * numeric, rtol=1e-6, atol=1e-9)


def test_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(3)
    logits, labels = rng.normal(size=(5, 4)), np.array([0, 3, 1, 1, 2])
    loss = nn.SoftmaxCrossEntropy(np)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert np.isclose(float(loss.forward(logits, labels)), -np.log(p[np.arange(5), labels]).mean())
    loss_check(loss, logits, labels)
    assert loss.correct(np.eye(4)[[0, 1, 2, 3, 0]], np.array([0, 1, 2, 0, 0])) == 4


def test_cross_entropy_is_stable_for_huge_logits():
    loss = nn.SoftmaxCrossEntropy(np)
    assert np.isfinite(float(loss.forward(np.array([[1e4, 0.0], [0.0, -1e4]]), np.array([0, 0]))))


def test_mse_value_and_gradient():
    rng = np.random.default_rng(4)
    pred, target = rng.normal(size=(6, 2)), rng.normal(size=(6, 2))
    loss = nn.MeanSquaredError(np)
    assert np.isclose(float(loss.forward(pred, target)), ((pred - target) ** 2).mean())
    loss_check(loss, pred, target)
    one = rng.normal(size=(6, 1))
    assert np.isclose(float(loss.forward(one, one[:, 0] + 1.0)), 1.0)  # (N,) targets for one output


def test_parameters_and_gradients_are_views_of_the_flat_buffers():
    model = Sequential([Dense(3), ReLU(), Dense(2)], (4,), xp=np, dtype=np.float32)
    assert model.num_params == 4 * 3 + 3 + 3 * 2 + 2
    model.params[:] = np.arange(model.num_params)
    first = model.layers[0]
    np.testing.assert_array_equal(first.params["W"].ravel(), np.arange(12))
    np.testing.assert_array_equal(model.layers[2].params["b"], [21, 22])  # after 12 + 3 + 6
    bigger = np.zeros(model.num_params + 1, dtype=np.float32)
    model.bind_grads(bigger)
    model.forward(np.ones((2, 4), np.float32))
    model.backward(np.ones((2, 2), np.float32))
    assert bigger[:-1].any() and bigger[-1] == 0
    assert np.shares_memory(first.grads["W"], bigger)


def test_initialisation_depends_only_on_the_seed():
    a = nn.build_model("mlp", (8, 8), 10, np, np.float32)
    b = nn.build_model("mlp", (8, 8), 10, np, np.float32)
    a.init_params(5)
    b.init_params(5)
    np.testing.assert_array_equal(a.params, b.params)
    b.init_params(6)
    assert not np.array_equal(a.params, b.params)


def test_sgd_momentum_matches_closed_form():
    opt = nn.SGD(2, lr=0.1, momentum=0.5, dtype=np.float64)
    p, g = np.array([1.0, -1.0]), np.array([2.0, 4.0])
    opt.step(p, g)  # v = g, p -= 0.1 g
    np.testing.assert_allclose(p, [0.8, -1.4])
    opt.step(p, g)  # v = 0.5 g + g = 1.5 g
    np.testing.assert_allclose(p, [0.8 - 0.3, -1.4 - 0.6])


def test_adam_first_step_moves_each_parameter_by_lr():
    opt = nn.Adam(3, lr=0.01, dtype=np.float64)
    p = np.zeros(3)
    opt.step(p, np.array([5.0, -0.2, 1e-3]))
    np.testing.assert_allclose(p, [-0.01, 0.01, -0.01], rtol=1e-4)
    assert opt.steps == 1 and set(opt.state_arrays()) == {"m", "v"}


def test_optimizer_state_round_trips():
    a, b = nn.Adam(4), nn.Adam(4)
    p = np.ones(4, np.float32)
    a.step(p, np.arange(4, dtype=np.float32))
    b.load_state({k: v.copy() for k, v in a.state_arrays().items()}, a.steps)
    q = p.copy()
    a.step(p, np.ones(4, np.float32))
    b.step(q, np.ones(4, np.float32))
    np.testing.assert_array_equal(p, q)


def fit_one_batch(spec, sample_shape, classes, steps):
    """``(first loss, last loss)`` of Adam fitting zoo model ``spec`` to one random batch of 32."""
    model = nn.build_model(spec, sample_shape, classes, np, np.float32)
    model.init_params(0)
    loss = nn.loss_for(classes, np)
    opt = nn.make_optimizer("adam", model.num_params, 0.01)
    rng = np.random.default_rng(0)
    x = rng.random((32,) + model.input_shape, dtype=np.float32)
    y = rng.integers(0, classes, 32)
    values = []
    for step in range(steps):
        model.reseed(0, step)
        values.append(float(loss.forward(model.forward(x, training=True), y)))
        model.backward(loss.backward())
        opt.step(model.params, model.grads)
    return values[0], values[-1]


@pytest.mark.parametrize("name", list(nn.MODELS))
def test_every_zoo_model_trains_on_images(name):
    # 50 steps: the transformer's tokens of 5 rows of uniform [0, 1) noise start alike and plateau near 2.1
    # for ~25 steps before it memorises the batch (0.11 at step 50; the others are below half by step 30)
    first, last = fit_one_batch(name, (8, 8), 10, steps=50)
    assert last < 0.5 * first


def test_cnn_on_volumes_is_a_shape_error_naming_the_shapes():
    with pytest.raises(nn.ShapeError, match=r"cnn.*\(2, 3, 4, 5\)"):
        nn.build_model("cnn", (2, 3, 4, 5), 10, np, np.float32)


def test_dense_on_images_without_flatten_is_a_shape_error():
    with pytest.raises(nn.ShapeError, match="layer 0 .*Flatten"):
        Sequential([Dense(3)], (1, 2, 2))


def test_dense_maps_each_token_of_a_sequence_alike_and_may_leave_its_bias_out():
    model = Sequential([Dense(3, bias=False)], (4, 2), dtype=np.float64)
    model.init_params(0)
    x = np.random.default_rng(1).random((5, 4, 2))
    out = model.forward(x)
    assert out.shape == (5, 4, 3) and model.num_params == 6
    np.testing.assert_allclose(out[:, 2], model.forward(x[:, 2:3])[:, 0], rtol=1e-12)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_the_one_kernel_update_a_gpu_runs_is_the_hosts_blocked_update_to_rounding(name):
    """mpidist.nn.fused's functions, run by numpy, give what the host's blocks give (a GPU runs them fused):
    SGD's to the bit, Adam's to float32's rounding (its denominator's terms are not stored in float32 between
    operations, as a block's are)."""
    from mpidist.nn import fused

    size = 3 * (1 << 17) + 5  # (three blocks and a bit)
    rng = np.random.default_rng(4)
    optimizer = nn.make_optimizer(name, size, 0.01, momentum=0.9)
    params = rng.standard_normal(size).astype(np.float32)
    mine = params.copy()
    state = {key: np.zeros(size, np.float32) for key in optimizer.state_arrays()}
    for step in range(1, 4):
        grads = rng.standard_normal(size).astype(np.float32)
        optimizer.step(params, grads)
        if name == "adam":
            b1, b2 = optimizer.beta1, optimizer.beta2
            unbias, step_size = 1.0 / np.sqrt(1 - b2**step), optimizer.lr / (1 - b1**step)
            fused.adam_update(mine, grads, state["m"], state["v"], b1, b2, step_size, unbias, optimizer.eps)
        else:
            fused.sgd_update(mine, grads, state["velocity"], optimizer.momentum, optimizer.lr)
    exact = name == "sgd"
    close = (
        np.testing.assert_array_equal
        if exact
        else lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    )
    close(mine, params)
    for key, array in optimizer.state_arrays().items():
        np.testing.assert_array_equal(state[key], array)  # (the moments: the same operations, in order)
    assert not np.array_equal(params, rng.standard_normal(size).astype(np.float32))


def test_a_timed_layer_is_its_layer_to_every_reader_and_waits_on_its_clock():
    """bench --layers' wrapper: every attribute the layer's own; its clock (a device's, on a GPU) read before
    and after each pass."""
    from mpidist.bench.layers import TimedLayer, clock_of

    model = nn.Sequential([nn.Dense(3), nn.ReLU()], (4,), xp=np, dtype=np.float64)
    times, waits = np.zeros(2), []
    timed = TimedLayer(model.layers[0], times, clock_of(lambda: waits.append(1)))
    assert timed.params is model.layers[0].params and timed.units == 3
    out = timed.forward(np.ones((2, 4)), training=True)
    timed.backward(np.ones_like(out))
    assert len(waits) == 4 and (times >= 0).all()


def test_one_layer_object_at_two_places_of_a_model_is_refused_naming_both():
    """Its second place overwrote the first's caches and gradients: training ran on wrong gradients."""
    from mpidist.nn.sequential import RepeatedLayer

    shared = nn.Dense(8)
    with pytest.raises(RepeatedLayer, match=r"Dense\(8\), is at \(0,\) and at \(2,\)"):
        nn.Sequential([shared, nn.ReLU(), shared], (8,), xp=np, dtype=np.float32)
    relu = nn.ReLU()
    nn.Sequential([nn.Dense(8), relu, nn.Dense(8), nn.ReLU()], (4,), xp=np, dtype=np.float32)
    with pytest.raises(RepeatedLayer, match="ReLU"):
        nn.Sequential([nn.Dense(8), relu, nn.Dense(8), relu], (4,), xp=np, dtype=np.float32)
