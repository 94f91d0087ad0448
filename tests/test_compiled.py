"""The compiled kernels (numba, the ``jit`` extra, which the ``test`` extra installs) give numpy's path's
results exactly, and the numpy path stays where they are off."""

import subprocess
import sys

import numpy as np
import pytest

from mpidist.nn import MaxPool1D, MaxPool2D, Sequential, compiled


def awkward_values(rng, shape, dtype):
    """Normal values, a third of them zeros (a ReLU's ties), with a NaN, an inf and a -inf."""
    values = rng.normal(size=shape)
    values[rng.random(shape) < 0.33] = 0.0
    flat = values.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = [np.nan, np.inf, -np.inf]
    return values.astype(dtype)


def laid_out(array, channels_last):
    """``array`` (N, C, *spatial) as it is, or as the transposed view of channels-last memory a convolution
    hands on."""
    if not channels_last:
        return np.ascontiguousarray(array)
    axes = (0, *range(2, array.ndim), 1)
    return np.ascontiguousarray(array.transpose(axes)).transpose(np.argsort(axes))


def training_pass(pool, shape, x, dy, monkeypatch, jit):
    """A training forward and backward of ``pool`` alone: ``(y, argmax, dx)``, copies."""
    monkeypatch.setenv("MPIDIST_JIT", "1" if jit else "0")
    model = Sequential([pool], shape, xp=np, dtype=x.dtype)
    with np.errstate(invalid="ignore"):  # (numpy's path multiplies an infinite dy by 0)
        y = model.forward(x, training=True).copy()
        dx = model.backward(dy)
    return y, model.layers[0].argmax.copy(), dx.copy()


CASES = [
    (MaxPool2D, 2, (16, 28, 28)),
    (MaxPool2D, 2, (5, 7, 6)),  # crops a row and keeps every column
    (MaxPool2D, 3, (3, 7, 8)),
    (MaxPool1D, 2, (8, 13)),
    (MaxPool1D, 3, (4, 9)),
]


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels-last", "contiguous"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layer, size, shape", CASES)
def test_compiled_max_pool_gives_numpy_s_results_exactly(
    monkeypatch, layer, size, shape, dtype, channels_last
):
    assert compiled.kernels(np) is not None, "the test extra installs numba: pip install -e '.[test]'"
    rng = np.random.default_rng(sum(shape) + size)
    x = laid_out(awkward_values(rng, (4, *shape), dtype), channels_last)
    out_shape = Sequential([layer(size)], shape).output_shape
    dy = laid_out(awkward_values(rng, (4, *out_shape), dtype), channels_last)
    ours = training_pass(layer(size), shape, x, dy, monkeypatch, jit=True)
    numpys = training_pass(layer(size), shape, x, dy, monkeypatch, jit=False)
    for mine, theirs in zip(ours, numpys):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine, theirs)  # (NaNs in the same places count as equal)
    assert np.isnan(ours[0]).any() and np.isnan(ours[2]).any()  # the awkward values reached both passes


def test_the_kernels_are_off_on_request_and_for_other_array_modules(monkeypatch):
    assert compiled.kernels(np) is not None and compiled.version().startswith("numba ")
    monkeypatch.setenv("MPIDIST_JIT", "0")
    assert compiled.kernels(np) is None and compiled.version() == "off (MPIDIST_JIT=0)"
    monkeypatch.setenv("MPIDIST_JIT", "1")
    assert compiled.kernels(object()) is None  # (cupy's arrays keep the array-module path)


def test_without_numba_the_numpy_path_runs_and_bench_says_how_to_add_the_kernels():
    """numba blocked in a fresh interpreter (as where it is not installed): the pool still trains, and the
    kernels are named as missing."""
    code = (
        "import sys; sys.modules['numba'] = None\n"
        "import numpy as np\n"
        "from mpidist.nn import MaxPool2D, Sequential, compiled\n"
        "model = Sequential([MaxPool2D(2)], (1, 2, 2), xp=np, dtype=np.float64)\n"
        "y = model.forward(np.array([[[[1.0, 3.0], [2.0, 0.0]]]]), training=True)\n"
        "dx = model.backward(np.ones((1, 1, 1, 1)))\n"
        "print(compiled.kernels(np), y.ravel().tolist(), dx.ravel().tolist(), compiled.version())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == (
        "None [3.0] [0.0, 1.0, 0.0, 0.0] none (pip install 'mpidist[jit]' adds them)"
    )


def test_a_numba_that_cannot_cache_its_kernels_leaves_the_numpy_path_and_says_why():
    """Where neither the package's folder nor the user's cache can be written, numba refuses ``cache=True``
    when the kernels are defined (a RuntimeError): the pool trains on numpy's path instead of failing."""
    code = (
        "import numba\n"
        "def refuse(*args, **kwargs):\n"
        "    raise RuntimeError('cannot cache function: no locator available for file kernels.py')\n"
        "numba.njit = refuse\n"
        "import numpy as np\n"
        "from mpidist.nn import MaxPool2D, Sequential, compiled\n"
        "model = Sequential([MaxPool2D(2)], (1, 2, 2), xp=np, dtype=np.float64)\n"
        "y = model.forward(np.array([[[[1.0, 3.0], [2.0, 0.0]]]]), training=True)\n"
        "print(compiled.kernels(np), y.ravel().tolist(), compiled.version())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "None [3.0] none (numba cannot keep them: cannot cache function: no locator"
    )
    assert "NUMBA_CACHE_DIR names a writable place" in done.stdout
