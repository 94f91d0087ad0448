"""The compiled kernels (numba, the ``jit`` extra, which the ``test`` extra installs) give numpy's path's
results exactly, and the numpy path stays where they are off."""

import subprocess
import sys

import numpy as np
import pytest

from mpidist.nn import MaxPool1D, MaxPool2D, Sequential, compiled


def awkward_values(rng, shape, dtype):
    """Normal values, a third of them zeros (a ReLU's ties) and a tenth -0.0, a NaN, an inf and a -inf."""
    values = rng.normal(size=shape)
    values[rng.random(shape) < 0.33] = 0.0
    values[rng.random(shape) < 0.1] = -0.0
    flat = values.reshape(-1)
    flat[rng.choice(flat.size, 3, replace=False)] = [np.nan, np.inf, -np.inf]
    return values.astype(dtype)


def same_bits(a, b):
    """Whether two arrays hold the same bits (-0.0 is not 0.0 here, as in a gradient's sign)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == np.ascontiguousarray(b).tobytes()


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
    # the maxima equal (NaNs in the same places; which zero's sign np.maximum keeps differs between CPUs), the
    # winners and the gradient to the bit
    np.testing.assert_array_equal(ours[0], numpys[0])
    assert ours[0].dtype == numpys[0].dtype and ours[0].strides == numpys[0].strides
    assert same_bits(np.ascontiguousarray(ours[1]), numpys[1]) and same_bits(
        np.ascontiguousarray(ours[2]), numpys[2]
    )
    assert np.isnan(ours[0]).any() and np.isnan(ours[2]).any()  # the awkward values reached both passes
    assert np.signbit(ours[2][ours[2] == 0]).any()  # and so did -0.0


def test_the_kernels_are_off_on_request_for_other_array_modules_and_dtypes_numba_refuses(monkeypatch):
    assert compiled.kernels(np, np.zeros(1, np.float32)) is not None and compiled.version().startswith(
        "numba "
    )
    for refused in (np.float16, ">f8" if np.little_endian else "<f8", np.longdouble):
        assert compiled.kernels(np, np.zeros(1, np.float64), np.zeros(1, refused)) is None
    monkeypatch.setenv("MPIDIST_JIT", "0")
    assert compiled.kernels(np) is None and compiled.version() == "off (MPIDIST_JIT=0)"
    monkeypatch.setenv("MPIDIST_JIT", "1")
    assert compiled.kernels(object()) is None  # (cupy's arrays keep the array-module path)


def test_a_kernel_that_fails_leaves_the_numpy_path_with_a_warning_and_the_run_goes_on(monkeypatch):
    """A first call compiles or loads from numba's cache, which can fail where the import did not (a disk
    quota): the pass is numpy's, as are the ones after, and bench's header says why."""
    kernels = compiled.kernels(np)
    monkeypatch.setattr(compiled, "_failed", [])

    def over_quota(*args):
        raise OSError(122, "Disk quota exceeded")

    monkeypatch.setattr(kernels, "max_pool_forward", over_quota)
    x = np.array([[[[1.0, 3.0], [2.0, 0.0]]]])
    model = Sequential([MaxPool2D(2)], (1, 2, 2), xp=np, dtype=np.float64)
    with pytest.warns(UserWarning, match=r"compiled kernels off, numpy's path instead \(OSError: .*quota"):
        assert model.forward(x, training=True).ravel().tolist() == [3.0]
    assert model.backward(np.ones((1, 1, 1, 1))).ravel().tolist() == [0.0, 1.0, 0.0, 0.0]
    assert compiled.kernels(np) is None and compiled.version().startswith("none (OSError: [Errno 122]")


def pool_in_a_fresh_interpreter(prelude, report):
    """What a fresh interpreter prints after ``prelude`` (what it does to numba first), a training pass of a
    2x2 max pool over ``[[1, 3], [2, 0]]``, and ``print(report)`` (``y``, ``dx``, ``compiled`` in scope)."""
    code = (
        f"{prelude}\n"
        "import numpy as np\n"
        "from mpidist.nn import MaxPool2D, Sequential, compiled\n"
        "model = Sequential([MaxPool2D(2)], (1, 2, 2), xp=np, dtype=np.float64)\n"
        "y = model.forward(np.array([[[[1.0, 3.0], [2.0, 0.0]]]]), training=True)\n"
        "dx = model.backward(np.ones((1, 1, 1, 1)))\n"
        f"print({report})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_numba_the_numpy_path_runs_and_bench_says_how_to_add_the_kernels():
    """numba blocked (as where it is not installed): the pool still trains, and the kernels are named as
    missing."""
    printed = pool_in_a_fresh_interpreter(
        "import sys; sys.modules['numba'] = None",
        "compiled.kernels(np), y.ravel().tolist(), dx.ravel().tolist(), compiled.version()",
    )
    assert printed == "None [3.0] [0.0, 1.0, 0.0, 0.0] none (pip install 'mpidist[jit]' adds them)\n"


def test_where_numba_cannot_cache_the_kernels_they_are_compiled_in_each_process():
    """Where neither the package's folder nor the user's cache can be written, numba refuses ``cache=True``
    when the kernels are defined (a RuntimeError): they are compiled without a cache instead."""
    refusing = (
        "import numba\n"
        "plain = numba.njit\n"
        "def njit(*args, **options):\n"
        "    if options.get('cache'):\n"
        "        raise RuntimeError('cannot cache function: no locator available for file kernels.py')\n"
        "    return plain(*args, **options)\n"
        "numba.njit = njit"
    )
    kernel = "compiled.kernels(np).max_pool_forward"
    printed = pool_in_a_fresh_interpreter(
        refusing,
        f"y.ravel().tolist(), {kernel}.signatures != [], type({kernel}._cache).__name__, compiled.version()",
    )
    assert printed.startswith("[3.0] True NullCache numba "), printed


def test_the_gpus_pool_kernels_serve_cupys_float_arrays_until_one_fails(monkeypatch):
    """mpidist.nn.pool_kernels (run on a GPU by tests/test_gpu.py): which arrays they serve, and a kernel that
    fails sends the pools to the array form for good, but a failure inside a CUDA graph's capture is the
    capture's (raised: the pass runs eagerly) and leaves them on."""
    import types

    from mpidist.nn import pool_kernels

    monkeypatch.setattr(pool_kernels, "FAILED", [])
    capturing = [False]
    stream = types.SimpleNamespace(is_capturing=lambda: capturing[0])
    cupy = types.SimpleNamespace(
        __name__="cupy", cuda=types.SimpleNamespace(get_current_stream=lambda: stream)
    )
    floats, ints = np.zeros(2, np.float32), np.zeros(2, np.int64)
    assert pool_kernels.usable(cupy, floats, np.zeros(2, np.float16))
    assert not pool_kernels.usable(np, floats) and not pool_kernels.usable(cupy, floats, ints)

    def broken(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    capturing[0] = True
    with pytest.raises(RuntimeError):
        pool_kernels._ran(cupy, broken)
    assert pool_kernels.usable(cupy, floats)
    capturing[0] = False
    assert pool_kernels._ran(cupy, broken) is False
    assert pool_kernels.FAILED == ["RuntimeError: operation not permitted when stream is capturing"]
    assert not pool_kernels.usable(cupy, floats)
