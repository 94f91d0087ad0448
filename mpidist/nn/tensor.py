"""Tensor parallelism's arithmetic: a model's layers split across the ``T`` ranks of a tensor group (no MPI).

Megatron-LM's scheme (Shoeybi et al., 2019).  A pair of ``Dense`` layers with
only elementwise layers between them (an MLP's hidden layer) is split so
that no activation is gathered in between: the first by output columns
(each part computes its slice of the hidden features), the second by input
rows (each part's product is a partial sum of the output).  Two operators
bracket the pair: :class:`TensorCopy` before it (identity forward; its
backward sums the input gradient over the group) and :class:`TensorSum`
after it (sums the partial outputs forward; identity backward), then the
second layer's bias, once (:class:`Bias`).  One sum of activations forward,
one backward.  Attention splits by heads the same way (see
:func:`split_layers`); an ``Embedding`` by vocabulary rows, each part looking
up the ids it holds, then a sum.  Every other layer is replicated: it sees
the same input on every part and computes the same output (a ``Dropout``
between the two layers of a pair, on each part's slice of the features,
draws a mask of its own there).

The sums are a function the strategy gives each operator (``reduce``: an
in-place sum over the group); this module never communicates.  Each part's
parameters are slices of the whole model's: :func:`split_model` returns,
with the part's model, its :class:`~mpidist.nn.placement.Placement` (each
of its parameters a rectangular slice of one of the whole model's), so
initialisation and checkpoints stay those of the whole model (any layout).

A layer of one's own splits where it defines ``tensor_split(part, parts)``,
returning the layers that replace it; each new layer with parameters names
where they come from in ``tensor_origin``: ``{name: (whole_name, index)}``,
``index`` a slice per axis (or one slice, for the first) of the whole
layer's parameter ``whole_name``: a rectangular part of it.
Where the layer stands alone, its parts take the whole input and must give
the whole output (with sums of their own: attention does); a layer that sets
``elementwise = True`` may stand between the two layers of a split pair,
where it sees the part's slice of the features (``part_range`` of them) and
splits as they do (one with parameters must define ``tensor_split`` then).
Without it, a layer is replicated.
"""

import copy

import numpy as np

from . import init
from .activations import GELU, Sigmoid
from .attention import MultiHeadAttention
from .embedding import Embedding, _scatter_add, token_ids
from .layers import Dense, Dropout, Layer, ReLU, Tanh
from .placement import Placement, Region, rectangle
from .sequential import Sequential, walk

#: The attributes by which a layer names a mask source (see MultiHeadAttention's ``padding``).
MASK_SOURCES = ("padding", "source")

#: Layers that act on each feature alone: a split pair may have them between its two Dense layers.
ELEMENTWISE = (ReLU, Tanh, GELU, Sigmoid, Dropout)


def part_range(size, part, parts):
    """``(lo, hi)``: part ``part`` of ``parts`` of ``range(size)``, balanced (the first ``size % parts`` one
    more)."""
    base, extra = divmod(int(size), int(parts))
    lo = part * base + min(part, extra)
    return lo, lo + base + (1 if part < extra else 0)


class TensorCopy(Layer):
    """Megatron's ``f``: the identity forward; backward sums the input gradient over the tensor group."""

    def __init__(self):
        super().__init__()
        self.reduce = None  # an in-place sum over the group, set by the strategy (None: one part)

    def forward(self, x, training=False):
        return x

    def backward(self, dy):
        if self.reduce is not None:
            self.reduce(dy)
        return dy

    def __repr__(self):
        return "TensorCopy()"


class TensorSum(Layer):
    """Megatron's ``g``: sums the parts' partial outputs over the tensor group forward; the identity
    backward."""

    def __init__(self):
        super().__init__()
        self.reduce = None

    def forward(self, x, training=False):
        if self.reduce is not None:
            x = self.xp.ascontiguousarray(x)
            self.reduce(x)
        return x

    def backward(self, dy):
        return dy

    def __repr__(self):
        return "TensorSum()"


class Bias(Layer):
    """``y = x + b`` over the last axis: a split layer's bias, added once after the parts' sum."""

    def build(self, input_shape):
        self.size = int(input_shape[-1])
        return tuple(input_shape)

    def param_specs(self):
        return [("b", (self.size,), init.zeros)]

    def forward(self, x, training=False):
        return self.xp.add(x, self.params["b"], out=self.scratch("y", x.shape, x.dtype))

    def backward(self, dy):
        self.backward_params(dy)
        return dy

    def backward_params(self, dy):
        dy.reshape(-1, self.size).sum(axis=0, out=self.grads["b"])

    def __repr__(self):
        return f"Bias({self.size})"


class VocabularyPart(Embedding):
    """An ``Embedding``'s rows ``[lo, hi)``: ids outside them look up zeros (a :class:`TensorSum` adds the
    parts)."""

    cache = ("ids", "held")

    def __init__(self, lo, hi, dim, pad_id=None, whole=None):
        super().__init__(hi - lo, dim)
        self.lo, self.hi = int(lo), int(hi)
        self.whole = int(hi if whole is None else whole)  # the whole vocabulary, which ids must be in
        self.pad_id = pad_id  # (the whole vocabulary's: this part is a mask source as the whole layer was)

    def forward(self, x, training=False):
        ids = token_ids(x, self.whole)
        if self.pad_id is not None:
            self.padding = ids == self.pad_id
        self.held = (ids >= self.lo) & (ids < self.hi)
        self.ids = self.xp.where(self.held, ids - self.lo, 0)
        return self.params["W"][self.ids] * self.held[..., None]

    def backward_params(self, dy):
        grad = self.grads["W"]
        grad[...] = 0
        held = self.held.reshape(-1)
        _scatter_add(self.xp, grad, self.ids.reshape(-1)[held], dy.reshape(-1, self.dim)[held])

    def __repr__(self):
        return f"VocabularyPart({self.lo}:{self.hi}, {self.dim})"


def _origin(layer, whole, **names):
    """``layer``, a slice of ``whole``: ``tensor_whole`` set, and ``tensor_origin`` from ``name=(whole_name,
    index)`` pairs."""
    layer.tensor_whole, layer.tensor_origin = whole, names
    return layer


def _user_split(layer, part, parts):
    """The layers a user's ``tensor_split`` gives for ``layer``, each slice of it knowing its whole."""
    made = list(layer.tensor_split(part, parts))
    for piece in made:
        if getattr(piece, "tensor_origin", None):
            piece.tensor_whole = layer
    return made


def _reading(layer, replaced):
    """``layer``, or where it reads a mask source that was split, a copy reading the part (the same mask): the
    whole model's layer, the user's object, keeps reading the whole source."""
    sources = {
        name: replaced[id(getattr(layer, name))]
        for name in MASK_SOURCES
        if getattr(layer, name, None) is not None and id(getattr(layer, name)) in replaced
    }
    if sources:
        layer = copy.copy(layer)
        for name, source in sources.items():
            setattr(layer, name, source)
    return layer


def _columns(dense, part, parts):
    """The first of a split pair: output columns ``[lo, hi)`` of ``dense``."""
    lo, hi = part_range(dense.units, part, parts)
    shard = Dense(hi - lo, init=dense.init, bias=dense.bias)
    names = {"W": ("W", (slice(None), slice(lo, hi)))}
    if dense.bias:
        names["b"] = ("b", slice(lo, hi))
    return _origin(shard, dense, **names)


def _rows(dense, features, part, parts):
    """The second of a split pair: input rows ``[lo, hi)`` of ``dense`` (the first's columns), its bias after
    the sum."""
    lo, hi = part_range(features, part, parts)
    rows = Dense(dense.units, init=dense.init, bias=False)
    layers = [_origin(rows, dense, W=("W", (slice(lo, hi), slice(None)))), TensorSum()]
    if dense.bias:
        layers.append(_origin(Bias(), dense, b=("b", slice(None))))
    return layers


def _heads(attention, part, parts, replaced):
    """``attention`` split by heads: the part's heads' columns of ``Wq``, ``Wk``, ``Wv`` and rows of ``Wo``,
    between a :class:`TensorCopy` and a :class:`TensorSum`, then ``bo`` once."""
    lo, hi = part_range(attention.heads, part, parts)
    if hi == lo:
        raise ValueError(
            f"{attention!r} has {attention.heads} heads: --tensor {parts} leaves part {part} none"
        )
    columns = slice(lo * attention.dh, hi * attention.dh)
    padding = replaced.get(id(attention.padding), attention.padding)
    shard = MultiHeadAttention(
        hi - lo, head_dim=attention.dh, causal=attention.causal, output_bias=False, padding=padding
    )
    names = {f"W{n}": (f"W{n}", (slice(None), columns)) for n in attention.names}
    names.update({f"b{n}": (f"b{n}", columns) for n in attention.names})
    names["Wo"] = ("Wo", (columns, slice(None)))
    layers = [TensorCopy(), _origin(shard, attention, **names), TensorSum()]
    if attention.output_bias:
        layers.append(_origin(Bias(), attention, b=("bo", slice(None))))
    return layers


def _pair_end(layers, start):
    """Index of the Dense that pairs with the Dense at ``start``, or None: only elementwise layers between."""
    for index in range(start + 1, len(layers)):
        layer = layers[index]
        if type(layer) is Dense:
            return index
        if not (isinstance(layer, ELEMENTWISE) or getattr(layer, "elementwise", False)):
            return None
    return None


def _between(layer, part, parts):
    """A layer between a split pair: the same object, or its ``tensor_split`` where it has parameters."""
    if hasattr(layer, "tensor_split"):
        return _user_split(layer, part, parts)
    if layer.param_specs():
        raise ValueError(
            f"{layer!r} has parameters and stands between a split pair of Dense layers, where each "
            "part sees its slice of the features: give it tensor_split(part, parts)"
        )
    if hasattr(layer, "rng"):  # (a Dropout: each part's slice of the features draws a mask of its own)
        piece = copy.copy(layer)
        piece.stream = (parts, part)
        return [piece]
    return [layer]


def split_layers(layers, part, parts, replaced=None):
    """Part ``part`` of ``parts`` of ``layers`` (built, as in a whole :class:`Sequential`): new layers, in
    order.

    Split: Dense pairs (columns, then rows), ``MultiHeadAttention`` (by
    heads), ``Embedding`` (by vocabulary) -- those classes exactly: a
    subclass may compute otherwise --, layers with ``tensor_split``;
    blocks with a ``layers`` list (``Residual``, ``TransformerBlock``) are
    split inside, on a copy.  Each new layer with parameters carries
    ``tensor_whole`` (the layer it is a part of) and ``tensor_origin``; a
    replicated layer is the same object.  ``replaced``: whole layers' ids to
    the parts that replace them (an attention's mask source), filled here.
    """
    replaced = {} if replaced is None else replaced
    out, index = [], 0
    while index < len(layers):
        layer = layers[index]
        end = _pair_end(layers, index) if type(layer) is Dense else None
        if end is not None:
            first = _columns(layer, part, parts)
            between = [piece for middle in layers[index + 1 : end] for piece in _between(middle, part, parts)]
            out += [TensorCopy(), first, *between, *_rows(layers[end], layer.units, part, parts)]
            index = end + 1
            continue
        if hasattr(layer, "tensor_split"):
            out += _user_split(layer, part, parts)
        elif type(layer) is MultiHeadAttention:
            out += _heads(layer, part, parts, replaced)
        elif type(layer) is Embedding:
            lo, hi = part_range(layer.vocab, part, parts)
            if hi == lo:
                raise ValueError(f"{layer!r} has {layer.vocab} ids: --tensor {parts} leaves part {part} none")
            piece = _origin(
                VocabularyPart(lo, hi, layer.dim, layer.pad_id, layer.vocab),
                layer,
                W=("W", (slice(lo, hi), slice(None))),
            )
            replaced[id(layer)] = piece
            out += [piece, TensorSum()]
        elif isinstance(getattr(layer, "layers", None), list) and layer.sublayers() is layer.layers:
            block = copy.copy(layer)  # (the whole model's block keeps its own sublayers)
            block.params, block.grads = {}, {}
            block.layers = split_layers(layer.layers, part, parts, replaced)
            out.append(block)
        else:  # (replicated; a mask source runs before its readers, so a split one is in ``replaced`` by now)
            out.append(_reading(layer, replaced))
        index += 1
    return out


def parameter_shapes(layer):
    """``{name: shape}`` of ``layer``'s parameters, from its specs (a whole layer beside its parts holds no
    buffer)."""
    return {name: tuple(shape) for name, shape, _ in layer.param_specs()}


def _decay_as_whole(model):
    """Each split piece decays (``--weight-decay``) as the parameter of the whole layer it is a slice of (the
    whole layer's rule and the user's ``weight_decay`` choices both)."""
    for _, layer in walk(model.layers):
        origin, whole = getattr(layer, "tensor_origin", None), getattr(layer, "tensor_whole", None)
        if origin and whole is not None:
            shapes = parameter_shapes(whole)
            layer.weight_decay = {
                name: whole.decays(whole_name, shapes[whole_name]) for name, (whole_name, _) in origin.items()
            }


def split_model(whole, part, parts, writes=True, buffers=True):
    """``(model, placement)``: part ``part`` of ``parts`` of ``whole`` (a :class:`Sequential`) as a model of
    its own, and its :class:`~mpidist.nn.placement.Placement` over ``whole``: each of its parameters a
    rectangular slice of one of the whole model's (no array of the whole's size is made).

    Parameters the parts share (replicated layers') are their whole parameters; of those, part 0 alone
    writes them (``writes``: this part's group writes at all; :func:`replicated` names them).  ``buffers``
    False: the part's model makes no flat buffers (a strategy binds its layers elsewhere).
    """
    replaced = {}
    layers = split_layers(whole.layers, part, parts, replaced)
    model = Sequential(layers, whole.input_shape, xp=whole.xp, dtype=whole.dtype, buffers=buffers)
    if model.output_shape != whole.output_shape:
        raise ValueError(
            f"a part of the model ends in {model.output_shape}, the whole in {whole.output_shape}"
        )
    whole_at = {
        (id(layer), name): (entry, shape) for entry, (layer, name, _, shape, _) in enumerate(whole.entries)
    }
    regions = []
    for layer, name, lo, shape, _ in model.entries:
        origin = getattr(layer, "tensor_origin", None)
        if origin:
            whole_name, index = origin[name]
            entry, whole_shape = whole_at[(id(layer.tensor_whole), whole_name)]
        elif (id(layer), name) in whole_at:
            (entry, whole_shape), index = whole_at[(id(layer), name)], ()
        else:
            raise ValueError(
                f"{layer!r} (from tensor_split) has parameter {name} but no tensor_origin saying "
                "which of the whole layer's parameters it is a slice of"
            )
        try:
            start, stop = rectangle(index, whole_shape)
        except ValueError as err:
            raise ValueError(f"{layer!r}: parameter {name}'s tensor_origin: {err}") from None
        region = Region(
            entry, start, stop, lo, writes and (part == 0 or tuple(stop) != tuple(whole_shape) or any(start))
        )
        if region.size != int(np.prod(shape)):
            raise ValueError(
                f"{layer!r}: parameter {name} holds {int(np.prod(shape))} values, its origin {region.size}"
            )
        regions.append(region)
    _decay_as_whole(model)
    return model, Placement(whole, regions)


def replicated(model):
    """``(lo, hi)`` ranges of ``model``'s flat buffer (a part's) that every part holds alike: parameters that
    are not slices, and slices that take their whole parameter (a bias added after a sum; a user's piece that
    keeps its whole parameter)."""
    ranges = []
    for layer, name, lo, shape, _ in model.entries:
        size = int(np.prod(shape))
        origin, whole = getattr(layer, "tensor_origin", None), getattr(layer, "tensor_whole", None)
        if not origin or whole is None or int(np.prod(parameter_shapes(whole)[origin[name][0]])) == size:
            ranges.append((lo, lo + size))
    return ranges


def operators(model):
    """The layers of ``model`` (a part's, or its list of layers) that sum over the tensor group: they take the
    strategy's ``reduce``."""
    return [
        layer
        for _, layer in walk(getattr(model, "layers", model))
        if isinstance(layer, (TensorCopy, TensorSum))
    ]
