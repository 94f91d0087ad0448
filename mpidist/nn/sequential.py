"""Sequential models whose parameters and gradients live in flat buffers.

Every parameter tensor is a view into ``model.params`` (one contiguous 1-D
array) and every gradient a view into ``model.grads``; collectives, shards,
windows and checkpoints move slices of these buffers, never single tensors.
"""

import numpy as np

from ..runtime.memory import check_fits
from ..runtime.recorder import tracer
from . import init
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


def _groups(keys):
    """``(key, where)`` for each distinct value of ``keys`` (int array), ``where`` the places that hold it: slices
    where ``keys`` is sorted (a range of positions, the common case), else index arrays."""
    if np.all(keys[1:] >= keys[:-1]):
        bounds = [0, *(np.flatnonzero(keys[1:] != keys[:-1]) + 1), len(keys)]
        return [(int(keys[lo]), slice(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    order = np.argsort(keys, kind="stable")
    values, firsts = np.unique(keys[order], return_index=True)
    return [(int(value), order[lo:hi]) for value, lo, hi in zip(values, firsts, [*firsts[1:], len(order)])]


class Sequential:
    """Layers applied in order to samples of shape ``input_shape``.

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
        self.layers, self.xp, self.dtype = list(layers), xp, np.dtype(dtype)
        self.input_shape = tuple(int(d) for d in input_shape)
        # arrays the training passes reuse from step to step (see mpidist.nn.workspace)
        self.workspace = Workspace(xp)
        self.entries = []  # (layer, name, offset, shape, initialiser), depth-first over the layer tree
        self.shapes = []  # input shape of each top-level layer
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
        # without ``buffers``, made when first asked for: a model that is a map of shapes (the whole model beside
        # a pipeline stage or a tensor part, each of which holds a buffer of its own) never allocates them
        self._params = self._grads = None
        self.shapes_only = False
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
    def params(
        self, values
    ):  # (``model.params += noise`` and ``model.params = array``: values into the buffer)
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
        return self.xp.zeros(self.num_params, dtype=self.dtype)

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

    def init_params(self, seed):
        """Fill ``params`` from ``seed`` (drawn on the host, so identical on any device): :meth:`initial_values`
        of every element."""
        if self.xp is np:
            self.initial_values(seed, range(self.num_params), out=self.params)
        else:
            self.params[...] = self.xp.asarray(self.initial_values(seed, range(self.num_params)))

    def initial_values(self, seed, positions, out=None, chunk=1 << 18, whole=None):
        """The initial values of the elements at ``positions`` (an int64 array, or a ``range``) of the flat buffer,
        as a host array of ``dtype`` (``out``, where given).

        Element ``i`` of entry ``e`` is ``initialiser.values(parameter_key(seed, e), i)``
        (:mod:`mpidist.nn.init`): a function of the seed, the parameter and the element alone, so a rank holding
        a slice of this model (a stage's elements, a tensor part's regions) draws exactly that slice and gets
        what a whole draw would give.  Computed ``chunk`` elements at a time; an initialiser of one's own
        ``(rng, shape)`` is drawn whole for a parameter, once for calls that pass the same ``whole`` (a dict).
        """
        out = np.empty(len(positions), dtype=self.dtype) if out is None else out
        starts = np.array([lo for _, _, lo, _, _ in self.entries], dtype=np.int64)
        whole = {} if whole is None else whole  # a plain initialiser's last whole draw: (entry, values)
        for begin in range(0, len(positions), chunk):
            part = positions[begin : begin + chunk]
            part = (
                np.arange(part.start, part.stop, dtype=np.int64)
                if isinstance(part, range)
                else np.asarray(part, dtype=np.int64)
            )
            owners = np.searchsorted(starts, part, side="right") - 1
            for entry, picked in _groups(owners):
                index = part[picked] - starts[entry]
                out[begin : begin + len(part)][picked] = self.entry_values(seed, int(entry), index, whole)
        return out

    def entry_values(self, seed, entry, index, whole):
        """float64 initial values of elements ``index`` (int64, C order) of entry ``entry``; ``whole``: a dict
        keeping an initialiser of one's own's last whole draw (see :meth:`initial_values`)."""
        _, name, _, pshape, initialiser = self.entries[entry]
        if isinstance(initialiser, init.Initialiser):
            return initialiser.values(self.parameter_key(seed, entry), index)
        if whole.get("entry") != entry:
            drawn = np.asarray(initialiser(np.random.default_rng([seed, entry]), pshape), dtype=np.float64)
            if drawn.size != int(np.prod(pshape)):
                raise ValueError(f"the initialiser of parameter {name} {pshape} gave {drawn.size} values")
            whole.update(entry=entry, values=drawn.reshape(-1))
        return whole["values"][index]

    @staticmethod
    def parameter_key(seed, entry):
        """The key of entry ``entry``'s draws (its index in :attr:`entries` of the whole model) under ``seed``."""
        return np.random.SeedSequence([seed, entry]).generate_state(1, dtype=np.uint64)[0]

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
        return [
            (lo, lo + int(np.prod(pshape)))
            for layer, name, lo, pshape, _ in self.entries
            if name in getattr(layer, "running", ())
        ]

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
            seed = int(
                np.random.SeedSequence([*key, *path, *getattr(layer, "stream", ())]).generate_state(
                    1, dtype=np.uint64
                )[0]
            )
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
        if self._params is None:  # (the layers read their views of the buffer)
            self.params
        if _TRACER.detail and _TRACER.on:  # --trace detail: each layer a span
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
        if self._grads is None:  # (the layers write into their views of the buffer)
            self.grads
        # without an input gradient, backward stops at the first layer with parameters: nothing below it
        # is trained (a Flatten), and its own input gradient would cost a whole matrix product
        last = 0 if input_grad else self.first_trained
        detail = _TRACER.detail and _TRACER.on
        for index in range(len(self.layers) - 1, last, -1):
            if detail:  # --trace detail: each layer a span
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
