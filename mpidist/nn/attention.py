"""Multi-head scaled dot-product self-attention on sequences ``(N, L, D)``.

The parameter names, shapes and the head layout (:class:`HeadLayout`) are a
contract that tensor parallelism relies on: it splits the layer by heads by
slicing exactly these.
"""

import dataclasses
import math

from . import init
from .layers import Layer, ShapeError


def padding_of(source, shape):
    """The key padding mask ``source`` (a mask source, see :class:`MultiHeadAttention`) holds now, checked.

    ``shape``: ``(N, L)`` of the sequences it must cover.  Returns a bool
    array, True at padding; raises :class:`ShapeError` where the source has
    none for these sequences.
    """
    mask = getattr(source, "padding", None)
    if mask is None:
        raise ShapeError(
            f"the padding mask comes from {source!r}, which has not computed one for this batch "
            "(it must run before this layer in the same model, and be built with a pad id)"
        )
    if tuple(mask.shape) != tuple(shape):
        raise ShapeError(
            f"the padding mask from {source!r} covers sequences {tuple(mask.shape)}, but this layer "
            f"sees {tuple(shape)} (a layer between them changed the length: give it the mask too)"
        )
    return mask


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How attention cuts the columns of ``q``, ``k`` and ``v`` into heads: head ``h`` is ``[h*dh,
    (h+1)*dh)``.

    The contract tensor parallelism slices by: a part takes whole heads, their
    columns of ``Wq``, ``Wk``, ``Wv`` (and biases) and their rows of ``Wo``.
    An object of its own so that the widths a built layer works with are one
    value, made (and checked) once from what the layer was given.

    Attributes:
        heads: number of heads ``H``.
        dh: columns per head.
        dim: the model width ``D``, of the layer's input and output.
    """

    heads: int
    dh: int
    dim: int

    @classmethod
    def of(cls, heads, head_dim, dim):
        """``heads`` heads of ``head_dim`` columns each on width ``dim``; with ``head_dim`` None, ``dim //
        heads`` (raises :class:`ShapeError` where ``heads`` does not divide ``dim``)."""
        if head_dim is not None:
            return cls(heads, head_dim, dim)
        if dim % heads:
            raise ShapeError(
                f"MultiHeadAttention: {heads} heads do not divide the model width {dim} "
                "(give head_dim, or a width that is a multiple of the heads)"
            )
        return cls(heads, dim // heads, dim)

    @property
    def width(self):
        """``H*dh``: the columns of ``q``, ``k`` and ``v``, and the rows of ``Wo``."""
        return self.heads * self.dh

    def split(self, a):
        """``(N, L, H*dh)`` seen as ``(N, H, L, dh)`` (a view: head ``h`` is columns ``[h*dh, (h+1)*dh)``)."""
        n, length, _ = a.shape
        return a.reshape(n, length, self.heads, self.dh).transpose(0, 2, 1, 3)


class MultiHeadAttention(Layer):
    """Multi-head self-attention: ``(N, L, D) -> (N, L, D)``.

    ``q = x Wq + bq``, ``k = x Wk + bk``, ``v = x Wv + bv`` (each ``(N, L, H*dh)``);
    head ``h`` takes columns ``[h*dh, (h+1)*dh)`` of them, attends with
    ``softmax(q_h k_h^T / sqrt(dh) + mask) v_h``, and the heads' outputs,
    concatenated in the same order, are projected back: ``y = o Wo + bo``.

    Parameters (a contract: tensor parallelism slices them by heads):
    ``Wq``, ``Wk``, ``Wv`` ``(D, H*dh)``; ``bq``, ``bk``, ``bv`` ``(H*dh,)``;
    ``Wo`` ``(H*dh, D)``, head ``h`` its rows ``[h*dh, (h+1)*dh)``; ``bo`` ``(D,)``
    unless ``output_bias=False`` (a row-parallel shard adds it after the sum).
    Matrices start Glorot-uniform, biases zero.

    Args:
        heads: number of heads ``H``.
        head_dim: ``dh``; default ``D // heads`` (then ``heads`` must divide ``D``).
        causal: position ``i`` attends to positions ``<= i`` only (a language model).
        output_bias: whether ``bo`` exists.
        padding: a *mask source*: a layer earlier in the model whose ``padding``
            attribute, after its forward, is a bool ``(N, L)`` array, True at
            padding (an :class:`~mpidist.nn.Embedding` built with ``pad_id``, or a
            :class:`~mpidist.nn.ClassToken` given one).  Keys at padding get no
            attention; a query whose keys are all padding gets zeros (then ``bo``).
            The source must run on the same process (the same pipeline stage).

    Memory: forward keeps ``x`` (the caller's array), ``q``, ``k``, ``v`` and the
    heads' concatenated output ``o`` (``(N, L, H*dh)`` each) and one
    ``(N, H, L, L)`` array, the attention probabilities: the scores are
    computed, masked and turned into probabilities in place.  Backward needs
    one more ``(N, H, L, L)`` array, the gradient of the scores, computed in
    place too (the softmax's row sums come from ``dO . O``, an ``(N, H, L)``
    array, not from another ``(N, H, L, L)`` product).  The softmax subtracts
    each row's maximum before ``exp``, so no logit overflows.
    """

    cache = ("x", "q", "k", "v", "p", "o", "mask")
    names = ("q", "k", "v")

    def __init__(self, heads, head_dim=None, causal=False, output_bias=True, padding=None):
        super().__init__()
        self.heads = int(heads)
        if self.heads < 1:
            raise ValueError(f"MultiHeadAttention needs at least 1 head, got {heads}")
        if head_dim is not None and int(head_dim) < 1:
            raise ValueError(f"MultiHeadAttention head_dim must be positive, got {head_dim}")
        self.head_dim = None if head_dim is None else int(head_dim)
        self.causal, self.output_bias, self.padding = bool(causal), bool(output_bias), padding
        self._causal_bias = None

    def build(self, input_shape):
        if len(input_shape) != 2:
            raise ShapeError(
                f"MultiHeadAttention needs sequences (L, D), got per-sample shape {tuple(input_shape)}"
            )
        self.layout = HeadLayout.of(self.heads, self.head_dim, int(input_shape[1]))
        return tuple(input_shape)

    @property
    def dh(self):
        """Columns per head (the built :class:`HeadLayout`'s): what tensor parallelism cuts by."""
        return self.layout.dh

    def param_specs(self):
        d, w = self.layout.dim, self.layout.width
        glorot = init.glorot_uniform(d, w)
        specs = [(f"W{n}", (d, w), glorot) for n in self.names] + [
            (f"b{n}", (w,), init.zeros) for n in self.names
        ]
        specs.append(("Wo", (w, d), init.glorot_uniform(w, d)))
        return specs + ([("bo", (d,), init.zeros)] if self.output_bias else [])

    def _bias(self, length, dtype):
        """``(L, L)``: 0 where a query may look, -inf above the diagonal; made once per length."""
        bias = self._causal_bias
        if bias is None or bias.shape[0] != length or bias.dtype != dtype:
            xp = self.xp
            bias = xp.triu(xp.full((length, length), -xp.inf, dtype=dtype), k=1)
            self._causal_bias = bias
        return bias

    def forward(self, x, training=False):
        xp, p, layout = self.xp, self.params, self.layout
        if x.ndim != 3 or x.shape[2] != layout.dim:
            raise ShapeError(f"MultiHeadAttention built for width {layout.dim} got input {tuple(x.shape)}")
        n, length, _ = x.shape
        dtype = xp.result_type(x, p["Wq"])
        self.x = x
        for name in self.names:
            out = xp.matmul(x, p[f"W{name}"], out=self.scratch(name, (n, length, layout.width), dtype))
            out += p[f"b{name}"]
            setattr(self, name, out)
        self.mask = None if self.padding is None else padding_of(self.padding, (n, length))
        # the scores, masked and made probabilities in one (N, H, L, L) array
        scores = self.scratch("p", (n, self.heads, length, length), dtype)
        xp.matmul(layout.split(self.q), layout.split(self.k).transpose(0, 1, 3, 2), out=scores)
        scores *= dtype.type(1 / math.sqrt(layout.dh))
        if self.causal:
            scores += self._bias(length, dtype)
        if self.mask is not None:
            xp.copyto(scores, -xp.inf, where=self.mask[:, None, None, :])
        top = scores.max(axis=-1, keepdims=True)
        if self.mask is not None:  # a row of padding only: its maximum is -inf, and exp(-inf - 0) = 0
            # (copyto's where, not a boolean index: on a GPU an index waits for the host to count it)
            xp.copyto(top, 0, where=~xp.isfinite(top))
        scores -= top
        xp.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True, out=top)
        if self.mask is not None:
            xp.copyto(total, 1, where=total == 0)
        scores /= total
        self.p = scores
        self.o = self.scratch("o", (n, length, layout.width), dtype)
        xp.matmul(scores, layout.split(self.v), out=layout.split(self.o))
        y = xp.matmul(self.o, p["Wo"], out=self.scratch("y", x.shape, dtype))
        if self.output_bias:
            y += p["bo"]
        return y

    def backward(self, dy):
        return self._backward(dy, True)

    def backward_params(self, dy):
        self._backward(dy, False)

    def _backward(self, dy, input_grad):
        xp, p, g, layout = self.xp, self.params, self.grads, self.layout
        n, length, d = dy.shape
        rows = n * length
        xp.matmul(self.o.reshape(rows, layout.width).T, dy.reshape(rows, d), out=g["Wo"])
        if self.output_bias:
            dy.reshape(rows, d).sum(axis=0, out=g["bo"])
        do = xp.matmul(dy, p["Wo"].T, out=self.scratch("do", self.o.shape, dy.dtype))
        heads_do, probs = layout.split(do), self.p
        dv = self.scratch("dv", self.o.shape, dy.dtype)
        xp.matmul(probs.transpose(0, 1, 3, 2), heads_do, out=layout.split(dv))
        # d scores = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = dO . O per query
        dscores = xp.matmul(
            heads_do,
            layout.split(self.v).transpose(0, 1, 3, 2),
            out=self.scratch("dp", probs.shape, dy.dtype),
        )
        products = xp.multiply(
            heads_do, layout.split(self.o), out=self.scratch("products", heads_do.shape, dy.dtype)
        )
        dscores -= products.sum(
            axis=-1, keepdims=True, out=self.scratch("rowsum", probs.shape[:3] + (1,), dy.dtype)
        )
        dscores *= probs
        dscores *= dy.dtype.type(1 / math.sqrt(layout.dh))
        dq, dk = self.scratch("dq", self.o.shape, dy.dtype), self.scratch("dk", self.o.shape, dy.dtype)
        xp.matmul(dscores, layout.split(self.k), out=layout.split(dq))
        xp.matmul(dscores.transpose(0, 1, 3, 2), layout.split(self.q), out=layout.split(dk))
        x = self.x.reshape(rows, d)
        for name, grad in zip(self.names, (dq, dk, dv)):
            flat = grad.reshape(rows, layout.width)
            xp.matmul(x.T, flat, out=g[f"W{name}"])
            flat.sum(axis=0, out=g[f"b{name}"])
        if not input_grad:
            return None
        dx = xp.matmul(dq, p["Wq"].T, out=self.scratch("dx", dy.shape, dy.dtype))
        part = self.scratch("part", dy.shape, dy.dtype)
        dx += xp.matmul(dk, p["Wk"].T, out=part)
        dx += xp.matmul(dv, p["Wv"].T, out=part)
        return dx

    def __repr__(self):
        extra = "".join(
            [
                f", head_dim={self.head_dim}" if self.head_dim else "",
                ", causal=True" if self.causal else "",
                "" if self.output_bias else ", output_bias=False",
                ", padding=..." if self.padding is not None else "",
            ]
        )
        return f"MultiHeadAttention({self.heads}{extra})"
