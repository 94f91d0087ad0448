"""An optimizer's update as one function of its arrays, which a GPU runs as one kernel.

On the host an update goes through the buffer in cache-sized blocks, one
numpy operation at a time (:mod:`mpidist.nn.optimizers`).  On a GPU each of
those operations was a kernel of its own over the whole buffer: Adam's
update was 12 launches and 12 passes over memory, where one kernel reads
each array once.  The functions here are that kernel's body, written with
Python's operators only (``v ** 0.5``, not a module's ``sqrt``) in the order
the host's blocks compute, so the very same function is numpy code on the
host (the tests compare it with the blocked update there) and, wrapped by
``cupy.fuse``, one kernel on a GPU (:func:`on_device`).
"""

import functools


def adam_update(params, grads, m, v, beta1, beta2, step_size, unbias, eps):
    """Adam's step in place: the moments, then ``params -= m / (sqrt(v) x unbias + eps) x step_size``
    (``step_size = lr / (1 - beta1^t)``, ``unbias = 1 / sqrt(1 - beta2^t)``)."""
    m *= beta1
    m += grads * (1 - beta1)
    v *= beta2
    v += grads * grads * (1 - beta2)
    params -= m / (v**0.5 * unbias + eps) * step_size


def sgd_update(params, grads, velocity, momentum, lr):
    """SGD's step with heavy-ball momentum in place: ``v = momentum x v + g``; ``params -= v x lr``."""
    velocity *= momentum
    velocity += grads
    params -= velocity * lr


@functools.lru_cache(maxsize=None)
def on_device(update):
    """``update`` as one GPU kernel (``cupy.fuse``: compiled once per dtype, cached)."""
    import cupy

    return cupy.fuse(kernel_name=update.__name__)(update)
