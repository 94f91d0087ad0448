"""Layers of sequences ``(N, L, D)``: learned positions, a class token, pooling over the length, tokens of
neighbourhoods."""

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
            raise ShapeError(
                f"PositionalEmbedding has positions for sequences of up to {self.max_length}, "
                f"got length {length} (give a larger max_length)"
            )

    def build(self, input_shape):
        length, self.dim = _sequence_shape("PositionalEmbedding", input_shape)
        self._check(length)
        return tuple(input_shape)

    def param_specs(self):
        return [("table", (self.max_length, self.dim), init.normal(TABLE_STD))]

    def forward(self, x, training=False):
        self._check(x.shape[1])
        return self.xp.add(x, self.params["table"][: x.shape[1]], out=self.scratch("y", x.shape, x.dtype))

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
        return [("token", (self.dim,), init.normal(TABLE_STD))]

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
        if self.padding is None:  # (backward divides by ``length``)
            self.keep, self.count = None, None
            return x.mean(axis=1, out=self.scratch("y", (n, d), x.dtype))
        keep = ~padding_of(self.padding, (n, length))
        self.keep = keep.astype(x.dtype)[:, :, None]
        self.count = xp.maximum(self.keep.sum(axis=1), 1)  # (N, 1): a sequence of padding only pools to 0
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


class TokenConv(Layer):
    """Tokens from neighbourhoods: a convolution along the positions, ``(N, L, F) -> (N, L, D)``.

    ``y[:, i] = b + sum_j x[:, i + j - left] @ W[j]`` for ``j < kernel``, with
    zeros beyond the ends (``left = (kernel - 1) // 2``: the length is kept).
    In place of a ``Dense`` per position it gives attention local features to
    start from (a convolutional stem, as in hybrid vision transformers):
    a position of a 1-D signal alone is one number, its slope and curvature
    are in its neighbours.  ``kernel=1`` is a ``Dense``.
    """

    cache = ("windows",)
    hands_over = True

    def __init__(self, dim, kernel=5):
        super().__init__()
        self.dim, self.kernel = int(dim), int(kernel)
        if self.dim < 1 or self.kernel < 1:
            raise ValueError(f"TokenConv needs dim and kernel >= 1, got {dim} and {kernel}")
        self.left = (self.kernel - 1) // 2

    def build(self, input_shape):
        length, self.features = _sequence_shape("TokenConv", input_shape)
        if self.kernel > length:  # (its windows would be mostly the zeros beyond the ends)
            raise ShapeError(f"TokenConv kernel {self.kernel} is longer than the sequences ({length} steps)")
        return (length, self.dim)

    def param_specs(self):
        fan_in = self.kernel * self.features
        return [
            ("W", (self.kernel, self.features, self.dim), init.glorot_uniform(fan_in, self.dim)),
            ("b", (self.dim,), init.zeros),
        ]

    def forward(self, x, training=False):
        n, length, f = x.shape
        # x between zeros (never written: they stay zero), then (N, L, kernel, F): position i's window
        padded = self.scratch("padded", (n, length + self.kernel - 1, f), x.dtype, fill=0)
        padded[:, self.left : self.left + length] = x
        windows = self.windows = self.scratch("windows", (n, length, self.kernel, f), x.dtype)
        for j in range(self.kernel):
            windows[:, :, j] = padded[:, j : j + length]
        y = self.xp.matmul(
            windows.reshape(n, length, -1),
            self.params["W"].reshape(-1, self.dim),
            out=self.scratch("y", (n, length, self.dim), x.dtype),
        )
        y += self.params["b"]
        return y

    def backward_params(self, dy):
        rows = self.windows.reshape(-1, self.kernel * self.features)
        self.xp.matmul(rows.T, dy.reshape(-1, self.dim), out=self.grads["W"].reshape(-1, self.dim))
        dy.sum(axis=(0, 1), out=self.grads["b"])

    def backward(self, dy):
        self.backward_params(dy)
        n, length, _ = dy.shape
        w = self.params["W"].reshape(-1, self.dim)
        dwindows = self.xp.matmul(dy, w.T, out=self.scratch("dwindows", (n, length, w.shape[0]), dy.dtype))
        dwindows = dwindows.reshape(n, length, self.kernel, self.features)
        dcols = self.scratch("dcols", (n, length + self.kernel - 1, self.features), dy.dtype)
        dcols[...] = 0
        for j in range(self.kernel):
            dcols[:, j : j + length] += dwindows[:, :, j]
        return dcols[:, self.left : self.left + length]

    def __repr__(self):
        return f"TokenConv({self.dim}, kernel={self.kernel})"
