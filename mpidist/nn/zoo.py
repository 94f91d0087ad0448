"""Models by name, sized from the dataset's sample shape and output count."""

from .conv import Conv2D, MaxPool2D
from .layers import Dense, Dropout, Flatten, ReLU, ShapeError
from .sequential import Sequential


def _linear(sample_shape, outputs):
    return [Flatten(), Dense(outputs, init="glorot")]


def _mlp(hidden):
    def layers(sample_shape, outputs):
        stack = [Flatten()]
        for units in hidden:
            stack += [Dense(units), ReLU()]
        return stack + [Dense(outputs, init="glorot")]
    return layers


def _image_shape(sample_shape):
    """``(H, W)`` or ``(C, H, W)`` -> ``(C, H, W)``; anything else is a mismatch."""
    if len(sample_shape) == 2:
        return (1,) + tuple(sample_shape)
    if len(sample_shape) == 3:
        return tuple(sample_shape)
    raise ShapeError(f"model 'cnn' needs image samples (H, W) or (C, H, W), "
                     f"but the dataset's samples have shape {tuple(sample_shape)}")


def _cnn(sample_shape, outputs):
    return [Conv2D(16, 3), ReLU(), MaxPool2D(2), Conv2D(32, 3), ReLU(), MaxPool2D(2),
            Flatten(), Dense(64), ReLU(), Dropout(0.25), Dense(outputs, init="glorot")]


MODELS = {
    "linear": (_linear, "logistic/linear regression: Flatten, Dense(out)"),
    "mlp": (_mlp([128, 128]), "two hidden ReLU layers of 128"),
    "mlp-wide": (_mlp([512, 512]), "two hidden ReLU layers of 512 (784-512-512-10 on MNIST)"),
    "cnn": (_cnn, "Conv16-Pool-Conv32-Pool-Dense64-Dropout: for image data"),
}


def build_model(name, sample_shape, outputs, xp, dtype):
    """The zoo model ``name`` for samples of ``sample_shape`` and ``outputs`` outputs.

    Raises:
        KeyError: unknown name.
        ShapeError: the model cannot take samples of this shape.
    """
    layers_of, _ = MODELS[name]
    input_shape = input_shape_for(name, sample_shape)
    return Sequential(layers_of(input_shape, outputs), input_shape, xp=xp, dtype=dtype)


def input_shape_for(name, sample_shape):
    """The per-sample shape the model ``name`` is fed (adds a channel axis for cnn)."""
    return _image_shape(sample_shape) if name == "cnn" else tuple(sample_shape)
