"""The same model in PyTorch, where torch is installed: ``bench``'s outside reference.

torch is never a dependency of mpidist: without it ``bench`` leaves its rows
out and says so.  The model is translated layer by layer from mpidist's
(:mod:`mpidist.bench.torch_layers`: every zoo model's layers, attention and
the sequence layers included), starts from mpidist's parameters, and trains
with the same loss and the same SGD with momentum, on the same number of
threads as mpidist's BLAS.
"""

import contextlib
import importlib

from ..runtime.threads import limit_blas_threads
from .torch_layers import torch_model


def available():
    """Whether torch can be imported."""
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


def torch_threads(count):
    """Set torch's intra-op threads (torch imported)."""
    import torch

    torch.set_num_threads(count)


def torch_trainer(model, x, y, lr=0.01, momentum=0.9, device="cpu", threads=None, autocast=None):
    """``(net, step)``: ``model``'s layers in torch (``net``, from ``model``'s parameters) and a function
    taking one training step of it on ``(x, y)``; None without torch or where a layer has no exact torch
    counterpart.

    ``threads``: torch's intra-op threads (default: as many as mpidist's BLAS).  On ``device="cuda"``
    the step waits for the GPU before it returns, so that a host clock around it times the work.
    ``autocast``: a torch dtype's name (``"bfloat16"``) the forward pass and the loss run in under
    ``torch.autocast``, the parameters and the optimizer staying float32 (``--precision``'s reference).
    """
    if not available():
        return None
    import torch

    torch_threads(threads or limit_blas_threads())
    net = torch_model(torch, model)
    if net is None:
        return None
    net = net.to(device)
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    inputs, labels = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    finish = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    loss_of = torch.nn.CrossEntropyLoss()

    def forward_context():
        if autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.split(":")[0], dtype=getattr(torch, autocast))

    def step(backward_done=None):  # (called when backward returns, where given: bench --layers' clock)
        optimizer.zero_grad(set_to_none=False)
        with forward_context():
            loss = loss_of(net(inputs), labels)
        loss.backward()
        if backward_done is not None:
            backward_done()
        optimizer.step()
        finish()

    return net, step


def torch_step(model, x, y, lr=0.01, momentum=0.9, device="cpu", threads=None, autocast=None):
    """:func:`torch_trainer`'s step alone, or None."""
    made = torch_trainer(model, x, y, lr, momentum, device, threads, autocast)
    return None if made is None else made[1]
