"""The pre-norm transformer block, composed of existing layers."""

from .activations import GELU
from .attention import MultiHeadAttention
from .layers import Dense, Dropout, Layer, ShapeError
from .norm import LayerNorm
from .residual import Residual, backward_in_turn, build_in_turn


class TransformerBlock(Layer):
    """Pre-norm transformer block: ``(N, L, D) -> (N, L, D)``.

    ``x = x + Dropout(Attn(LN(x)))``, then ``x = x + Dropout(MLP(LN(x)))``
    with ``MLP = Dense(mlp_ratio * D), GELU, Dense(D)``.  It is a composition
    of existing layers, kept in the list ``layers`` (its :meth:`sublayers`)
    and applied in order, as :class:`~mpidist.nn.Residual` applies its own::

        layers[0] = Residual(LayerNorm(), MultiHeadAttention(heads, causal=causal), Dropout(dropout))
        layers[1] = Residual(LayerNorm(), Dense(mlp_ratio * D), GELU(), Dense(D), Dropout(dropout))

    so another module may replace a sublayer in place (tensor parallelism
    swaps the attention and the two Dense for their shards).  The two Dense
    the block makes get their widths from ``D`` each time it is built; a
    layer put in their place keeps its own.

    Args:
        heads: attention heads (they must divide ``D``).
        mlp_ratio: the MLP's hidden width over ``D``.
        dropout: rate of the two Dropout layers (0: they pass their input on).
        causal: attention to earlier positions only (a language model).
        padding: a mask source for the attention (see :class:`MultiHeadAttention`).
    """

    def __init__(self, heads, mlp_ratio=4, dropout=0.0, causal=False, padding=None):
        super().__init__()
        self.mlp_ratio = int(mlp_ratio)
        if self.mlp_ratio < 1:
            raise ValueError(f"TransformerBlock mlp_ratio must be a positive integer, got {mlp_ratio}")
        hidden, out = Dense(0), Dense(0)
        self.sized = (hidden, out)  # the Dense this block made, sized from D at each build
        self.layers = [
            Residual(
                LayerNorm(), MultiHeadAttention(heads, causal=causal, padding=padding), Dropout(dropout)
            ),
            Residual(LayerNorm(), hidden, GELU(), out, Dropout(dropout)),
        ]

    def sublayers(self):
        return self.layers

    def build(self, input_shape):
        if len(input_shape) != 2:
            raise ShapeError(
                f"TransformerBlock needs sequences (L, D), got per-sample shape {tuple(input_shape)}"
            )
        dim = int(input_shape[1])
        mlp = self.layers[1].layers
        for layer, made, units in zip((mlp[1], mlp[3]), self.sized, (self.mlp_ratio * dim, dim)):
            if layer is made:
                layer.units = units
        return build_in_turn(self.layers, input_shape)

    def forward(self, x, training=False):
        for layer in self.layers:
            x = layer.forward(x, training)
        return x

    def backward(self, dy):
        return backward_in_turn(self.layers, dy)

    def backward_params(self, dy):
        backward_in_turn(self.layers, dy, input_grad=False)

    def __repr__(self):
        attention = self.layers[0].layers[1]
        return (
            f"TransformerBlock({getattr(attention, 'heads', '?')}, mlp_ratio={self.mlp_ratio}"
            + (", causal=True" if getattr(attention, "causal", False) else "")
            + ")"
        )
