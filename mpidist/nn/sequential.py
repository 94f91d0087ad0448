"""Sequential models whose parameters and gradients live in flat buffers.

Every parameter tensor is a view into ``model.params`` (one contiguous 1-D
array) and every gradient a view into ``model.grads``; collectives, shards,
windows and checkpoints move slices of these buffers, never single tensors.
"""

import numpy as np

from .layers import ShapeError


class Sequential:
    """Layers applied in order to samples of shape ``input_shape``.

    Args:
        layers: the layers, first to last.
        input_shape: shape of one sample (without the batch axis).
        xp: array module (numpy or cupy).
        dtype: parameter and activation dtype.
    """

    def __init__(self, layers, input_shape, xp=np, dtype=np.float32):
        self.layers, self.xp, self.dtype = list(layers), xp, np.dtype(dtype)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.entries = []  # (layer, name, offset, shape, initialiser)
        self.shapes = []   # input shape of each layer
        shape, offset = self.input_shape, 0
        for index, layer in enumerate(self.layers):
            layer.xp = xp
            self.shapes.append(tuple(shape))
            try:
                shape = layer.build(shape)
            except ShapeError as err:
                raise ShapeError(f"layer {index} ({layer!r}): {err}") from None
            for name, pshape, initialiser in layer.param_specs():
                self.entries.append((layer, name, offset, tuple(pshape), initialiser))
                offset += int(np.prod(pshape))
        self.output_shape = tuple(shape)
        self.num_params = offset
        self.bind_params(xp.zeros(offset, dtype=self.dtype))
        self.bind_grads(xp.zeros(offset, dtype=self.dtype))
        self.reseed(0)

    def bind_params(self, buffer):
        """Move the parameters into ``buffer[:num_params]`` (values copied) and rebind every layer.

        Strategies call this to place the parameters inside a larger buffer
        that MPI fills directly (e.g. followed by the loss).
        """
        if hasattr(self, "params"):
            buffer[:self.num_params] = self.params
        self.params = buffer[:self.num_params]
        for layer, name, lo, pshape, _ in self.entries:
            layer.params[name] = self.params[lo:lo + int(np.prod(pshape))].reshape(pshape)

    def bind_grads(self, buffer):
        """Make every layer write its gradients into ``buffer[:num_params]``.

        Strategies call this to place the gradients inside a larger exchange
        buffer (e.g. followed by the loss), so no copy is needed before MPI.
        """
        self.grads = buffer[:self.num_params]
        for layer, name, lo, pshape, _ in self.entries:
            layer.grads[name] = self.grads[lo:lo + int(np.prod(pshape))].reshape(pshape)

    def init_params(self, seed):
        """Fill ``params`` from ``seed`` (host RNG, so identical on any device)."""
        rng = np.random.default_rng(seed)
        host = np.empty(self.num_params, dtype=self.dtype)
        for _, _, lo, pshape, initialiser in self.entries:
            host[lo:lo + int(np.prod(pshape))] = np.asarray(initialiser(rng, pshape)).ravel()
        self.params[...] = self.xp.asarray(host)

    def layer_params(self, index):
        """Number of parameters of layer ``index``."""
        layer = self.layers[index]
        return sum(int(np.prod(pshape)) for owner, _, _, pshape, _ in self.entries if owner is layer)

    def stash(self, extra=()):
        """What every layer's ``forward`` left for ``backward`` (and ``extra`` objects'), to restore later.

        A pipeline keeps one stash per micro-batch in flight: these are the
        activations a stage holds.
        """
        return [{name: getattr(obj, name) for name in obj.cache} for obj in (*self.layers, *extra)]

    def restore(self, stash, extra=()):
        """Put back a :meth:`stash` before the matching ``backward``."""
        for obj, saved in zip((*self.layers, *extra), stash):
            for name, value in saved.items():
                setattr(obj, name, value)

    def reseed(self, *key):
        """Give every random layer a fresh stream derived from ``key`` (e.g. seed, worker, step)."""
        for index, layer in enumerate(self.layers):
            if hasattr(layer, "rng"):
                # an int seed: cupy's default_rng does not take numpy seed arrays
                seed = int(np.random.SeedSequence([*key, index]).generate_state(1, dtype=np.uint64)[0])
                layer.rng = self.xp.random.default_rng(seed)

    def forward(self, x, training=False):
        """``(N, *input_shape) -> (N, *output_shape)``."""
        for layer in self.layers:
            x = layer.forward(x, training)
        return x

    def backward(self, dy, input_grad=True):
        """Back-propagate ``dy`` and fill ``grads``; returns the input gradient.

        With ``input_grad=False`` the first layer skips its input gradient
        (returns None): nobody uses it when the input is data, and it costs a
        whole matrix product (a col2im for convolutions).
        """
        for layer in reversed(self.layers[1:]):
            dy = layer.backward(dy)
        if not self.layers:
            return dy
        if input_grad:
            return self.layers[0].backward(dy)
        self.layers[0].backward_params(dy)
        return None
