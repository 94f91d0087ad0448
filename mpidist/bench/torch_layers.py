"""mpidist's layers as torch modules, with their parameters copied over: ``bench``'s reference.

Each layer becomes the torch module computing the same function (the same
shapes in and out, the same initialisation-free parameters once
:func:`copy_parameters` has run), so a torch step and an mpidist step do the
same work from the same start.  A layer with no exact counterpart (a
BatchNorm, a padding mask, an even kernel's "same" padding) makes the
whole model untranslatable: ``None``, and bench leaves torch's row out.

torch is imported by the caller and passed in: it is never a dependency.
"""

import functools

import numpy as np

from ..runtime.xp import to_host


@functools.cache
def _modules(torch):
    """The small modules torch has no ready counterpart for, made once torch is imported."""
    tnn = torch.nn

    class Residual(tnn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return x + self.block(x)

    class Attention(tnn.Module):
        """Self-attention through ``nn.MultiheadAttention`` (its fused scaled-dot-product path)."""

        def __init__(self, dim, heads, causal):
            super().__init__()
            self.attention = tnn.MultiheadAttention(dim, heads, batch_first=True)
            self.causal = causal

        def forward(self, x):
            mask = None
            if self.causal:
                mask = tnn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
            return self.attention(x, x, x, need_weights=False, attn_mask=mask, is_causal=self.causal)[0]

    class TokenConv(tnn.Module):
        """``(N, L, F) -> (N, L, D)``: a Conv1d along the positions, "same" padding as mpidist's."""

        def __init__(self, features, dim, kernel):
            super().__init__()
            self.conv = tnn.Conv1d(features, dim, kernel, padding="same")

        def forward(self, x):
            return self.conv(x.transpose(1, 2)).transpose(1, 2)

    class Positions(tnn.Module):
        def __init__(self, max_length, dim):
            super().__init__()
            self.table = tnn.Parameter(torch.zeros(max_length, dim))

        def forward(self, x):
            return x + self.table[: x.shape[1]]

    class ClassToken(tnn.Module):
        def __init__(self, dim):
            super().__init__()
            self.token = tnn.Parameter(torch.zeros(dim))

        def forward(self, x):
            return torch.cat([self.token.expand(x.shape[0], 1, -1), x], dim=1)

    class Reduce(tnn.Module):
        """A reduction with no parameters: a sequence's mean or first position, a global spatial mean."""

        def __init__(self, how):
            super().__init__()
            self.how = how

        def forward(self, x):
            if self.how == "first":
                return x[:, 0]
            if self.how == "mean":
                return x.mean(dim=1)
            return x.flatten(2).mean(dim=2)  # global: every spatial axis

    class Lookup(tnn.Module):
        """An embedding of ids that arrive as floats (datasets store one dtype)."""

        def __init__(self, vocab, dim):
            super().__init__()
            self.embedding = tnn.Embedding(vocab, dim)

        def forward(self, x):
            return self.embedding(x.long())

    return {
        "Residual": Residual,
        "Attention": Attention,
        "TokenConv": TokenConv,
        "Positions": Positions,
        "ClassToken": ClassToken,
        "Reduce": Reduce,
        "Lookup": Lookup,
    }


def _plain(torch, layer):
    """The module of a layer with no sublayers or hand-made counterpart, or None."""
    kind, tnn = type(layer).__name__, torch.nn
    fixed = {"ReLU": tnn.ReLU, "Flatten": tnn.Flatten, "Tanh": tnn.Tanh, "Sigmoid": tnn.Sigmoid}
    if kind in fixed:
        return fixed[kind]()
    if kind == "GELU":
        return tnn.GELU(approximate="tanh")
    if kind == "Dense":
        return tnn.Linear(layer.fan_in, layer.units, bias=layer.bias)
    if kind == "Dropout":
        return tnn.Dropout(layer.rate)
    if kind == "LayerNorm":
        return tnn.LayerNorm(layer.size, eps=layer.eps)
    if kind in ("Conv1D", "Conv2D"):
        before, after = layer.pads
        if before != after:  # (the "same" of an even kernel: torch pads both sides alike)
            return None
        conv = tnn.Conv1d if kind == "Conv1D" else tnn.Conv2d
        return conv(layer.in_channels, layer.filters, layer.kernel, stride=layer.stride, padding=before)
    pools = {
        "MaxPool1D": tnn.MaxPool1d,
        "MaxPool2D": tnn.MaxPool2d,
        "AvgPool1D": tnn.AvgPool1d,
        "AvgPool2D": tnn.AvgPool2d,
    }
    if kind in pools:
        return pools[kind](layer.size)
    return None


def translate(torch, layer):
    """The torch module doing what mpidist's ``layer`` does, or None where there is no exact counterpart."""
    kind, made = type(layer).__name__, _modules(torch)
    if kind in ("Residual", "TransformerBlock"):
        inner = [translate(torch, sub) for sub in layer.sublayers()]
        if any(module is None for module in inner):
            return None
        block = torch.nn.Sequential(*inner)
        return made["Residual"](block) if kind == "Residual" else block
    if kind == "MultiHeadAttention":
        layout = layer.layout
        if layer.padding is not None or not layer.output_bias or layout.width != layout.dim:
            return None
        return made["Attention"](layout.dim, layout.heads, layer.causal)
    if kind == "TokenConv":
        return made["TokenConv"](layer.features, layer.dim, layer.kernel)
    if kind == "PositionalEmbedding":
        return made["Positions"](layer.max_length, layer.dim)
    if kind == "ClassToken":
        return None if layer.source is not None else made["ClassToken"](layer.dim)
    if kind == "SequencePool":
        return None if layer.padding is not None else made["Reduce"](layer.mode)
    if kind == "GlobalAvgPool":
        return made["Reduce"]("global")
    if kind == "Embedding":
        return None if layer.pad_id is not None else made["Lookup"](layer.vocab, layer.dim)
    return _plain(torch, layer)


def torch_model(torch, model):
    """``model``'s layers as one ``torch.nn.Sequential`` with ``model``'s parameters, or None."""
    modules = [translate(torch, layer) for layer in model.layers]
    if any(module is None for module in modules):
        return None
    net = torch.nn.Sequential(*modules)
    with torch.no_grad():
        for layer, module in zip(model.layers, modules):
            copy_parameters(torch, layer, module)
    return net


def _torch_values(layer, arrays):
    """``arrays`` (``layer.params`` or ``layer.grads``) in the layout of the torch module's parameters, in
    the order ``parameters()`` yields them (a leaf's own; sublayers are walked by :func:`pairs`)."""
    kind, p = type(layer).__name__, {name: to_host(array) for name, array in arrays.items()}
    if kind == "Dense":
        return [p["W"].T] + ([p["b"]] if layer.bias else [])
    if kind == "MultiHeadAttention":
        weights = np.concatenate([p["Wq"].T, p["Wk"].T, p["Wv"].T])
        biases = np.concatenate([p["bq"], p["bk"], p["bv"]])
        return [weights, biases, p["Wo"].T, p["bo"]]
    if kind == "TokenConv":
        return [p["W"].transpose(2, 1, 0), p["b"]]
    order = {
        "Conv1D": ("W", "b"),
        "Conv2D": ("W", "b"),
        "LayerNorm": ("gamma", "beta"),
        "PositionalEmbedding": ("table",),
        "ClassToken": ("token",),
        "Embedding": ("W",),
    }
    return [p[name] for name in order.get(kind, ())]


def pairs(layer, module, which="params"):
    """``(array, parameter)`` for each of ``module``'s parameters (``layer``'s translation): ``layer``'s
    ``which`` (``"params"`` or ``"grads"``) in torch's layout, beside the torch parameter it matches."""
    subs = layer.sublayers()
    if subs:
        children = module.block if type(layer).__name__ == "Residual" else module
        for sub, child in zip(subs, children, strict=True):
            yield from pairs(sub, child, which)
        return
    yield from zip(_torch_values(layer, getattr(layer, which)), module.parameters(), strict=True)


def copy_parameters(torch, layer, module):
    """Set ``module``'s parameters (its translation) to ``layer``'s values, in ``layer``'s dtype."""
    for value, target in pairs(layer, module):
        target.data = torch.from_numpy(value.copy()).reshape(target.shape)
