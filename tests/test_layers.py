"""The newer layers (1-D convolution, pooling, activations, normalisation,
embedding, residual blocks) and zoo specs: gradients against finite
differences, outputs against straightforward loops and formulas."""

import re
import threading
import warnings

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import (
    GELU,
    AvgPool1D,
    AvgPool2D,
    BatchNorm,
    Conv1D,
    Conv2D,
    Dense,
    Dropout,
    Embedding,
    Flatten,
    GlobalAvgPool,
    LayerNorm,
    MaxPool1D,
    MaxPool2D,
    ReLU,
    Residual,
    Sequential,
    Sigmoid,
    Tanh,
)

from mpidist.nn.rectifier import ZEROS, rectify
from test_nn import check_model_gradients, fit_one_batch


@pytest.mark.parametrize(
    "layers,shape",
    [
        ([Conv1D(3, 3)], (2, 7)),
        ([Conv1D(2, 3, stride=2, padding=0)], (1, 9)),
        ([Conv1D(2, 4)], (2, 6)),  # even kernel, asymmetric "same"
        ([Conv1D(2, 2, stride=2, padding=1)], (2, 5)),
        ([Conv2D(2, 4)], (2, 5, 5)),  # even kernel, asymmetric "same"
        ([Conv2D(2, 2, stride=2)], (1, 5, 4)),
        ([Conv2D(1, 3)], (1, 5, 5)),  # one channel in and out: windows gathered per kernel offset
        ([Conv1D(1, 3), ReLU(), Conv1D(1, 3, stride=2, padding=1)], (1, 9)),
        ([MaxPool1D(2)], (2, 6)),
        ([MaxPool1D(3)], (1, 8)),  # crops the remainder
        ([AvgPool1D(2)], (2, 7)),
        ([AvgPool2D(2)], (2, 4, 5)),
        ([AvgPool2D(3)], (1, 7, 6)),
        ([GlobalAvgPool()], (3, 5)),
        ([GlobalAvgPool()], (2, 3, 4)),
        ([Dense(5), GELU(), Dense(2)], (3,)),
        ([Dense(5), Sigmoid(), Dense(2)], (3,)),
        ([LayerNorm(), Dense(2)], (4,)),
        ([LayerNorm()], (3, 5)),  # normalises the last axis of each row
        ([Dense(4), LayerNorm(), Tanh(), Dense(2)], (3,)),
        ([Conv1D(4, 5), ReLU(), MaxPool1D(2), Conv1D(3, 3), ReLU(), GlobalAvgPool(), Dense(2)], (1, 12)),
    ],
)
def test_layer_gradients_match_finite_differences(layers, shape):
    check_model_gradients(layers, shape)


BLOCKED = {  # (fresh layers each time: a built layer belongs to its model)
    "conv2d": (lambda: [Conv2D(3, 3)], (2, 5, 5)),
    "strided": (lambda: [Conv2D(2, 3, stride=2, padding=1)], (3, 7, 6)),  # the column gradient added back
    "one channel": (lambda: [Conv2D(2, 3)], (1, 6, 6)),  # windows gathered per kernel offset
    "conv1d even kernel": (lambda: [Conv1D(2, 4)], (2, 9)),
    "gelu": (lambda: [Dense(9), GELU(), Dense(2)], (3,)),
}


def _in_small_blocks(monkeypatch):
    """Blocks of two samples (a batch of 5: the last one shorter) and GELU's of 7 elements."""
    from mpidist.nn import activations, conv

    monkeypatch.setattr(conv, "block_of", lambda xp, samples, bytes_per_sample: min(samples, 2))
    monkeypatch.setattr(activations, "BLOCK_ELEMENTS", 7)


@pytest.mark.parametrize("name", BLOCKED)
def test_layers_working_block_by_block_match_finite_differences(monkeypatch, name):
    layers, shape = BLOCKED[name]
    _in_small_blocks(monkeypatch)
    check_model_gradients(layers(), shape, batch=5)


@pytest.mark.parametrize("name", BLOCKED)
def test_a_batch_worked_block_by_block_equals_it_worked_whole(monkeypatch, name):
    """In a training pass (the workspace's arrays): the output, the input gradient and the parameter
    gradients of a batch in blocks are those of the whole batch at once."""

    def passes():
        layers, shape = BLOCKED[name]
        model = Sequential(layers(), shape, np, np.float64)
        model.init_params(4)
        rng = np.random.default_rng(5)
        x = rng.standard_normal((5,) + shape)
        y = model.forward(x, training=True).copy()
        dx = model.backward(rng.standard_normal(y.shape)).copy()
        return y, dx, model.grads.copy()

    whole = passes()
    _in_small_blocks(monkeypatch)
    for blocked, expected in zip(passes(), whole):
        np.testing.assert_allclose(blocked, expected, rtol=1e-12, atol=1e-14)


# --- convolutions and pooling against loops -----------------------------------------------------------------


def reference_conv1d(x, w, b, stride, pads):
    n, c, length = x.shape
    f, _, k = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), pads))
    lo = (length + sum(pads) - k) // stride + 1
    out = np.zeros((n, f, lo))
    for i in range(n):
        for o in range(f):
            for r in range(lo):
                out[i, o, r] = (xp[i, :, r * stride : r * stride + k] * w[o]).sum() + b[o]
    return out


@pytest.mark.parametrize(
    "stride,padding,kernel,pads",
    [
        (1, "same", 3, (1, 1)),
        (2, 0, 3, (0, 0)),
        (1, 0, 1, (0, 0)),
        (2, 2, 5, (2, 2)),
        (1, "same", 4, (1, 2)),
        (3, "same", 2, (0, 1)),
    ],
)
def test_conv1d_matches_a_direct_loop(stride, padding, kernel, pads):
    rng = np.random.default_rng(1)
    layer = Conv1D(4, kernel, stride=stride, padding=padding)
    model = Sequential([layer], (3, 11), xp=np, dtype=np.float64)
    model.params[...] = rng.normal(size=model.num_params)
    x = rng.normal(size=(2, 3, 11))
    expected = reference_conv1d(x, layer.params["W"], layer.params["b"], stride, pads)
    np.testing.assert_allclose(model.forward(x), expected, rtol=1e-12, atol=1e-12)


def test_even_kernel_same_conv2d_pads_one_more_after_as_tensorflow_does():
    rng = np.random.default_rng(2)
    layer = Conv2D(2, 4)
    model = Sequential([layer], (1, 6, 5), xp=np, dtype=np.float64)
    model.params[...] = rng.normal(size=model.num_params)
    x = rng.normal(size=(1, 1, 6, 5))
    padded = np.pad(x, ((0, 0), (0, 0), (1, 2), (1, 2)))
    out = model.forward(x)
    for o in range(2):
        for r in range(6):
            for s in range(5):
                expected = (
                    padded[0, 0, r : r + 4, s : s + 4] * layer.params["W"][o, 0]
                ).sum() + layer.params["b"][o]
                assert np.isclose(out[0, o, r, s], expected, rtol=1e-12)
    assert "padding=(1, 2)" in repr(layer)


@pytest.mark.parametrize("kernel", [1, 2, 3, 4, 5])
def test_same_padding_keeps_the_size_for_every_kernel(kernel):
    assert Sequential([Conv2D(2, kernel)], (3, 9, 9)).output_shape == (2, 9, 9)
    assert Sequential([Conv2D(2, kernel)], (3, 8, 7)).output_shape == (2, 8, 7)
    assert Sequential([Conv1D(2, kernel)], (3, 9)).output_shape == (2, 9)
    assert Sequential([Conv1D(2, kernel, stride=2)], (3, 9)).output_shape == (2, 5)  # ceil(9 / 2)


def test_pool1d_matches_a_direct_loop_and_crops_partial_windows():
    x = np.random.default_rng(3).normal(size=(2, 3, 11))
    top = Sequential([MaxPool1D(3)], (3, 11), xp=np, dtype=np.float64).forward(x)
    mean = Sequential([AvgPool1D(3)], (3, 11), xp=np, dtype=np.float64).forward(x)
    assert top.shape == mean.shape == (2, 3, 3)
    for r in range(3):
        np.testing.assert_array_equal(top[:, :, r], x[:, :, 3 * r : 3 * r + 3].max(axis=2))
        np.testing.assert_allclose(mean[:, :, r], x[:, :, 3 * r : 3 * r + 3].mean(axis=2), rtol=1e-14)


def test_avgpool2d_matches_a_direct_loop_and_maxpool2d_is_unchanged():
    x = np.random.default_rng(4).normal(size=(2, 3, 7, 6))
    mean = Sequential([AvgPool2D(3)], (3, 7, 6), xp=np, dtype=np.float64).forward(x)
    top = Sequential([MaxPool2D(3)], (3, 7, 6), xp=np, dtype=np.float64).forward(x)
    for r in range(2):
        for s in range(2):
            window = x[:, :, 3 * r : 3 * r + 3, 3 * s : 3 * s + 3]
            np.testing.assert_allclose(mean[:, :, r, s], window.mean(axis=(2, 3)), rtol=1e-14)
            np.testing.assert_array_equal(top[:, :, r, s], window.max(axis=(2, 3)))


def test_maxpool1d_sends_a_tied_gradient_to_one_position_only():
    pool = Sequential([MaxPool1D(2)], (1, 2), xp=np, dtype=np.float64)
    pool.forward(np.ones((1, 1, 2)))
    np.testing.assert_array_equal(pool.backward(np.ones((1, 1, 1))), [[[1.0, 0.0]]])


def test_global_avg_pool_is_the_spatial_mean():
    x = np.random.default_rng(5).normal(size=(2, 3, 4, 5))
    model = Sequential([GlobalAvgPool()], (3, 4, 5), xp=np, dtype=np.float64)
    assert model.output_shape == (3,)
    np.testing.assert_allclose(model.forward(x), x.mean(axis=(2, 3)), rtol=1e-14)


def test_pools_that_do_not_fit_are_shape_errors():
    with pytest.raises(nn.ShapeError, match=r"MaxPool1D\(4\) does not fit signals of 3"):
        Sequential([MaxPool1D(4)], (2, 3))
    with pytest.raises(nn.ShapeError, match=r"AvgPool2D needs image samples"):
        Sequential([AvgPool2D(2)], (2, 3))
    with pytest.raises(nn.ShapeError, match=r"Conv1D needs signal samples \(C, L\)"):
        Sequential([Conv1D(2)], (5,))


# --- activations and LayerNorm ------------------------------------------------------------------------------


def test_gelu_is_the_tanh_approximation():
    layer = GELU()
    layer.xp = np
    x = np.array([-3.0, -1.0, 0.0, 1.0, 2.0])
    c = np.sqrt(2 / np.pi)
    np.testing.assert_allclose(
        layer.forward(x), 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x**3))), rtol=1e-15
    )
    # torch, approximate="tanh"
    assert np.isclose(layer.forward(np.array([1.0]))[0], 0.8411919906082768, rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("size", [7, ZEROS, 2 * ZEROS + 5])
@pytest.mark.parametrize("in_place", [True, False])
def test_rectify_is_numpy_maximum_against_zero_to_the_bit(dtype, size, in_place):
    # NaNs of either sign, signed zeros, infinities and subnormals, in rows of the zeros block and past them
    special = np.array([-0.0, 0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.0, -3.0])
    x = np.resize(special, size).astype(dtype)
    x[:: len(special) + 1] = np.random.default_rng(size).standard_normal(x[:: len(special) + 1].size)
    expected = np.maximum(x, 0)
    out = x if in_place else np.full_like(x, 7)
    assert rectify(np, x, out) is out
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))


def test_rectify_of_a_strided_view_writes_the_view():
    # (a view that is not contiguous cannot be taken as rows: numpy's own call writes it)
    whole = np.arange(-40.0, 40.0, dtype=np.float32).reshape(8, 10)
    x = whole[:, ::2]
    expected = np.maximum(x, 0)
    rectify(np, x, x)
    np.testing.assert_array_equal(whole[:, ::2], expected)
    np.testing.assert_array_equal(whole[:, 1::2], np.arange(-39.0, 40.0, 2, dtype=np.float32).reshape(8, 5))


def test_sigmoid_is_exact_and_quiet_for_huge_inputs():
    layer = Sigmoid()
    layer.xp = np
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = layer.forward(np.array([-1e4, -30.0, 0.0, 2.0, 1e4]))
    np.testing.assert_allclose(y, [0.0, 1 / (1 + np.exp(30.0)), 0.5, 1 / (1 + np.exp(-2.0)), 1.0], rtol=1e-14)


def test_layernorm_normalises_the_last_axis_and_applies_gamma_beta():
    x = np.random.default_rng(6).normal(3.0, 2.0, size=(4, 3, 6))
    model = Sequential([LayerNorm(eps=0.0)], (3, 6), xp=np, dtype=np.float64)
    model.init_params(0)
    y = model.forward(x)
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-14)
    np.testing.assert_allclose(y.std(axis=-1), 1, rtol=1e-12)
    layer = model.layers[0]
    assert layer.params["gamma"].shape == (6,)
    layer.params["gamma"][...], layer.params["beta"][...] = 2.0, 0.5
    np.testing.assert_allclose(model.forward(x), 2 * y + 0.5, rtol=1e-12)


# --- BatchNorm ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers,shape",
    [
        ([BatchNorm()], (3,)),
        ([Dense(4), BatchNorm(), ReLU(), Dense(2)], (3,)),
        ([BatchNorm()], (2, 3)),  # (N, C, L): statistics over N and L
        ([Conv2D(2, 3), BatchNorm(), ReLU(), Flatten(), Dense(2)], (1, 4, 4)),
    ],
)
def test_batchnorm_gradients_through_batch_statistics_match_finite_differences(layers, shape):
    model = check_model_gradients(layers, shape, batch=4, training=True)
    for lo, hi in model.running_entries():
        assert not model.grads[lo:hi].any()  # never trained


def test_batchnorm_moves_running_statistics_and_evaluation_uses_them():
    rng = np.random.default_rng(7)
    x = rng.normal(2.0, 3.0, size=(8, 3, 5))
    model = Sequential([BatchNorm(momentum=0.25)], (3, 5), xp=np, dtype=np.float64)
    model.init_params(0)
    layer = model.layers[0]
    y = model.forward(x, training=True)
    np.testing.assert_allclose(y.mean(axis=(0, 2)), 0, atol=1e-13)
    np.testing.assert_allclose(y.var(axis=(0, 2)), 1, rtol=1e-5)  # eps = 1e-5
    np.testing.assert_allclose(layer.params["running_mean"], 0.25 * x.mean(axis=(0, 2)), rtol=1e-13)
    unbiased = x.transpose(1, 0, 2).reshape(3, -1).var(axis=1, ddof=1)
    np.testing.assert_allclose(layer.params["running_var"], 0.75 + 0.25 * unbiased, rtol=1e-13)
    layer.params["running_mean"][...], layer.params["running_var"][...] = [1.0, 2.0, 3.0], [4.0, 1.0, 0.25]
    layer.params["gamma"][...], layer.params["beta"][...] = 2.0, 1.0
    before = model.params.copy()
    expected = (
        2 * (x - np.array([1.0, 2.0, 3.0])[:, None]) / np.sqrt(np.array([4.0, 1.0, 0.25])[:, None] + 1e-5) + 1
    )
    np.testing.assert_allclose(model.forward(x, training=False), expected, rtol=1e-13)
    np.testing.assert_array_equal(model.params, before)  # evaluation moves nothing


def test_running_entries_are_the_flat_ranges_of_running_statistics():
    model = Sequential([Dense(4), BatchNorm(), Residual(Dense(4), BatchNorm()), Dense(2)], (3,))
    first, nested = model.layers[1], model.layers[2].layers[1]
    ranges = model.running_entries()
    assert len(ranges) == 4
    for (lo, hi), (layer, name) in zip(
        ranges,
        [(first, "running_mean"), (first, "running_var"), (nested, "running_mean"), (nested, "running_var")],
    ):
        assert hi - lo == 4 and np.shares_memory(model.params[lo:hi], layer.params[name])
    model.init_params(0)
    np.testing.assert_array_equal(first.params["running_var"], 1.0)
    np.testing.assert_array_equal(first.params["running_mean"], 0.0)


class FakeAllreduce:
    """In-place sum across ``parts`` threads, each standing for one worker: the MPI Allreduce a strategy would
    pass."""

    def __init__(self, parts):
        self.barrier = threading.Barrier(parts, timeout=30)
        self.slots = [None] * parts
        self.calls = 0

    def for_worker(self, worker):
        def reduce(array):
            assert array.dtype == np.float64 and array.flags.c_contiguous
            self.slots[worker] = array.copy()
            self.barrier.wait()
            total = sum(self.slots)  # same order on every worker: identical results
            self.barrier.wait()  # everyone has read before the next call overwrites a slot
            array[...] = total
            self.calls += worker == 0

        return reduce


def run_workers(parts, work):
    """``work(worker)`` on one thread per worker; returns the results in worker order, re-raising any
    failure."""
    results, errors = [None] * parts, []

    def target(worker):
        try:
            results[worker] = work(worker)
        except BaseException as err:  # noqa: B902 -- reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=target, args=(w,)) for w in range(parts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("shape,sizes", [((3,), [5, 3]), ((2, 4), [4, 1, 3]), ((2, 3, 3), [2, 6])])
def test_synchronised_batchnorm_on_shards_equals_batchnorm_on_the_whole_batch(shape, sizes):
    """W workers with uneven shards, loss scaled by each one's share: outputs, summed parameter
    gradients, input gradients and running statistics all equal a single BatchNorm on the global batch."""
    rng = np.random.default_rng(8)
    total = sum(sizes)
    x = rng.normal(1.0, 2.0, size=(total,) + shape)
    r = rng.normal(size=x.shape)  # d(global loss)/dy for every sample
    params = rng.normal(size=4 * shape[0])

    def model(sync):
        m = Sequential([BatchNorm(sync=sync)], shape, xp=np, dtype=np.float64)
        m.params[...] = params
        m.layers[0].params["running_var"][...] = np.abs(m.layers[0].params["running_var"])
        return m

    whole = model(sync=False)
    expected_y = whole.forward(x, training=True)
    expected_dx = whole.backward(r.copy())

    fake = FakeAllreduce(len(sizes))
    bounds = np.cumsum([0] + sizes)

    def work(worker):
        local = model(sync=True)
        local.layers[0].reduce = fake.for_worker(worker)
        part = slice(bounds[worker], bounds[worker + 1])
        y = local.forward(x[part], training=True)
        dx = local.backward(r[part].copy())
        return y, dx, local.grads.copy(), local.params.copy()

    results = run_workers(len(sizes), work)
    assert fake.calls == 2  # one reduce in forward, one in backward
    np.testing.assert_allclose(np.concatenate([y for y, _, _, _ in results]), expected_y, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        np.concatenate([dx for _, dx, _, _ in results]), expected_dx, rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(sum(g for _, _, g, _ in results), whole.grads, rtol=0, atol=1e-12)
    for _, _, _, p in results:  # every worker's running statistics are the global ones
        np.testing.assert_allclose(p, whole.params, rtol=0, atol=1e-12)


def test_batchnorm_without_a_reducer_is_per_worker():
    x = np.random.default_rng(9).normal(size=(6, 3))
    synced = Sequential([BatchNorm(sync=True)], (3,), xp=np, dtype=np.float64)
    plain = Sequential([BatchNorm()], (3,), xp=np, dtype=np.float64)
    np.testing.assert_allclose(synced.forward(x, training=True), plain.forward(x, training=True), rtol=1e-14)


# --- Embedding ----------------------------------------------------------------------------------------------


def test_embedding_gradient_adds_up_repeated_ids():
    ids = np.array([[0, 2, 2, 4], [4, 4, 1, 2], [3, 0, 2, 2]])
    # float ids, as a dataset stores them; the input is not perturbed (ids have no gradient: the next test)
    nn.check_gradients(
        [Embedding(5, 3), Flatten(), Dense(2)], (4,), x=ids.astype(np.float32), input_grad=False
    )


@pytest.mark.parametrize("bad", [-1, 2.5, 6, np.nan, 1e30])
def test_an_embedding_refuses_ids_that_are_not_its_tokens_naming_the_sample_and_position(bad):
    """A negative id would index the table from its end, a fractional one be cut to another: refused, as is
    one past the vocabulary, whole or split by vocabulary (a part checks the ids against the whole
    vocabulary)."""
    from mpidist.nn.tensor import VocabularyPart
    from mpidist.runtime.errors import UsageError

    ids = np.array([[5, 0, 5], [1, 2, 3]], dtype=np.float64)
    ids[1, 2] = bad
    for layer in (Embedding(6, 2), VocabularyPart(3, 6, 2, whole=6), VocabularyPart(0, 3, 2, whole=6)):
        model = Sequential([layer], (3,), xp=np, dtype=np.float64)
        with pytest.raises(
            UsageError,
            match=rf"Embedding\(6\): token id {re.escape(repr(float(bad)))} at sample 1 "
            r"of the batch, position 2, is not a whole number in \[0, 6\)",
        ):
            model.forward(ids)
    ids[1, 2] = 5.0  # whole ids of the vocabulary, as a dataset stores them (floats), pass
    assert Sequential([Embedding(6, 2)], (3,), xp=np, dtype=np.float64).forward(ids).shape == (2, 3, 2)


def test_embedding_looks_up_rows_and_its_input_gradient_is_zero():
    model = Sequential([Embedding(6, 2)], (3,), xp=np, dtype=np.float64)
    model.init_params(0)
    ids = np.array([[5, 0, 5]], dtype=np.float32)
    table = model.layers[0].params["W"]
    np.testing.assert_array_equal(model.forward(ids), table[[[5, 0, 5]]])
    dx = model.backward(np.ones((1, 3, 2)))
    assert dx.shape == (1, 3) and not dx.any()
    np.testing.assert_array_equal(model.grads.reshape(6, 2)[:, 0], [1, 0, 0, 0, 0, 2])
    assert model.backward(np.ones((1, 3, 2)), input_grad=False) is None


# --- Residual -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers,shape",
    [
        ([Residual(Dense(4), ReLU(), Dense(4))], (4,)),
        ([Dense(3), Residual(Dense(5), Tanh(), Dense(3)), Dense(2)], (4,)),
        ([Residual(Conv2D(2, 3), ReLU(), Conv2D(2, 3))], (2, 4, 4)),
        ([Residual(Dense(3), Residual(Dense(3), Tanh()), ReLU()), Dense(2)], (3,)),  # nested
        ([Residual(Conv1D(3, 4), LayerNorm(), GELU()), GlobalAvgPool(), Dense(2)], (3, 5)),
    ],
)
def test_residual_gradients_match_finite_differences(layers, shape):
    check_model_gradients(layers, shape)


def test_dropout_inside_a_residual_gets_its_own_stream():
    model = check_model_gradients(
        [Residual(Dense(6), Dropout(0.5)), Residual(Dense(6), Dropout(0.5))], (6,), training=True
    )
    first, second = model.layers[0].layers[1], model.layers[1].layers[1]
    assert first.rng is not None and second.rng is not None
    model.reseed(1)
    assert first.rng.random() != second.rng.random()


def test_residual_parameters_live_in_the_flat_buffers_and_count_as_the_blocks():
    inner = Dense(3)
    model = Sequential([Dense(3), Residual(inner, ReLU(), Residual(Dense(3))), Dense(2)], (2,), xp=np)
    assert len(model.layers) == 3
    assert [model.layer_params(i) for i in range(3)] == [9, 24, 8]
    assert model.num_params == 41
    assert np.shares_memory(inner.params["W"], model.params[9:18])
    assert np.shares_memory(inner.grads["W"], model.grads[9:18])
    assert model.layers[1].layers[2].layers[0].xp is np


def test_stash_and_restore_include_sublayers():
    model = Sequential([Residual(Dense(3), ReLU())], (3,), xp=np, dtype=np.float64)
    model.init_params(0)
    a, b = np.ones((2, 3)), np.arange(6.0).reshape(2, 3)
    model.forward(a)
    saved = model.stash()
    expected = model.backward(np.ones((2, 3)))
    model.forward(b)
    model.restore(saved)
    np.testing.assert_array_equal(model.backward(np.ones((2, 3))), expected)


def test_residual_block_that_changes_the_shape_is_a_shape_error_naming_both():
    with pytest.raises(nn.ShapeError, match=r"layer 1 .*Residual.*\(4,\) to \(3,\)"):
        Sequential([Dense(4), Residual(Dense(3))], (2,))
    with pytest.raises(nn.ShapeError, match=r"block layer 0 .*Flatten"):
        Sequential([Residual(Dense(3))], (1, 2, 2))


# --- zoo specs ----------------------------------------------------------------------------------------------


def dense_widths(model):
    return [layer.units for layer in model.layers if isinstance(layer, Dense)]


def test_mlp_spec_sets_the_hidden_widths():
    model = nn.build_model("mlp:256,256,256", (8, 8), 10, np, np.float32)
    assert dense_widths(model) == [256, 256, 256, 10]
    assert dense_widths(nn.build_model("mlp", (8, 8), 10, np, np.float32)) == [128, 128, 10]
    assert nn.parse_spec("mlp:7") == ("mlp", (7,)) and nn.parse_spec("cnn") == ("cnn", None)


def test_cnn_spec_sets_the_conv_filters_and_the_default_image_cnn_is_unchanged():
    default = nn.build_model("cnn", (8, 8), 10, np, np.float32)
    # Conv16-Pool-Conv32-Pool-Dense64-Dense10 on 8x8: checkpoints rely on it
    assert default.num_params == 13706
    assert nn.build_model("cnn:16,32", (8, 8), 10, np, np.float32).num_params == 13706
    model = nn.build_model("cnn:4,8,8,8", (1, 8, 8), 10, np, np.float32)  # pools stop at 1x1
    assert [layer.filters for layer in model.layers if isinstance(layer, Conv2D)] == [4, 8, 8, 8]
    assert model.shapes[-1] == (64,)


def test_cnn_on_1d_samples_is_a_conv1d_stack():
    assert nn.input_shape_for("cnn:8", (40,)) == (1, 40)
    model = nn.build_model("cnn", (40,), 10, np, np.float32)
    assert model.input_shape == (1, 40)
    assert [layer.filters for layer in model.layers if isinstance(layer, Conv1D)] == [32, 32, 32]
    small = nn.build_model("cnn:4,6", (40,), 10, np, np.float32)
    assert [type(layer).__name__ for layer in small.layers] == [
        "Conv1D",
        "ReLU",
        "MaxPool1D",
        "Conv1D",
        "ReLU",
        "MaxPool1D",
        "Flatten",
        "Dense",
    ]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("mlp:", r"mlp:N1,N2,\.\.\. with positive integers"),
        ("mlp:0", r"positive integers"),
        ("mlp:a", r"positive integers"),
        ("mlp:8,,8", r"positive integers"),
        ("linear:3", r"'linear' takes no arguments"),
        ("mlp-wide:1", r"'mlp-wide' takes no arguments"),
        ("nosuch:1", r"'nosuch' is not in the zoo; choose from linear, mlp\[:N1,N2,\.\.\.\], mlp-wide, cnn"),
    ],
)
def test_bad_specs_are_spec_errors_naming_the_valid_forms(spec, message):
    with pytest.raises(nn.SpecError, match=message):
        nn.build_model(spec, (8, 8), 10, np, np.float32)
    with pytest.raises(ValueError):
        nn.input_shape_for(spec, (8, 8))


def test_the_1d_cnn_trains():
    first, last = fit_one_batch("cnn:8,8", (24,), 4, steps=40)
    assert last < 0.5 * first
