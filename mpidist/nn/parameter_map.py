"""A layer tree laid out on one flat buffer, before any buffer exists: a model as a map of shapes.

Building the layers in order gives each top-level layer its input shape and
the offset of its parameters, and each parameter (a sublayer's too) its place
in the flat buffer: :attr:`ParameterMap.entries`.  What follows from the map
alone lives here: the parameters of a layer, the ranges that are running
statistics or that weight decay applies to, and the initial value of any
element of the buffer (a function of the seed, the parameter and the element,
so a rank draws exactly the slice it holds).
:class:`~mpidist.nn.Sequential` extends it with the buffers, the random
streams and the passes; a run's set-up keeps the whole model as this map
beside the part a rank holds (a pipeline stage, a tensor part).  Its own
module because where everything lives is one concern, apart from running the
layers over the buffers.
"""

import numbers

import numpy as np

from . import init
from .layers import ShapeError


def walk(layers, path=()):
    """``(path, layer)`` for every layer of the tree under ``layers``, depth-first, parents first.

    ``path`` is the tuple of indices from the top level down: ``(3,)`` is
    ``layers[3]``, ``(3, 1)`` the second sublayer of that block.
    """
    for index, layer in enumerate(layers):
        yield path + (index,), layer
        # getattr: stash() also walks extra objects (a loss) that are not Layers
        yield from walk(getattr(layer, "sublayers", list)(), path + (index,))


def _down(layer, path):
    """``(index, sublayer)`` at each level of ``path`` (indices of sublayers) from ``layer`` down."""
    for index in path:
        layer = layer.sublayers()[index]
        yield index, layer


def _groups(keys):
    """``(key, where)`` for each distinct value of ``keys`` (int array), ``where`` the places that hold it:
    slices where ``keys`` is sorted (a range of positions, the common case), else index arrays."""
    if np.all(keys[1:] >= keys[:-1]):
        bounds = [0, *(np.flatnonzero(keys[1:] != keys[:-1]) + 1), len(keys)]
        return [(int(keys[lo]), slice(lo, hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
    order = np.argsort(keys, kind="stable")
    values, firsts = np.unique(keys[order], return_index=True)
    return [(int(value), order[lo:hi]) for value, lo, hi in zip(values, firsts, [*firsts[1:], len(order)])]


def _sizes(shape, what, least=1):
    """``shape`` as a tuple of ints, each ``least`` or more, or a :class:`ShapeError` that says ``what``
    (a user's layer whose build returned None, or a negative size, failed later with a traceback)."""
    try:
        sizes = tuple(shape)
    except TypeError:
        raise ShapeError(f"{what} {shape!r}, not a shape (a tuple of sizes)") from None
    if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= least for d in sizes):
        raise ShapeError(f"{what} {shape!r}: sizes are whole numbers, {least} or more")
    return tuple(int(d) for d in sizes)


class ParameterMap:
    """Layers built in order on samples of shape ``input_shape``, their parameters laid out on one flat
    buffer.

    Args:
        layers: the layers, first to last (built here: each one's ``build`` is given its input shape).
        input_shape: shape of one sample (without the batch axis).
        dtype: parameter and activation dtype.
    """

    def __init__(self, layers, input_shape, dtype=np.float32):
        self.layers, self.dtype = list(layers), np.dtype(dtype)
        self.input_shape = tuple(int(d) for d in input_shape)
        self.entries = []  # (layer, name, offset, shape, initialiser), depth-first over the layer tree
        self.shapes = []  # input shape of each top-level layer
        # where each top-level layer's parameters (its sublayers' included) start in the buffer
        self.offsets = []
        shape, offset = self.input_shape, 0
        for index, layer in enumerate(self.layers):
            self.shapes.append(tuple(shape))
            self.offsets.append(offset)
            try:
                shape = _sizes(layer.build(shape), "its build returned")
                # a block's sublayers are built by its own build; their specs follow the block's own
                for _, node in walk([layer]):
                    for name, pshape, initialiser in node.param_specs():
                        pshape = _sizes(pshape, f"parameter {name!r} has shape", least=0)
                        self.entries.append((node, name, offset, pshape, initialiser))
                        offset += int(np.prod(pshape))
            except ShapeError as err:
                raise ShapeError(f"layer {index} ({layer!r}): {err}") from None
        self.output_shape = tuple(shape)
        self.num_params = offset
        # the first top-level layer with parameters (its sublayers' included): where backward without an
        # input gradient stops
        ends = self.offsets[1:] + [offset]
        self.first_trained = next((i for i, (lo, hi) in enumerate(zip(self.offsets, ends)) if hi > lo), 0)

    def initial_values(self, seed, positions, out=None, chunk=1 << 18, whole=None):
        """The initial values of the elements at ``positions`` (an int64 array, or a ``range``) of the flat
        buffer, as a host array of ``dtype`` (``out``, where given).

        Element ``i`` of entry ``e`` is ``initialiser.values(parameter_key(seed, e), i)``
        (:mod:`mpidist.nn.init`): a function of the seed, the parameter and the element alone, so a rank
        holding a slice of this model (a stage's elements, a tensor part's regions) draws exactly that slice
        and gets what a whole draw would give.  Computed ``chunk`` elements at a time; an initialiser of one's
        own ``(rng, shape)`` is drawn whole for a parameter, once for calls that pass the same ``whole`` (a
        dict)."""
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
        """The key of entry ``entry``'s draws (its index in :attr:`entries` of the whole model) under
        ``seed``."""
        return np.random.SeedSequence([seed, entry]).generate_state(1, dtype=np.uint64)[0]

    def parameter_names(self):
        """Each entry's name, in entry order, as checkpoints store it under ``parameters/``: its top-level
        layer's number as the role table numbers layers, zero-padded so names sort by layer in model order,
        that layer's class, the path down to a sublayer (index and class at each level), and the parameter's
        name: ``0003.Dense.W``, ``0002.TransformerBlock.00.Residual.01.MultiHeadAttention.Wq``."""
        named = {}
        for top, layer in enumerate(self.layers):
            for path, node in walk([layer]):
                below = "".join(f".{index:02d}.{type(sub).__name__}" for index, sub in _down(layer, path[1:]))
                named[id(node)] = f"{top:04d}.{type(layer).__name__}{below}"
        return [f"{named[id(node)]}.{name}" for node, name, *_ in self.entries]

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
