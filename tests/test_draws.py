"""Draws from a key in device memory (mpidist.nn.draws): the host's twin of the GPU's kernel, checked here;
``tests/test_gpu.py`` checks the kernel against it."""

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn.draws import KeyedDraws, uniforms


@pytest.mark.parametrize("dtype, bits", [(np.float32, 24), (np.float64, 53)])
def test_draws_are_uniform_on_a_grid_of_their_type_in_zero_to_one(dtype, bits):
    draws = uniforms(12345, 1 << 20, dtype)
    assert draws.dtype == dtype and draws.min() >= 0 and draws.max() < 1
    assert np.all(draws * 2.0**bits == np.floor(draws * 2.0**bits))  # (multiples of 2^-bits)
    # a million draws: the mean within 6 standard errors of 1/2, each tenth of [0, 1) within 1.5% of its share
    assert abs(draws.mean() - 0.5) < 6 * (1 / 12) ** 0.5 / 2**10
    tenths = np.bincount((draws * 10).astype(int), minlength=10) / draws.size
    np.testing.assert_allclose(tenths, 0.1, rtol=0.015)
    # neighbours are independent: their correlation within 6 standard errors of 0
    assert abs(np.corrcoef(draws[:-1], draws[1:])[0, 1]) < 6 / 2**10


def test_a_key_draws_the_same_each_time_and_another_key_draws_otherwise():
    first, again, other = uniforms(7, 1000), uniforms(7, 1000), uniforms(8, 1000)
    np.testing.assert_array_equal(first, again)
    assert np.mean(first == other) < 0.01
    assert np.mean(uniforms(7, 2000)[:1000] == first) == 1  # (element i's draw is its own: any size agrees)


def test_keyed_draws_fill_an_array_from_the_key_they_hold_now():
    draws = KeyedDraws(np)
    out = np.empty((4, 250), np.float32)
    draws.set(2**64 - 1)  # (any 64-bit key)
    filled = draws.random(out.shape, np.float32, out)
    assert filled is out
    np.testing.assert_array_equal(out.reshape(-1), uniforms(2**64 - 1, 1000))
    draws.set(3)
    np.testing.assert_array_equal(draws.random((1000,), np.float64), uniforms(3, 1000, np.float64))


def test_a_dropout_drawing_from_a_key_keeps_its_share_and_scales_the_rest():
    layer = nn.Dropout(0.25)
    model = nn.Sequential([layer], (4000,), xp=np, dtype=np.float32)
    layer.rng = KeyedDraws(np)
    layer.rng.set(99)
    out = model.forward(np.ones((5, 4000), np.float32), training=True)
    kept = out != 0
    assert abs(kept.mean() - 0.75) < 0.01
    np.testing.assert_allclose(out[kept], 1 / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(kept.reshape(-1), uniforms(99, 20000) < 0.75)
