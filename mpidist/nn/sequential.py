"""Sequential models whose parameters and gradients live in flat buffers.

Every parameter tensor is a view into ``model.params`` (one contiguous 1-D
array) and every gradient a view into ``model.grads``; collectives, shards,
windows and checkpoints move slices of these buffers, never single tensors.
Where each parameter lives in them (and each element's initial value) is the
model's map, :class:`~mpidist.nn.parameter_map.ParameterMap`, which
:class:`Sequential` extends with the buffers, the random streams and the passes.
"""

import numpy as np

from ..runtime.memory import check_fits
from ..runtime.recorder import tracer
from ..runtime import aligned
from .draws import KeyedDraws
from .parameter_map import ParameterMap, walk
from .workspace import Workspace

_TRACER = tracer()


class Sequential(ParameterMap):
    """Layers applied in order to samples of shape ``input_shape``, on flat buffers of parameters and
    gradients.

    Args:
        layers: the layers, first to last.
        input_shape: shape of one sample (without the batch axis).
        xp: array module (numpy or cupy).
        dtype: parameter and activation dtype.
        buffers: make the flat buffers now (and bind every layer's ``params`` and ``grads`` to them); with
            False they are made when first used (:attr:`params`, :attr:`grads`, a pass): the run's set-up
            builds the whole model so, as a map of shapes, and each rank makes the buffers of what it holds.
    """

    def __init__(self, layers, input_shape, xp=np, dtype=np.float32, buffers=True):
        layers, self.xp = list(layers), xp
        _refuse_repeated(layers)
        # arrays the training passes reuse from step to step (see mpidist.nn.workspace)
        self.workspace = Workspace(xp)
        for _, node in walk(layers):  # (before any layer is built: a build may use its xp)
            node.xp = xp
            node.workspace = self.workspace
        super().__init__(layers, input_shape, dtype)
        # elementwise layers work in place on what their neighbours hand over (never on the caller's data)
        for index, layer in enumerate(self.layers):
            before = self.layers[index - 1] if index else None
            after = self.layers[index + 1] if index + 1 < len(self.layers) else None
            layer.overwrite_input = getattr(before, "hands_over", False)
            layer.overwrite_grad = getattr(after, "hands_over", False)
        # without ``buffers``, made when first asked for: a model that is a map of shapes (the whole model
        # beside a pipeline stage or a tensor part, each of which holds a buffer of its own) never allocates
        # them
        self._params = self._grads = None
        self.shapes_only = False
        #: what binds each top-level layer's parameters before it runs, where the model's buffers are never
        #: whole (``--shard parameters``): an object with ``forward(index)`` and ``backward(index)``, called
        #: before layer ``index`` runs that pass; None: every layer is bound to the flat buffers
        self.gate = None
        if buffers:
            self.bind_params(self._zeros("values"), copy=False)
            self.bind_grads(self._zeros("gradients"))
        self.random_layers = [(path, layer) for path, layer in walk(self.layers) if hasattr(layer, "rng")]
        self.reseed(0)

    @property
    def params(self):
        """The flat parameter buffer (made, zeros, on first use)."""
        if self._params is None:
            self.bind_params(self._zeros("values"), copy=False)
        return self._params

    @params.setter
    # (``model.params += noise`` and ``model.params = array``: values into the buffer)
    def params(self, values):
        if values is not self._params:
            self.params[...] = values

    @property
    def grads(self):
        """The flat gradient buffer (made, zeros, on first use)."""
        if self._grads is None:
            self.bind_grads(self._zeros("gradients"))
        return self._grads

    @grads.setter
    def grads(self, values):
        if values is not self._grads:
            self.grads[...] = values

    def _zeros(self, what):
        """A buffer of ``num_params`` zeros, after checking it fits (sizes come from the data: a dataset's
        ``num_classes``)."""
        if self.shapes_only:
            raise RuntimeError(
                f"this model of {self.num_params:,} parameters is a map of shapes: its layers' "
                f"{what} live in the buffers of the part of it this rank holds"
            )
        check_fits(
            self.num_params * self.dtype.itemsize, f"the {what} of a model of {self.num_params:,} parameters"
        )
        return aligned.zeros(self.xp, self.num_params, self.dtype)

    def bind_params(self, buffer, copy=True):
        """Move the parameters into ``buffer[:num_params]`` (values copied) and rebind every layer.

        Strategies call this to place the parameters inside a larger buffer
        that MPI fills directly (e.g. followed by the loss), or in memory
        shared with other processes (``copy=False``: one of them fills it).
        """
        if copy and self._params is not None:
            buffer[: self.num_params] = self._params
        self._params = buffer[: self.num_params]
        for layer, name, lo, pshape, _ in self.entries:
            layer.params[name] = self._params[lo : lo + int(np.prod(pshape))].reshape(pshape)

    def bind_grads(self, buffer):
        """Make every layer write its gradients into ``buffer[:num_params]``.

        Strategies call this to place the gradients inside a larger exchange
        buffer (e.g. followed by the loss), so no copy is needed before MPI.
        """
        self._grads = buffer[: self.num_params]
        for layer, name, lo, pshape, _ in self.entries:
            layer.grads[name] = self._grads[lo : lo + int(np.prod(pshape))].reshape(pshape)

    def unbind_grads(self):
        """Let go of the gradient buffer (a finished run's, in memory about to be freed): the layers hold no
        view of it, and the next ``backward`` makes a buffer of its own."""
        self._grads = None
        for layer, name, *_ in self.entries:
            layer.grads[name] = None

    def init_params(self, seed):
        """Fill ``params`` from ``seed`` (drawn on the host, so identical on any device):
        :meth:`initial_values` of every element."""
        if self.xp is np:
            self.initial_values(seed, range(self.num_params), out=self.params)
        else:
            self.params[...] = self.xp.asarray(self.initial_values(seed, range(self.num_params)))

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
            # ``stream``: a tensor part's own
            seed = int(
                np.random.SeedSequence([*key, *path, *getattr(layer, "stream", ())]).generate_state(
                    1, dtype=np.uint64
                )[0]
            )
            if self.xp is np:
                layer.rng = np.random.default_rng(seed)
                continue
            # on a GPU the layer keeps its draws and their key moves on: a pass replayed as a CUDA graph
            # reads the key from device memory (mpidist.nn.draws)
            if not isinstance(layer.rng, KeyedDraws):
                layer.rng = KeyedDraws(self.xp)
            layer.rng.set(seed)

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
        gate = self.gate
        if self._params is None and gate is None:  # (the layers read their views of the buffer)
            self.params
        detail = _TRACER.detail and _TRACER.on
        for index, layer in enumerate(self.layers):
            if gate is not None:
                gate.forward(index)
            if detail:  # --trace detail: each layer a span
                with _TRACER.span(type(layer).__name__, "compute", layer=index):
                    x = layer.forward(x, training)
            else:
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
        gate = self.gate
        if self._grads is None and gate is None:  # (the layers write into their views of the buffer)
            self.grads
        # without an input gradient, backward stops at the first layer with parameters: nothing below it
        # is trained (a Flatten), and its own input gradient would cost a whole matrix product
        last = 0 if input_grad else self.first_trained
        detail = _TRACER.detail and _TRACER.on
        for index in range(len(self.layers) - 1, last, -1):
            if gate is not None:
                gate.backward(index)
            if detail:  # --trace detail: each layer a span
                with _TRACER.span(type(self.layers[index]).__name__, "compute", layer=index):
                    dy = self.layers[index].backward(dy)
            else:
                dy = self.layers[index].backward(dy)
            if ready is not None:
                ready(self.offsets[index])
        if not self.layers:
            return dy
        if gate is not None:
            gate.backward(last)
        if input_grad:
            dy = self.layers[0].backward(dy)
        else:
            self.layers[last].backward_params(dy)
            dy = None
        if ready is not None:
            ready(0)
        return dy


class RepeatedLayer(ValueError):
    """One layer object at two places of a model."""


def _refuse_repeated(layers):
    """Refuse one layer object at two places of a model: a layer holds one place's parameters, caches and
    gradients, so the second place would overwrite the first's (its gradients came out wrong)."""
    seen = {}
    for path, node in walk(layers):
        if id(node) in seen:
            raise RepeatedLayer(
                f"the same layer object, {node!r}, is at {seen[id(node)]} and at {path} of the model: give "
                "each place a layer of its own (a new one; its parameters are its own)"
            )
        seen[id(node)] = path
