"""The cuDNN path of the convolutions, on CPUs: the geometry cuDNN is told, when the path is refused, and the
layer's passes through it with numpy standing in for cuDNN's plans (tests/test_gpu.py runs cuDNN itself)."""

import sys

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import cudnn_conv
from mpidist.nn.cudnn_conv import Geometry, element_strides


@pytest.mark.parametrize(
    "x_shape, x_strides, kernel, stride, pads, out, expected",
    [
        (  # an NCHW batch, "same" padding
            (8, 3, 10, 10), (300, 100, 10, 1), (3, 3), 1, ((1, 1), (1, 1)), (10, 10),
            dict(x_stride=(300, 100, 10, 1), y_stride=(1600, 1, 160, 16), dx_stride=(300, 1, 30, 3),
                 w_stride=(27, 9, 3, 1), pre=(1, 1), post=(1, 1), stride=(1, 1)),
        ),
        (  # a channels-last view (a convolution's output before), an even kernel's uneven padding, stride 2
            (4, 16, 6, 6), (576, 1, 96, 16), (4, 4), 2, ((1, 2), (1, 2)), (3, 3),
            dict(x_stride=(576, 1, 96, 16), y_stride=(144, 1, 48, 16), dx_stride=(576, 1, 96, 16),
                 w_stride=(256, 16, 4, 1), pre=(1, 1), post=(2, 2), stride=(2, 2)),
        ),
        (  # a Conv1D's signal as an image of height 1 (its added axis's stride 0 is no layout)
            (2, 5, 1, 7), (35, 7, 0, 1), (1, 3), 1, ((0, 0), (1, 1)), (1, 7),
            dict(x_stride=(35, 7, 7, 1), y_stride=(112, 1, 112, 16), dx_stride=(35, 1, 35, 5),
                 w_stride=(15, 3, 3, 1), pre=(0, 1), post=(0, 1), stride=(1, 1)),
        ),
        (  # one channel (MNIST): its axis's stride is the plane's, as in a packed NCHW array
            (8, 1, 28, 28), (784, 784, 28, 1), (3, 3), 1, ((1, 1), (1, 1)), (28, 28),
            dict(x_stride=(784, 784, 28, 1), dx_stride=(784, 784, 28, 1), w_stride=(9, 9, 3, 1)),
        ),
    ],
)  # fmt: skip
def test_the_geometry_cudnn_is_told(x_shape, x_strides, kernel, stride, pads, out, expected):
    geometry = Geometry.of(x_shape, x_strides, 16, kernel, stride, pads, out)
    assert geometry.x_dim == x_shape and geometry.y_dim == (x_shape[0], 16) + out
    assert geometry.w_dim == (16, x_shape[1]) + kernel
    for name, value in expected.items():
        assert getattr(geometry, name) == value, name


def test_the_path_is_refused_with_why(monkeypatch):
    assert "not float64" in cudnn_conv.refused(np.float64)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # (an import of it fails)
    assert "the cudnn frontend is not installed" in cudnn_conv.refused(np.float32)
    monkeypatch.setenv("MPIDIST_CUDNN", "0")
    assert cudnn_conv.refused(np.float32) == "MPIDIST_CUDNN=0"
    layer = nn.Sequential([nn.Conv2D(4)], (2, 5, 5), xp=np, dtype=np.float32).layers[0]
    assert cudnn_conv.plans_for(layer, np.zeros((1, 2, 5, 5), np.float32)) is None  # (host arrays: its own)


class NumpyPlans:
    """cuDNN's three graphs done by a reference layer of the same filters and no bias, checking that every
    array handed over is laid out as the geometry says."""

    def __init__(self, layer, x, reference):
        self.geometry = Geometry.of(
            x.shape, element_strides(x), layer.filters, layer.kernel_hw, layer.stride, layer.pads_hw,
            layer.out_hw,
        )  # fmt: skip
        self.reference = reference
        self.reference.params["W"][...] = layer.params["W"]
        self.reference.params["b"][...] = 0
        self.calls = []

    def laid_out(self, array, dim, stride):
        assert array.shape == dim and cudnn_conv.unit_strides(dim, element_strides(array)) == stride

    def forward(self, x, w, y):
        g = self.geometry
        self.laid_out(x, g.x_dim, g.x_stride), self.laid_out(w, g.w_dim, g.w_stride)
        self.laid_out(y, g.y_dim, g.y_stride)
        y[...] = self.reference._as_images(self.reference.forward(self.reference._from_images(x)))
        self.calls.append("forward")

    def weight_grad(self, x, dy, dw):
        g = self.geometry
        self.laid_out(x, g.x_dim, g.x_stride), self.laid_out(dy, g.y_dim, g.y_stride)
        self.laid_out(dw, g.w_dim, g.w_stride)
        self.reference.forward(self.reference._from_images(x))
        self.reference.backward_params(self.reference._from_images(dy))
        dw[...] = self.reference.grads["W"].reshape(dw.shape)
        self.calls.append("weight_grad")

    def input_grad(self, dy, w, dx):
        g = self.geometry
        self.laid_out(dy, g.y_dim, g.y_stride), self.laid_out(w, g.w_dim, g.w_stride)
        self.laid_out(dx, g.x_dim, g.dx_stride)
        dx[...] = self.reference._as_images(self.reference.backward(self.reference._from_images(dy)))
        self.calls.append("input_grad")


@pytest.mark.parametrize(
    "make, sample",
    [
        (lambda: nn.Conv2D(4, kernel=3), (3, 6, 6)),
        (lambda: nn.Conv2D(4, kernel=4, stride=2), (3, 7, 7)),
        (lambda: nn.Conv1D(5, kernel=3), (2, 9)),
    ],
    ids=["conv2d", "conv2d-even-strided", "conv1d"],
)
def test_a_convolutions_passes_through_the_cudnn_path_equal_its_own(monkeypatch, make, sample):
    rng = np.random.default_rng(0)
    models = [nn.Sequential([make(), nn.ReLU(), make()], sample, xp=np, dtype=np.float64) for _ in range(2)]
    bias = rng.standard_normal(models[0].layers[2].params["b"].shape)
    for model in models:
        model.init_params(1)
        model.layers[2].params["b"][...] = bias  # (not zero: the path adds it)
    x = rng.standard_normal((3,) + sample)
    # (the second model's convolutions run through the path, numpy standing in for cuDNN)
    made, references = {}, {}
    for index in (0, 2):
        layer = models[1].layers[index]
        references[id(layer)] = nn.Sequential([make()], models[1].shapes[index], xp=np, dtype=np.float64)

    def plans_for(layer, images):
        if id(layer) not in references:
            return None
        key = (id(layer), images.shape, element_strides(images))
        if key not in made:
            made[key] = NumpyPlans(layer, images, references[id(layer)].layers[0])
        return made[key]

    monkeypatch.setattr(cudnn_conv, "plans_for", plans_for)
    outputs = [model.forward(x, training=True) for model in models]
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(outputs[0].shape)
    for model in models:
        model.backward(dy, input_grad=True)
    np.testing.assert_allclose(models[1].grads, models[0].grads, rtol=1e-12, atol=1e-12)
    assert sorted(call for plans in made.values() for call in plans.calls) == sorted(
        ["forward"] * 2 + ["weight_grad"] * 2 + ["input_grad"] * 2
    )


def test_a_plan_that_fails_to_run_sends_its_shape_to_mpidists_own_path(monkeypatch):
    class Failing:
        def forward(self, x, w, y):
            raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    def plans_for(layer, images):
        made = layer.__dict__.setdefault("_cudnn_plans", {})
        key = (images.shape, element_strides(images), images.dtype.str)
        if key not in made:
            made[key] = Failing()
            cudnn_conv.PATHS["cudnn"] += 1
        return made[key]

    rng = np.random.default_rng(1)
    models = [nn.Sequential([nn.Conv2D(3)], (2, 5, 5), xp=np, dtype=np.float64) for _ in range(2)]
    for model in models:
        model.init_params(2)
    x = rng.standard_normal((4, 2, 5, 5))
    expected = models[0].forward(x, training=True)
    monkeypatch.setattr(cudnn_conv, "plans_for", plans_for)
    monkeypatch.setattr(cudnn_conv, "PATHS", cudnn_conv.collections.Counter())
    np.testing.assert_array_equal(models[1].forward(x, training=True), expected)
    assert models[1].layers[0].cudnn is None  # (its backward: mpidist's own too)
    assert dict(cudnn_conv.PATHS) == {
        "cudnn": 0,
        "im2col: running its plan: RuntimeError: CUDNN_STATUS_EXECUTION_FAILED": 1,
    }
    assert list(models[1].layers[0]._cudnn_plans.values()) == [None]
