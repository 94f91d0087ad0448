"""Residual blocks: ``y = x + block(x)``."""

from .layers import Layer, ShapeError


def backward_in_turn(layers, dy, input_grad=True):
    """Back-propagate ``dy`` through a block's ``layers``, last first; returns the input gradient, or None
    with ``input_grad`` False (the first layer's parameter gradients alone: nothing below it is trained)."""
    for layer in reversed(layers[1:]):
        dy = layer.backward(dy)
    if not input_grad:
        layers[0].backward_params(dy)
        return None
    return layers[0].backward(dy)


def build_in_turn(layers, input_shape):
    """Build a block's ``layers`` one after another from ``input_shape``; returns the last one's output shape
    (a layer's refusal names its place in the block)."""
    shape = tuple(input_shape)
    for index, layer in enumerate(layers):
        try:
            shape = tuple(layer.build(shape))
        except ShapeError as err:
            raise ShapeError(f"block layer {index} ({layer!r}): {err}") from None
    return shape


class Residual(Layer):
    """``y = x + block(x)`` where ``block`` is ``layers`` applied in order; shape kept.

    The block's layers are this layer's :meth:`sublayers`: ``Sequential``
    gives their parameters views into its flat buffers (right after anything
    before the block), reseeds and stashes them, and counts them as this
    layer's in ``layer_params``, so a pipeline moves a block as one layer.
    Blocks nest.
    """

    def __init__(self, *layers):
        super().__init__()
        self.layers = list(layers)

    def sublayers(self):
        return self.layers

    def build(self, input_shape):
        shape = build_in_turn(self.layers, input_shape)
        if shape != tuple(input_shape):
            raise ShapeError(
                f"Residual block maps per-sample shape {tuple(input_shape)} to {shape}; "
                "x + block(x) needs them equal"
            )
        return shape

    def forward(self, x, training=False):
        h = x
        for layer in self.layers:
            h = layer.forward(h, training)
        return self.xp.add(x, h, out=self.scratch_like("y", x))

    def backward(self, dy):
        # the identity path adds dy itself to the block's input gradient
        inner = backward_in_turn(self.layers, dy) if self.layers else dy
        return self.xp.add(dy, inner, out=self.scratch_like("dx", dy))

    def backward_params(self, dy):
        if self.layers:
            backward_in_turn(self.layers, dy, input_grad=False)

    def __repr__(self):
        return f"Residual({', '.join(repr(layer) for layer in self.layers)})"
