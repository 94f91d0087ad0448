"""Embedding: a lookup table from integer tokens to vectors."""

import numpy as np

from ..runtime.errors import UsageError
from . import init
from .layers import Layer, ShapeError


def _scatter_add(xp, target, index, values):
    """``target[index[i]] += values[i]`` for every ``i``, repeated indices adding up.

    Plain ``target[index] += values`` keeps only one of the repeats; numpy
    has ``np.add.at`` and cupy ``cupyx.scatter_add`` for this, nothing both share.
    """
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx  # only reached with cupy as xp

        cupyx.scatter_add(target, index, values)


def token_ids(x, vocab):
    """``x`` as int64 token ids; refused where one is negative, not a whole number, or not below ``vocab``.

    A negative id would index the table from its end and a fractional one
    be cut to another, silently: a dataset standardised or scaled by mistake
    trains on wrong tokens.  The check is a few passes over ``(N, L)``
    integers beside the lookup's ``(N, L, dim)``; the message names the
    batch's sample and position (the same on every layout: a
    :class:`~mpidist.nn.tensor.VocabularyPart` checks against the whole
    vocabulary).
    """
    with np.errstate(invalid="ignore"):  # (NaN, Inf and values past int64 cast to garbage, refused below)
        ids = x.astype(np.int64)
    bad = (ids < 0) | (ids >= vocab)
    if x.dtype.kind in "fc":
        bad |= ids != x  # (fractions, NaN and values past int64)
    if bool(bad.any()):
        sample, position = (int(i) for i in np.unravel_index(int(bad.reshape(-1).argmax()), bad.shape)[:2])
        value = x.reshape(bad.shape)[sample, position].item()
        raise UsageError(
            f"Embedding({vocab}): token id {value!r} at sample {sample} of the batch, position "
            f"{position}, is not a whole number in [0, {vocab}): the ids must be the dataset's "
            "token numbers as ingested (not standardised), below the model's vocabulary"
        )
    return ids


class Embedding(Layer):
    """Token ids to vectors: ``(N, L)`` integers in ``[0, vocab)`` -> ``(N, L, dim)``.

    Ids may arrive as floats (datasets store one dtype); they are cast with
    ``astype(int64)``, and a negative, fractional or too large one is refused
    (:func:`token_ids`).  Ids are not differentiable, so the input gradient is
    zeros: put Embedding first in a model (``Sequential.backward`` then skips
    it entirely when ``input_grad=False``).  The table starts N(0, 1), as
    PyTorch's.

    ``pad_id``: the id that pads sequences to one length.  The layer is then a
    *mask source*: after each forward its ``padding`` attribute is the bool
    ``(N, L)`` array ``ids == pad_id``, which a
    :class:`~mpidist.nn.MultiHeadAttention` (or a
    :class:`~mpidist.nn.TransformerBlock`, :class:`~mpidist.nn.SequencePool`)
    given ``padding=`` this layer reads, so that no token attends to padding.
    """

    cache = ("ids",)

    def __init__(self, vocab, dim, pad_id=None):
        super().__init__()
        self.vocab, self.dim = int(vocab), int(dim)
        self.pad_id = None if pad_id is None else int(pad_id)
        if self.pad_id is not None and not 0 <= self.pad_id < self.vocab:
            raise ValueError(f"Embedding pad_id {pad_id} is not an id of the vocabulary [0, {self.vocab})")
        self.padding = None

    def build(self, input_shape):
        if len(input_shape) != 1:
            raise ShapeError(
                f"Embedding needs token sequences (L,), got per-sample shape {tuple(input_shape)}"
            )
        return (int(input_shape[0]), self.dim)

    def param_specs(self):
        return [("W", (self.vocab, self.dim), init.normal(1.0))]

    def forward(self, x, training=False):
        self.ids = token_ids(x, self.vocab)
        if self.pad_id is not None:
            self.padding = self.ids == self.pad_id
        return self.params["W"][self.ids]

    def backward_params(self, dy):
        grad = self.grads["W"]
        grad[...] = 0
        _scatter_add(self.xp, grad, self.ids.reshape(-1), dy.reshape(-1, self.dim))

    def backward(self, dy):
        self.backward_params(dy)
        return self.xp.zeros(self.ids.shape, dtype=dy.dtype)

    def __repr__(self):
        return (
            f"Embedding({self.vocab}, {self.dim}"
            + ("" if self.pad_id is None else f", pad_id={self.pad_id}")
            + ")"
        )
