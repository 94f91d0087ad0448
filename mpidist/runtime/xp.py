"""numpy/cupy dispatch: which array module this rank computes with, on which device."""

import os

import numpy as np

from .errors import UsageError


def _cupy_devices():
    """``(cupy, number of GPUs)``, or ``(None, 0)`` when cupy or a GPU is missing."""
    try:
        import cupy

        return cupy, cupy.cuda.runtime.getDeviceCount()
    except Exception:  # not installed, no driver, no device: all mean "no GPU here"
        return None, 0


def select_device(device, local_rank):
    """The array module and a device label for this rank.

    Args:
        device: "cpu", "gpu" or "auto" (a GPU when cupy finds one, else the CPU).
        local_rank: this rank's index on its node; GPU ``local_rank % count``.

    Returns:
        ``(xp, label)``, e.g. ``(numpy, "cpu")`` or ``(cupy, "gpu1")``.
    """
    if device == "cpu":
        return np, "cpu"
    cupy, count = _cupy_devices()
    if count == 0:
        if device == "gpu":
            raise UsageError(
                "--device gpu needs cupy and a CUDA GPU; none was found "
                "(pip install 'mpidist[gpu]', or use --device cpu)"
            )
        return np, "cpu"
    index = local_rank % count
    cupy.cuda.Device(index).use()
    return cupy, f"gpu{index}"


def is_device_array(array):
    """True for arrays in GPU memory (they expose ``__cuda_array_interface__``)."""
    return hasattr(array, "__cuda_array_interface__")


def to_host(array):
    """A numpy copy (or the array itself if it already is numpy)."""
    return array.get() if is_device_array(array) else np.asarray(array)


def turned_off(variable):
    """Whether environment variable ``variable`` turns a GPU path off (``0``, ``false`` or ``no``)."""
    return os.environ.get(variable, "").strip().lower() in ("0", "false", "no")


def capturing(xp):
    """Whether ``xp``'s current stream is being captured into a CUDA graph (:mod:`mpidist.nn.graphs`): an
    error then is the capture's, not the operation's."""
    return xp.__name__ != "numpy" and xp.cuda.get_current_stream().is_capturing()
