"""Layers of sequences ``(N, L, D)``: learned positions, a class token, pooling over the length."""

import functools

from . import init
from .attention import padding_of
from .layers import Layer, ShapeError

#: Standard deviation of the learned tables' initial values (positions, class token): BERT's and ViT's.
TABLE_STD = 0.02


def _sequence_shape(name, input_shape):
    if len(input_shape) != 2:
        raise ShapeError(f"{name} needs sequences (L, D), got per-sample shape {tuple(input_shape)}")
    return int(input_shape[0]), int(input_shape[1])


class PositionalEmbedding(Layer):
    """Adds a learned position table: ``(N, L, D) -> (N, L, D)``, ``y[:, i] = x[:, i] + table[i]``.

    ``table`` is ``(max_length, D)``, starting N(0, 0.02); sequences longer
    than ``max_length`` are refused (:class:`ShapeError`), shorter ones use its
    first rows.
    """

    cache = ()

    def __init__(self, max_length):
        super().__init__()
        self.max_length = int(max_length)
        if self.max_length < 1:
            raise ValueError(f"PositionalEmbedding needs max_length >= 1, got {max_length}")

    def _check(self, length):
        if length > self.max_length:
            raise ShapeError(f"PositionalEmbedding has positions for sequences of up to {self.max_length}, "
                             f"got length {length} (give a larger max_length)")

    def build(self, input_shape):
        length, self.dim = _sequence_shape("PositionalEmbedding", input_shape)
        self._check(length)
        return tuple(input_shape)

    def param_specs(self):
        return [("table", (self.max_length, self.dim), functools.partial(init.normal, std=TABLE_STD))]

    def forward(self, x, training=False):
        self._check(x.shape[1])
        return self.xp.add(x, self.params["table"][:x.shape[1]], out=self.scratch("y", x.shape, x.dtype))

    def backward_params(self, dy):
        length, table = dy.shape[1], self.grads["table"]
        dy.sum(axis=0, out=table[:length])
        table[length:] = 0

    def backward(self, dy):
        self.backward_params(dy)
        return dy

    def __repr__(self):
        return f"PositionalEmbedding({self.max_length})"


class ClassToken(Layer):
    """Prepends a learned token to every sequence: ``(N, L, D) -> (N, L + 1, D)``.

    The token ``(D,)`` starts N(0, 0.02).  A classifier reads the first
    position back at the end (``SequencePool("first")``), after the blocks let
    it attend to the whole sequence.  ``padding``: a mask source (see
    :class:`MultiHeadAttention`) for the ``L`` positions; this layer is then
    one for ``L + 1`` (the token is never padding), for the layers after it.
    """

    cache = ()

    def __init__(self, padding=None):
        super().__init__()
        self.source = padding
        self.padding = None

    def build(self, input_shape):
        length, self.dim = _sequence_shape("ClassToken", input_shape)
        return (length + 1, self.dim)

    def param_specs(self):
        return [("token", (self.dim,), functools.partial(init.normal, std=TABLE_STD))]

    def forward(self, x, training=False):
        xp, (n, length, d) = self.xp, x.shape
        y = self.scratch("y", (n, length + 1, d), x.dtype)
        y[:, 0] = self.params["token"]
        y[:, 1:] = x
        if self.source is not None:
            mask = padding_of(self.source, (n, length))
            self.padding = xp.zeros((n, length + 1), dtype=bool)
            self.padding[:, 1:] = mask
        return y

    def backward_params(self, dy):
        dy[:, 0].sum(axis=0, out=self.grads["token"])

    def backward(self, dy):
        self.backward_params(dy)
        return dy[:, 1:]

    def __repr__(self):
        return "ClassToken()" if self.source is None else "ClassToken(padding=...)"


class SequencePool(Layer):
    """One vector per sequence: ``(N, L, D) -> (N, D)``.

    ``"mean"``: the mean over the positions (over those that are not padding,
    where ``padding`` names a mask source, see :class:`MultiHeadAttention`);
    ``"first"``: the first position (the token :class:`ClassToken` put there).
    """

    cache = ("keep", "count", "length")
    modes = ("mean", "first")

    def __init__(self, mode="mean", padding=None):
        super().__init__()
        if mode not in self.modes:
            raise ValueError(f"SequencePool mode {mode!r}: choose from {', '.join(self.modes)}")
        self.mode, self.padding = mode, padding

    def build(self, input_shape):
        self.length, self.dim = _sequence_shape("SequencePool", input_shape)
        return (self.dim,)

    def forward(self, x, training=False):
        xp, (n, length, d) = self.xp, x.shape
        self.length = length
        if self.mode == "first":
            y = self.scratch("y", (n, d), x.dtype)
            y[...] = x[:, 0]
            return y
        if self.padding is None:
            self.keep, self.count = None, length
            return x.mean(axis=1)
        keep = ~padding_of(self.padding, (n, length))
        self.keep = keep.astype(x.dtype)[:, :, None]
        self.count = xp.maximum(self.keep.sum(axis=1), 1)    # (N, 1): a sequence of padding only pools to 0
        return (x * self.keep).sum(axis=1) / self.count

    def backward(self, dy):
        n, d = dy.shape
        dx = self.scratch("dx", (n, self.length, d), dy.dtype)
        if self.mode == "first":
            dx[...] = 0
            dx[:, 0] = dy
        elif self.keep is None:
            dx[...] = (dy / self.length)[:, None, :]
        else:
            self.xp.multiply((dy / self.count)[:, None, :], self.keep, out=dx)
        return dx

    def __repr__(self):
        return f"SequencePool({self.mode!r}" + (", padding=...)" if self.padding is not None else ")")
