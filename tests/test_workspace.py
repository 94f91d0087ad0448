"""The steady state allocates nothing; reused arrays never change a result; slots and buckets."""

import tracemalloc

import numpy as np
import pytest

from mpidist import nn
from mpidist.bench.handwritten import HandwrittenMLP
from mpidist.bench.handwritten import handwritten_for
from mpidist.runtime import aligned
from mpidist.parallel import LocalStrategy
from mpidist.parallel.data.exchange import top_down_buckets
from mpidist.parallel.pipeline.slots import SlotPool


def _local(spec, sample_shape, batch, optimizer="sgd", dtype=np.float32):
    model = nn.build_model(spec, sample_shape, 10, np, dtype)
    strategy = LocalStrategy(
        model,
        nn.loss_for(10, np),
        lambda n: nn.make_optimizer(optimizer, n, 0.01, xp=np, dtype=dtype),
        seed=0,
    )
    strategy.initialize()
    rng = np.random.default_rng(0)
    x = rng.random((batch,) + model.input_shape, dtype=np.float32).astype(dtype)
    return strategy, x, rng.integers(0, 10, batch)


def _warm_step_memory(spec, sample_shape, optimizer, batch):
    """``(bytes held after, peak bytes during, bytes of activations)`` of a warm step, as tracemalloc sees
    them."""
    strategy, x, y = _local(spec, sample_shape, batch, optimizer)
    for step in range(2):
        strategy.train_step(x, y, 1.0, step)
    activations = sum(int(np.prod(shape)) for shape in strategy.model.shapes[1:]) * batch * 4
    tracemalloc.start()
    try:
        strategy.train_step(x, y, 1.0, 2)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return current, peak, activations


@pytest.mark.parametrize(
    "spec,sample_shape,optimizer",
    [
        ("mlp-wide", (28, 28), "sgd"),
        ("cnn", (28, 28), "adam"),
        ("cnn", (40,), "sgd"),
        ("mlp", (8, 8), "adam"),
    ],
)
def test_a_warm_training_step_allocates_nothing_that_grows_with_the_batch(spec, sample_shape, optimizer):
    """numpy reports its array memory to tracemalloc: a warm step keeps nothing and allocates no activation.

    What it still allocates for an instant is numpy's own (casting buffers
    of at most 8192 elements, per-row reductions' scalars): the same at any
    batch size, where the activations it used to allocate grow with it.
    """
    small = _warm_step_memory(spec, sample_shape, optimizer, 256)
    large = _warm_step_memory(spec, sample_shape, optimizer, 1024)
    assert large[2] >= 1 << 20  # what every step allocated before
    for current, peak, activations in (small, large):
        assert current < 8 << 10, f"a warm step kept {current} bytes"
        assert peak < min(256 << 10, activations / 4), f"a warm step allocated {peak} bytes at its peak"
    assert large[1] < small[1] + (16 << 10), f"the peak grew with the batch: {small[1]} -> {large[1]} bytes"


@pytest.mark.parametrize("shape", [0, 1, 7, (3, 5), (64, 512), 40_000])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64, np.bool_])
def test_aligned_arrays_start_on_a_cache_line_and_hold_exactly_their_elements(shape, dtype):
    made = [
        aligned.empty(np, shape, dtype),
        aligned.zeros(np, shape, dtype),
        aligned.full(np, shape, 1, dtype),
    ]
    expected = np.zeros(shape, dtype).shape
    for array in made:
        assert array.shape == expected and array.dtype == dtype and array.flags.c_contiguous
        assert array.ctypes.data % aligned.ALIGNMENT == 0 or not array.size  # (no elements: no address)
        # exactly its own bytes of the raw buffer beneath: a write to every element reaches no byte beside
        assert array.nbytes == int(np.prod(expected)) * np.dtype(dtype).itemsize
    assert not made[1].any() and (made[2] == 1).all()
    with pytest.raises(ValueError, match="negative dimensions"):  # (as numpy's own, not a short array)
        aligned.empty(np, (2, -1), dtype)


def test_the_arrays_a_step_streams_through_start_on_a_cache_line():
    # (numpy's own places an mmap-ed buffer 16 bytes past a page: every other 32-byte load split a line)
    for optimizer in ("sgd", "adam"):
        strategy, x, y = _local("mlp:64,32", (1, 8, 8), 16, optimizer)
        strategy.train_step(x, y, 1.0, 0)
        model = strategy.model
        arrays = [model.params, model.grads, strategy.buffer, *strategy.optimizer.state_arrays().values()]
        arrays += [*strategy.optimizer._scratch, *model.workspace._arrays.values()]
        assert len(arrays) > 10
        assert [array.ctypes.data % aligned.ALIGNMENT for array in arrays] == [0] * len(arrays)


def test_reused_arrays_give_the_results_fresh_arrays_give():
    """Training with the workspace equals training where every pass allocates (the workspace switched off)."""
    reused, x, y = _local("cnn", (12, 12), 16, dtype=np.float64)
    fresh, _, _ = _local("cnn", (12, 12), 16, dtype=np.float64)
    fresh.model.workspace.array = lambda owner, name, shape, dtype, fill=None: (
        np.full(shape, fill, dtype)
        if fill is not None
        else np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 7, dtype)
    )
    # (a fresh array each time, poisoned: a value read before it is written shows)
    for step in range(4):
        assert reused.train_step(x, y, 1.0, step) == fresh.train_step(x, y, 1.0, step)
    np.testing.assert_array_equal(reused.model.params, fresh.model.params)


def test_inference_outputs_are_the_callers_to_keep():
    """A training pass reuses its arrays; an inference pass never hands out one that a later pass
    overwrites."""
    model = nn.build_model("mlp", (8, 8), 10, np, np.float32)
    model.init_params(0)
    x = np.random.default_rng(0).random((4, 8, 8), dtype=np.float32)
    first = model.forward(x)
    kept = first.copy()
    model.forward(x * 2)
    model.forward(x * 3, training=True)
    np.testing.assert_array_equal(first, kept)


def test_relu_works_in_place_only_on_what_its_neighbour_hands_over():
    """After a Dense, ReLU overwrites the Dense's output; as a first layer it never touches the caller's
    data."""
    model = nn.Sequential([nn.ReLU(), nn.Dense(3), nn.ReLU(), nn.Dense(2)], (4,))
    assert [layer.overwrite_input for layer in model.layers] == [False, False, True, False]
    assert [layer.overwrite_grad for layer in model.layers] == [True, False, True, False]
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], dtype=np.float32)
    before = x.copy()
    model.forward(x, training=True)
    np.testing.assert_array_equal(x, before)


def test_channels_last_views_keep_their_memory_order_through_relu_and_pooling():
    """A convolution's NCHW output is a view of NHWC memory; ReLU and MaxPool answer in the same order."""
    model = nn.Sequential([nn.Conv2D(4, 3), nn.ReLU(), nn.MaxPool2D(2)], (3, 6, 6))
    model.init_params(0)
    x = np.random.default_rng(1).standard_normal((2, 3, 6, 6)).astype(np.float32)
    out = model.forward(x, training=True)
    assert out.strides[1] == out.itemsize  # channels innermost in memory
    plain = nn.Sequential([nn.Conv2D(4, 3), nn.ReLU(), nn.MaxPool2D(2)], (3, 6, 6))
    plain.init_params(0)
    expected = plain.forward(x)
    np.testing.assert_array_equal(out, expected)


def test_handwritten_floor_trains_the_same_model_as_mpidist():
    """The bench's floor is the same computation: same start, same batches, the same losses to float32
    rounding."""
    strategy, x, y = _local("mlp-wide", (28, 28), 32)
    hand = handwritten_for(strategy.model, 32)
    assert isinstance(hand, HandwrittenMLP)
    flat = x.reshape(32, -1)
    for step in range(5):
        ours = strategy.train_step(x, y, 1.0, step)
        hand.step(flat, y)
        assert hand.grads[-1] == pytest.approx(ours, rel=1e-4)
    np.testing.assert_allclose(hand.params[:-1], strategy.model.params, atol=1e-5)
    assert handwritten_for(nn.build_model("cnn", (8, 8), 10, np, np.float32), 32) is None


def test_buckets_are_cut_from_the_top_in_the_order_backward_fills_them():
    assert top_down_buckets(10, 4, 16) == [(6, 10), (2, 6), (0, 2)]
    assert top_down_buckets(8, 4, 16) == [(4, 8), (0, 4)]
    assert top_down_buckets(5, 4, 1 << 20) == [(0, 5)]
    for count in (1, 7, 100):
        cover = sorted(top_down_buckets(count, 4, 12))
        assert cover[0][0] == 0 and cover[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(cover, cover[1:]))


def test_sequential_reports_each_layer_ready_from_the_top_down():
    model = nn.build_model("mlp", (8, 8), 10, np, np.float32)
    model.init_params(0)
    seen = []
    model.forward(np.ones((2, 8, 8), np.float32), training=True)
    model.backward(np.ones((2, 10), np.float32), input_grad=False, ready=seen.append)
    assert seen == sorted(seen, reverse=True) and seen[-1] == 0
    assert seen[0] == model.offsets[-1]


class _Request:
    """A send that completes after ``tests`` calls of Test()."""

    def __init__(self, tests):
        self.left = tests

    def Test(self):
        self.left -= 1
        return self.left < 0


def test_slot_pool_hands_out_a_slot_again_only_once_its_sends_are_done():
    pool = SlotPool()
    assert [pool.take(), pool.take()] == [0, 1]
    pool.release(0, [_Request(tests=1)])  # its send needs one more test
    assert pool.take() == 2  # slot 0 is still leaving
    assert pool.take() == 0  # now it has gone
    pool.release(1)
    assert pool.take() == 1
    assert pool.size == 3
    pool.reset()
    assert [pool.take() for _ in range(4)] == [0, 1, 2, 3]
