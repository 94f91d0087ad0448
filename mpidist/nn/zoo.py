"""Models by spec, sized from the dataset's sample shape and output count.

A spec is a zoo name, optionally with comma-separated sizes:
``mlp:256,256,256`` (hidden widths), ``cnn:16,32`` (conv filters, one block
each), ``transformer:2,64,4`` (blocks, width, heads, and optionally the
token kernel: ``transformer:2,64,4,5``);
``linear`` and ``mlp-wide`` take none.
"""

from ..runtime.suggest import did_you_mean
from .conv import Conv1D, Conv2D
from .layers import Dense, Dropout, Flatten, ReLU, ShapeError
from .norm import LayerNorm
from .pooling import MaxPool1D, MaxPool2D
from .sequences import PositionalEmbedding, SequencePool, TokenConv
from .sequential import Sequential
from .transformer import TransformerBlock


class SpecError(ValueError):
    """A model spec that names no zoo model, or gives it arguments it cannot take."""


def _linear(args, sample_shape, outputs):
    return [Flatten(), Dense(outputs, init="glorot")]


def _mlp(default):
    def layers(hidden, sample_shape, outputs):
        stack = [Flatten()]
        for units in hidden or default:
            stack += [Dense(units), ReLU()]
        return stack + [Dense(outputs, init="glorot")]

    return layers


def _cnn_shape(sample_shape):
    """``(L,)`` -> ``(1, L)`` signals; ``(H, W)`` -> ``(1, H, W)`` and ``(C, H, W)`` images; else a mismatch.

    A 2-D sample is an image (the 8x8 digits), so a multi-channel signal cannot
    be told from one by its shape: 1-D data reaches the cnn as ``(L,)``.
    """
    if len(sample_shape) in (1, 2):
        return (1,) + tuple(sample_shape)
    if len(sample_shape) == 3:
        return tuple(sample_shape)
    raise ShapeError(
        f"model 'cnn' needs 1-D signals (L,) or images (H, W) or (C, H, W), "
        f"but the dataset's samples have shape {tuple(sample_shape)}"
    )


def _conv_blocks(filters, spatial, conv, pool):
    """``conv(f)``-ReLU-``pool`` per filter count; pooling stops once a spatial axis is down to 1."""
    stack = []
    for f in filters:
        stack += [conv(f), ReLU()]
        if min(spatial) >= 2:
            stack.append(pool())
            spatial = [d // 2 for d in spatial]
    return stack


def _cnn(filters, sample_shape, outputs):
    if len(sample_shape) == 2:  # (C, L) signals: the MNIST-1D paper's shape of CNN, kernel 5
        return _conv_blocks(filters or (32, 32, 32), sample_shape[1:], lambda f: Conv1D(f, 5), MaxPool1D) + [
            Flatten(),
            Dense(outputs, init="glorot"),
        ]
    # images: the default (16, 32) is the original Conv16-Pool-Conv32-Pool-Dense64 (checkpoints rely on it)
    return _conv_blocks(filters or (16, 32), sample_shape[1:], lambda f: Conv2D(f, 3), MaxPool2D) + [
        Flatten(),
        Dense(64),
        ReLU(),
        Dropout(0.25),
        Dense(outputs, init="glorot"),
    ]


#: ``transformer``'s blocks, width and heads where the spec gives none
TRANSFORMER = (2, 32, 4)
#: positions each token is made from (the kernel of its TokenConv) where the spec gives none: on mnist1d's
#: 40-step signals, 5 took the test accuracy from 67.0% (1, a Dense per step) to 98.4% (docs/models.rst)
TOKEN_KERNEL = 5


def _sequence_shape(sample_shape):
    """``(L,)`` -> ``(L, 1)``: L steps of one feature; ``(L, F)`` as it is; else a mismatch."""
    if len(sample_shape) == 1:
        return (int(sample_shape[0]), 1)
    if len(sample_shape) == 2:
        return tuple(sample_shape)
    raise ShapeError(
        f"model 'transformer' needs sequences (L,) or (L, F), but the dataset's samples have shape "
        f"{tuple(sample_shape)}"
    )


def _transformer(args, sample_shape, outputs):
    blocks, dim, heads, kernel = (tuple(args or TRANSFORMER) + (TOKEN_KERNEL,))[:4]
    return (
        [TokenConv(dim, kernel), PositionalEmbedding(sample_shape[0])]
        + [TransformerBlock(heads) for _ in range(blocks)]
        + [LayerNorm(), SequencePool("mean"), Dense(outputs, init="glorot")]
    )


MODELS = {
    "linear": (_linear, "logistic/linear regression: Flatten, Dense(out); no arguments"),
    "mlp": (_mlp((128, 128)), "two hidden ReLU layers of 128; mlp:W1,W2,... sets the hidden widths"),
    "mlp-wide": (_mlp((512, 512)), "two hidden ReLU layers of 512 (784-512-512-10 on MNIST); no arguments"),
    "cnn": (
        _cnn,
        "images: Conv16-Pool-Conv32-Pool-Dense64-Dropout; 1-D (L,): 3x Conv1D32(k5)-Pool, Dense; "
        "cnn:F1,F2,... sets the conv filters",
    ),
    "transformer": (
        _transformer,
        "sequences (L,) or (L, F): tokens of DIM from KERNEL neighbouring steps "
        "(TokenConv), learned positions, pre-norm blocks, LayerNorm, mean over the steps, "
        "Dense; transformer:LAYERS,DIM,HEADS[,KERNEL] "
        f"(default {','.join(map(str, TRANSFORMER + (TOKEN_KERNEL,)))})",
    ),
}

# models that take arguments, and what the numbers are
_ARGUMENTS = {
    "mlp": "hidden widths",
    "cnn": "conv filters per block",
    "transformer": "blocks, model width, attention heads, token kernel",
}
# models that take a fixed number of arguments (the counts allowed), and how they are written
_FIXED = {"transformer": ((3, 4), "LAYERS,DIM,HEADS[,KERNEL]")}


def _forms():
    return ", ".join(
        f"{name}[:{_FIXED[name][1]}]"
        if name in _FIXED
        else f"{name}[:N1,N2,...]"
        if name in _ARGUMENTS
        else name
        for name in MODELS
    )


def parse_spec(spec):
    """``"mlp:256,256"`` -> ``("mlp", (256, 256))``; a bare ``"mlp"`` -> ``("mlp", None)`` (its defaults).

    Raises:
        SpecError: unknown name, arguments to a model that takes none, or
            arguments that are not positive integers.
    """
    name, colon, rest = str(spec).partition(":")
    if name not in MODELS:
        near = did_you_mean(name, MODELS, lambda found: found + colon + rest)
        raise SpecError(f"model {spec!r}: {name!r} is not in the zoo{near}; choose from {_forms()}")
    if not colon:
        return name, None
    if name not in _ARGUMENTS:
        raise SpecError(f"model {spec!r}: {name!r} takes no arguments; write {name} (zoo: {_forms()})")
    try:
        args = tuple(int(part) for part in rest.split(","))
    except ValueError:
        args = ()
    counts, form = _FIXED.get(name, (None, "N1,N2,..."))
    if not args or min(args) < 1 or (counts is not None and len(args) not in counts):
        many = f"{' or '.join(map(str, counts))} " if counts else ""
        raise SpecError(
            f"model {spec!r}: write {name}:{form} with {many}positive integers ({_ARGUMENTS[name]}), "
            f"or {name} for the defaults"
        )
    if name == "transformer" and args[1] % args[2]:
        raise SpecError(
            f"model {spec!r}: {args[2]} heads do not divide the width {args[1]}; write "
            f"transformer:LAYERS,DIM,HEADS[,KERNEL] with DIM a multiple of HEADS"
        )
    return name, args


def build_model(spec, sample_shape, outputs, xp, dtype, buffers=True):
    """The zoo model ``spec`` (``name`` or ``name:N1,N2,...``) for samples of ``sample_shape`` (``buffers``:
    as :class:`Sequential` takes it).

    Raises:
        SpecError: a bad spec (see :func:`parse_spec`).
        ShapeError: the model cannot take samples of this shape.
    """
    name, args = parse_spec(spec)
    layers_of, _ = MODELS[name]
    input_shape = input_shape_for(spec, sample_shape)
    return Sequential(layers_of(args, input_shape, outputs), input_shape, xp=xp, dtype=dtype, buffers=buffers)


def input_shape_for(spec, sample_shape):
    """The per-sample shape the model ``spec`` is fed (adds a channel axis for cnn, a feature axis for
    transformer)."""
    name, _ = parse_spec(spec)
    shapes = {"cnn": _cnn_shape, "transformer": _sequence_shape}
    return shapes[name](sample_shape) if name in shapes else tuple(sample_shape)
