"""Sequential models whose parameters and gradients live in flat buffers.

Every parameter tensor is a view into ``model.params`` (one contiguous 1-D
array) and every gradient a view into ``model.grads``; collectives, shards,
windows and checkpoints move slices of these buffers, never single tensors.
"""

import numpy as np

from ..runtime.memory import check_fits
from ..runtime.recorder import tracer
from .layers import ShapeError
from .workspace import Workspace

_TRACER = tracer()


def walk(layers, path=()):
    """``(path, layer)`` for every layer of the tree under ``layers``, depth-first, parents first.

    ``path`` is the tuple of indices from the top level down: ``(3,)`` is
    ``layers[3]``, ``(3, 1)`` the second sublayer of that block.
    """
    for index, layer in enumerate(layers):
        yield path + (index,), layer
        # getattr: stash() also walks extra objects (a loss) that are not Layers
        yield from walk(getattr(layer, "sublayers", list)(), path + (index,))


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
        # arrays the training passes reuse from step to step (see mpidist.nn.workspace)
        self.workspace = Workspace(xp)
        self.entries = []  # (layer, name, offset, shape, initialiser), depth-first over the layer tree
        self.shapes = []   # input shape of each top-level layer
        self.offsets = []  # where each top-level layer's parameters (its sublayers' included) start in the buffer
        shape, offset = self.input_shape, 0
        for index, layer in enumerate(self.layers):
            for _, node in walk([layer]):
                node.xp = xp
                node.workspace = self.workspace
            self.shapes.append(tuple(shape))
            self.offsets.append(offset)
            try:
                shape = layer.build(shape)
            except ShapeError as err:
                raise ShapeError(f"layer {index} ({layer!r}): {err}") from None
            # a block's sublayers are built by its own build; their specs follow the block's own
            for _, node in walk([layer]):
                for name, pshape, initialiser in node.param_specs():
                    self.entries.append((node, name, offset, tuple(pshape), initialiser))
                    offset += int(np.prod(pshape))
        # elementwise layers work in place on what their neighbours hand over (never on the caller's data)
        for index, layer in enumerate(self.layers):
            before = self.layers[index - 1] if index else None
            after = self.layers[index + 1] if index + 1 < len(self.layers) else None
            layer.overwrite_input = getattr(before, "hands_over", False)
            layer.overwrite_grad = getattr(after, "hands_over", False)
        self.output_shape = tuple(shape)
        self.num_params = offset
        # the first top-level layer with parameters (its sublayers' included): where backward without an
        # input gradient stops
        ends = self.offsets[1:] + [offset]
        self.first_trained = next((i for i, (lo, hi) in enumerate(zip(self.offsets, ends)) if hi > lo), 0)
        # sizes come from the data (a dataset's num_classes): checked before the buffers are allocated
        check_fits(2 * offset * self.dtype.itemsize, f"a model of {offset:,} parameters (values and gradients)")
        self.bind_params(xp.zeros(offset, dtype=self.dtype))
        self.bind_grads(xp.zeros(offset, dtype=self.dtype))
        self.random_layers = [(path, layer) for path, layer in walk(self.layers) if hasattr(layer, "rng")]
        self.reseed(0)

    def bind_params(self, buffer, copy=True):
        """Move the parameters into ``buffer[:num_params]`` (values copied) and rebind every layer.

        Strategies call this to place the parameters inside a larger buffer
        that MPI fills directly (e.g. followed by the loss), or in memory
        shared with other processes (``copy=False``: one of them fills it).
        """
        if copy and hasattr(self, "params"):
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
        """Number of parameters of top-level layer ``index``, its sublayers' included."""
        owners = {id(node) for _, node in walk([self.layers[index]])}
        return sum(int(np.prod(pshape)) for owner, _, _, pshape, _ in self.entries if id(owner) in owners)

    def running_entries(self):
        """``(lo, hi)`` flat ranges of the entries that live in ``params`` but are not trained.

        A layer names them in its ``running`` class attribute (BatchNorm's
        running statistics): ``backward`` writes zeros into their gradients and
        ``forward(training=True)`` updates them in place, so a strategy that
        keeps replicas apart (unsynchronised BatchNorm, parameter servers) has
        to average or copy these ranges itself.
        """
        return [(lo, lo + int(np.prod(pshape))) for layer, name, lo, pshape, _ in self.entries
                if name in getattr(layer, "running", ())]

    def decay_ranges(self):
        """``(lo, hi)`` flat ranges of the parameters weight decay applies to (see :meth:`Layer.decays`).

        Running statistics never decay; adjacent ranges are merged.
        """
        ranges = []
        for layer, name, lo, pshape, _ in self.entries:
            if name in getattr(layer, "running", ()) or not layer.decays(name, pshape):
                continue
            hi = lo + int(np.prod(pshape))
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        return ranges

    def stash(self, extra=()):
        """What every layer's ``forward`` left for ``backward`` (and ``extra`` objects'), to restore later.

        A pipeline keeps one stash per micro-batch in flight: these are the
        activations a stage holds.  Sublayers of blocks are included.
        """
        return [{name: getattr(obj, name) for name in obj.cache} for _, obj in walk((*self.layers, *extra))]

    def restore(self, stash, extra=()):
        """Put back a :meth:`stash` before the matching ``backward``."""
        for (_, obj), saved in zip(walk((*self.layers, *extra)), stash):
            for name, value in saved.items():
                setattr(obj, name, value)

    def reseed(self, *key):
        """Give every random layer a fresh stream derived from ``key`` (e.g. seed, worker, step).

        A layer's stream also depends on its path in the tree, so a top-level
        layer ``i`` draws from ``[*key, i]`` and a Dropout inside block ``i``
        from ``[*key, i, j]``: no two layers share a stream.
        """
        for path, layer in self.random_layers:
            # an int seed: cupy's default_rng does not take numpy seed arrays; ``stream``: a tensor part's own
            seed = int(np.random.SeedSequence([*key, *path, *getattr(layer, "stream", ())])
                       .generate_state(1, dtype=np.uint64)[0])
            layer.rng = self.xp.random.default_rng(seed)

    def use_workspace(self, loss):
        """Let ``loss`` (a strategy's) reuse its arrays too, in the model's workspace."""
        loss.workspace = self.workspace

    def forward(self, x, training=False):
        """``(N, *input_shape) -> (N, *output_shape)``.

        A training pass computes into the model's workspace: its output (and
        what ``backward`` returns) is overwritten by the next training pass.
        Inference (``training=False``) returns arrays of its own.
        """
        self.workspace.active = bool(training)
        if _TRACER.detail and _TRACER.on:     # --trace detail: each layer a span
            for index, layer in enumerate(self.layers):
                with _TRACER.span(type(layer).__name__, "compute", layer=index):
                    x = layer.forward(x, training)
            return x
        for layer in self.layers:
            x = layer.forward(x, training)
        return x

    def backward(self, dy, input_grad=True, ready=None):
        """Back-propagate ``dy`` and fill ``grads``; returns the input gradient.

        With ``input_grad=False`` (returns None) backward stops at the first
        layer with parameters and skips its input gradient: nobody uses it when
        the input is data, and it costs a whole matrix product (a Dense after a
        Flatten; a col2im for convolutions).

        ``ready(lo)``, where given, is called after each top-level layer with
        the offset above which ``grads`` is final (layers fill the buffer from
        the top down): a data-parallel exchange starts on those buckets while
        backward goes on.
        """
        # without an input gradient, backward stops at the first layer with parameters: nothing below it
        # is trained (a Flatten), and its own input gradient would cost a whole matrix product
        last = 0 if input_grad else self.first_trained
        detail = _TRACER.detail and _TRACER.on
        for index in range(len(self.layers) - 1, last, -1):
            if detail:     # --trace detail: each layer a span
                with _TRACER.span(type(self.layers[index]).__name__, "compute", layer=index):
                    dy = self.layers[index].backward(dy)
            else:
                dy = self.layers[index].backward(dy)
            if ready is not None:
                ready(self.offsets[index])
        if not self.layers:
            return dy
        if input_grad:
            dy = self.layers[0].backward(dy)
        else:
            self.layers[last].backward_params(dy)
            dy = None
        if ready is not None:
            ready(0)
        return dy
