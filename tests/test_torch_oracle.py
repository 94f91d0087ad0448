"""Every layer bench translates, against torch's: outputs, input and parameter gradients in float64.

torch is the oracle here (its own layers, written independently), and these
tests prove ``bench``'s reference computes the very function mpidist's model
does, so a speed comparison compares like for like.  torch is never a
dependency: without it these tests skip, saying so -- unless
``MPIDIST_REQUIRE_TORCH=1`` (set by CI), where its absence fails.
"""

import os

import numpy as np
import pytest

from mpidist import nn
from mpidist.bench.torch_layers import copy_parameters, pairs, torch_model, translate


def _torch():
    try:
        import torch
    except ImportError:
        reason = "torch is not installed (pip install torch==2.13.0)"
        if os.environ.get("MPIDIST_REQUIRE_TORCH") == "1":
            pytest.fail(reason + ", and MPIDIST_REQUIRE_TORCH=1 says these tests must run")
        pytest.skip(reason)
    torch.set_num_threads(1)
    return torch


def _sequences(layers, length, features):
    return nn.Sequential(layers, (length, features), np, np.float64)


#: models of every layer kind the translation knows, small enough for float64 in a moment
MODELS = {
    "mlp": lambda: nn.build_model("mlp", (8, 8), 10, np, np.float64),
    "cnn": lambda: nn.build_model("cnn:4,6", (10, 10), 10, np, np.float64),
    "cnn-1d": lambda: nn.build_model("cnn:4,4", (24,), 10, np, np.float64),
    "transformer": lambda: nn.build_model("transformer:2,16,4,3", (12,), 10, np, np.float64),
    "pools and smooth activations": lambda: nn.Sequential(
        [
            nn.Conv2D(3, kernel=2, padding=0),
            nn.Tanh(),
            nn.AvgPool2D(2),
            nn.Conv2D(4, kernel=3, stride=2, padding=1),
            nn.Sigmoid(),
            nn.GlobalAvgPool(),
            nn.Dense(5),
        ],
        (2, 9, 9),
        np,
        np.float64,
    ),
    "causal attention, class token, residual": lambda: _sequences(
        [
            nn.ClassToken(),
            nn.Residual(nn.LayerNorm(), nn.MultiHeadAttention(2, causal=True)),
            nn.Residual(nn.Dense(12), nn.GELU(), nn.Dense(6)),
            nn.SequencePool("first"),
            nn.Dense(3),
        ],
        7,
        6,
    ),
}


@pytest.mark.parametrize("name", MODELS)
def test_the_translation_computes_what_the_layers_do(name):
    """Forward, the input gradient and every parameter gradient equal torch's to 1e-10."""
    torch = _torch()
    model = MODELS[name]()
    model.init_params(3)
    net = torch_model(torch, model)
    assert net is not None, f"{name}: a layer has no translation"
    net.eval()  # (dropout off: mpidist's forward is not training here either)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5,) + model.input_shape)
    y = model.forward(x)
    inputs = torch.from_numpy(x).requires_grad_()
    theirs = net(inputs)
    np.testing.assert_allclose(y, theirs.detach().numpy(), rtol=1e-10, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    model.grads[...] = 0
    dx = model.backward(dy.copy())
    theirs.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(dx, inputs.grad.numpy(), rtol=1e-10, atol=1e-12)
    compared = 0
    for layer, module in zip(model.layers, net):
        for grad, parameter in pairs(layer, module, "grads"):
            np.testing.assert_allclose(
                np.asarray(grad).reshape(parameter.shape), parameter.grad.numpy(), rtol=1e-10, atol=1e-12
            )
            compared += grad.size
    assert compared == model.num_params


def test_embedding_rows_and_their_gradients_are_torchs():
    torch = _torch()
    model = nn.Sequential(
        [nn.Embedding(11, 6), nn.PositionalEmbedding(8), nn.SequencePool("mean"), nn.Dense(4)],
        (8,),
        np,
        np.float64,
    )
    model.init_params(1)
    net = torch_model(torch, model)
    ids = np.random.default_rng(2).integers(0, 11, (6, 8)).astype(np.float64)
    ids[:, :3] = 4  # repeated ids: their gradients add up
    y = model.forward(ids)
    theirs = net(torch.from_numpy(ids))
    np.testing.assert_allclose(y, theirs.detach().numpy(), rtol=1e-10, atol=1e-12)
    dy = np.random.default_rng(3).standard_normal(y.shape)
    model.grads[...] = 0
    model.backward(dy.copy(), input_grad=False)
    theirs.backward(torch.from_numpy(dy))
    for layer, module in zip(model.layers, net):
        for grad, parameter in pairs(layer, module, "grads"):
            np.testing.assert_allclose(
                np.asarray(grad).reshape(parameter.shape), parameter.grad.numpy(), 1e-10
            )


@pytest.mark.parametrize(
    "layer",
    [
        nn.BatchNorm(),
        nn.Conv2D(2, kernel=2, stride=2),  # "same" of an even kernel pads one side more: torch cannot
        nn.MultiHeadAttention(2, head_dim=3),  # heads narrower than the model: torch cannot
    ],
    ids=repr,
)
def test_a_layer_without_an_exact_counterpart_leaves_torch_out(layer):
    """bench then leaves torch's row out rather than compare different functions."""
    torch = _torch()
    shape = (6, 8) if isinstance(layer, nn.MultiHeadAttention) else (3, 6, 6)
    model = nn.Sequential([layer], shape, np, np.float64)
    assert translate(torch, model.layers[0]) is None
    assert torch_model(torch, model) is None


def test_parameters_held_on_a_gpu_are_copied_through_host_memory():
    """A cupy model's parameters (gpu/bench.py's torch rows) reach torch through ``get()``, as cupy's arrays
    give their host copy."""
    torch = _torch()

    class OnDevice:  # what a cupy array answers here
        __cuda_array_interface__ = {}  # (how mpidist.runtime.xp.to_host tells a GPU array)

        def __init__(self, array):
            self.array = array

        def get(self):
            return self.array.copy()

    model = nn.Sequential([nn.MultiHeadAttention(2)], (5, 4), np, np.float64)
    model.init_params(6)
    layer = model.layers[0]
    module = translate(torch, layer)
    held = dict(layer.params)
    layer.params = {name: OnDevice(array) for name, array in held.items()}
    copy_parameters(torch, layer, module)
    np.testing.assert_array_equal(module.attention.out_proj.weight.detach().numpy(), held["Wo"].T)
    np.testing.assert_array_equal(module.attention.in_proj_weight.detach().numpy()[:4], held["Wq"].T)
