"""The same model in PyTorch, where torch is installed: ``bench``'s outside reference.

torch is never a dependency of mpidist: without it ``bench`` leaves its rows
out and says so.  The model is translated layer by layer from mpidist's
(Dense, ReLU, Flatten, Dropout, Conv1D/2D with integer or "same" padding,
max pooling), trained with the same loss and the same SGD with momentum, on
the same number of threads as mpidist's BLAS.
"""

import importlib

from ..runtime.threads import limit_blas_threads


def available():
    """Whether torch can be imported."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


def _translate(torch, layer):
    """The torch module doing what mpidist's ``layer`` does, or None where there is no exact counterpart."""
    kind, tnn = type(layer).__name__, torch.nn
    if kind == "Dense":
        return tnn.Linear(layer.fan_in, layer.units)
    if kind == "ReLU":
        return tnn.ReLU()
    if kind == "Flatten":
        return tnn.Flatten()
    if kind == "Dropout":
        return tnn.Dropout(layer.rate)
    if kind in ("Conv1D", "Conv2D"):
        before, after = layer.pads
        if before != after or layer.stride != 1 and before:
            return None
        conv = tnn.Conv1d if kind == "Conv1D" else tnn.Conv2d
        return conv(layer.in_channels, layer.filters, layer.kernel, stride=layer.stride, padding=before)
    if kind in ("MaxPool1D", "MaxPool2D"):
        return (tnn.MaxPool1d if kind == "MaxPool1D" else tnn.MaxPool2d)(layer.size)
    return None


def torch_step(model, x, y, lr=0.01, momentum=0.9, device="cpu"):
    """A function taking one torch training step of ``model``'s layers on ``(x, y)``, or None without torch.

    None as well where a layer has no exact torch counterpart.  On ``device="cuda"`` the step
    waits for the GPU before it returns, so that a host clock around it times the work.
    """
    if not available():
        return None
    import torch

    torch.set_num_threads(limit_blas_threads())
    modules = [_translate(torch, layer) for layer in model.layers]
    if any(module is None for module in modules):
        return None
    net = torch.nn.Sequential(*modules).to(device)
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    inputs, labels = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    finish = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    loss_of = torch.nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=False)
        loss = loss_of(net(inputs), labels)
        loss.backward()
        optimizer.step()
        finish()

    return step
