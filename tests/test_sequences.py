"""Layers of sequences (attention, positions, class token, pooling, the transformer block) and the per-token
loss: gradients against finite differences in float64, outputs against straightforward per-head loops."""

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import (
    ClassToken,
    Dense,
    Dropout,
    Embedding,
    LayerNorm,
    MultiHeadAttention,
    PositionalEmbedding,
    Residual,
    SequencePool,
    Sequential,
    TokenConv,
    TransformerBlock,
    check_gradients,
)


@pytest.mark.parametrize(
    "layers,shape",
    [
        ([MultiHeadAttention(2)], (4, 6)),
        ([MultiHeadAttention(1)], (3, 2)),
        ([MultiHeadAttention(2, head_dim=3, causal=True, output_bias=False)], (5, 4)),
        ([MultiHeadAttention(3, causal=True)], (1, 3)),  # one position: attends to itself
        ([PositionalEmbedding(6)], (4, 3)),  # rows 4 and 5 get zero gradients
        ([ClassToken(), SequencePool("first")], (4, 3)),
        ([SequencePool("mean")], (4, 3)),
        (
            [
                Dense(4),
                PositionalEmbedding(5),
                TransformerBlock(2, mlp_ratio=2),
                LayerNorm(),
                SequencePool(),
                Dense(3),
            ],
            (5, 2),
        ),
        ([TransformerBlock(2, mlp_ratio=1, causal=True), TransformerBlock(1, mlp_ratio=2)], (3, 4)),
        ([TokenConv(4, 3)], (5, 2)),
        ([TokenConv(3, 4)], (6, 1)),  # even: one more position after
        # every window padded
        (
            [TokenConv(2, 5), PositionalEmbedding(5), TransformerBlock(1, mlp_ratio=1)],
            (5, 2),
        ),
    ],
)
def test_sequence_layer_gradients_match_finite_differences(layers, shape):
    check_gradients(layers, shape)


def test_dropout_on_sequences_and_in_a_block_matches_finite_differences_with_fixed_masks():
    model = check_gradients(
        [Dropout(0.5), TransformerBlock(2, mlp_ratio=2, dropout=0.3)], (4, 4), training=True
    )
    masks = [layer.mask for _, layer in nn.sequential.walk(model.layers) if isinstance(layer, Dropout)]
    assert [mask.shape for mask in masks] == [(3, 4, 4)] * 3 and all((mask == 0).any() for mask in masks)


def reference_attention(x, params, heads, causal=False, padding=None):
    """Self-attention head by head, position by position, as the formula reads."""
    n, length, _ = x.shape
    width = params["Wq"].shape[1]
    dh = width // heads
    q, k, v = (x @ params[f"W{name}"] + params[f"b{name}"] for name in "qkv")
    o = np.zeros((n, length, width))
    for s in range(n):
        for h in range(heads):
            cols = slice(h * dh, (h + 1) * dh)
            for i in range(length):
                allowed = [
                    j
                    for j in range(length)
                    if (not causal or j <= i) and (padding is None or not padding[s, j])
                ]
                if not allowed:
                    continue
                scores = np.array([q[s, i, cols] @ k[s, j, cols] / np.sqrt(dh) for j in allowed])
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                o[s, i, cols] = sum(w * v[s, j, cols] for w, j in zip(weights, allowed))
    return o @ params["Wo"] + params.get("bo", 0)


@pytest.mark.parametrize("heads,head_dim,causal", [(2, None, False), (3, 2, True), (1, None, True)])
def test_attention_is_the_per_head_formula_with_the_contracted_parameter_layout(heads, head_dim, causal):
    model = Sequential(
        [MultiHeadAttention(heads, head_dim=head_dim, causal=causal)], (5, 6), dtype=np.float64
    )
    model.init_params(1)
    model.params += np.random.default_rng(2).normal(0, 0.1, model.num_params)
    layer = model.layers[0]
    width = heads * (head_dim or 6 // heads)
    assert {name: value.shape for name, value in layer.params.items()} == {
        "Wq": (6, width),
        "Wk": (6, width),
        "Wv": (6, width),
        "bq": (width,),
        "bk": (width,),
        "bv": (width,),
        "Wo": (width, 6),
        "bo": (6,),
    }
    x = np.random.default_rng(3).normal(size=(2, 5, 6))
    np.testing.assert_allclose(
        model.forward(x), reference_attention(x, layer.params, heads, causal), rtol=1e-12, atol=1e-12
    )


def test_attention_defaults_and_refusals():
    model = Sequential([MultiHeadAttention(4, output_bias=False)], (3, 8))
    assert "bo" not in model.layers[0].params and model.num_params == 3 * (8 * 8 + 8) + 8 * 8
    with pytest.raises(nn.ShapeError, match="3 heads do not divide the model width 8"):
        Sequential([MultiHeadAttention(3)], (4, 8))
    with pytest.raises(nn.ShapeError, match=r"sequences \(L, D\).*\(8,\)"):
        Sequential([MultiHeadAttention(2)], (8,))
    with pytest.raises(ValueError, match="at least 1 head"):
        MultiHeadAttention(0)


def test_causal_attention_does_not_look_ahead():
    model = Sequential([MultiHeadAttention(2, causal=True)], (6, 4), dtype=np.float64)
    model.init_params(0)
    x = np.random.default_rng(0).normal(size=(2, 6, 4))
    changed = x.copy()
    changed[:, 4:] += 10.0
    np.testing.assert_allclose(model.forward(x)[:, :4], model.forward(changed)[:, :4], rtol=1e-12)
    assert not np.allclose(model.forward(x)[:, 4:], model.forward(changed)[:, 4:])


def test_softmax_is_stable_for_huge_scores():
    model = Sequential([MultiHeadAttention(1)], (3, 2), dtype=np.float64)
    model.init_params(0)
    with np.errstate(all="raise"):
        out = model.forward(np.full((1, 3, 2), 1e150) * np.array([1, -1]))
    assert np.isfinite(out).all()


def test_attention_keeps_one_n_h_l_l_array_and_backward_one_more():
    n, heads, length = 3, 2, 7
    model = Sequential([MultiHeadAttention(heads)], (length, 4), dtype=np.float64)
    x = np.random.default_rng(0).normal(size=(n, length, 4))
    model.forward(x, training=True)
    square = (n, heads, length, length)
    assert [key for key, value in model.stash()[0].items() if getattr(value, "shape", None) == square] == [
        "p"
    ]
    model.backward(np.ones((n, length, 4)))
    assert sum(array.shape == square for array in model.workspace._arrays.values()) == 2


# --- key padding --------------------------------------------------------------------------------------------


def padded_model(pad_id=0, pool=True):
    embedding = Embedding(6, 4, pad_id=pad_id)
    layers = [embedding, PositionalEmbedding(5), TransformerBlock(2, mlp_ratio=1, padding=embedding)]
    model = Sequential(layers + ([SequencePool(padding=embedding)] if pool else []), (5,), dtype=np.float64)
    model.init_params(0)
    return model


def test_padding_keys_get_no_attention_so_a_padded_sequence_reads_as_the_short_one():
    ids = np.array([[3, 1, 4, 0, 0], [2, 5, 5, 1, 3]])
    model = padded_model(pool=False)
    out = model.forward(ids)
    short = Sequential([*model.layers[:2], TransformerBlock(2, mlp_ratio=1)], (3,), dtype=np.float64)
    short.params[...] = model.params  # the same parameters, no padding
    np.testing.assert_allclose(out[0, :3], short.forward(ids[:1, :3])[0], rtol=1e-10)
    pooled = padded_model().forward(ids)
    np.testing.assert_allclose(pooled[0], out[0, :3].mean(axis=0), rtol=1e-10)
    np.testing.assert_allclose(pooled[1], out[1].mean(axis=0), rtol=1e-10)


def test_padding_gradients_match_finite_differences_and_a_sequence_of_padding_only_is_finite():
    embedding = Embedding(6, 4, pad_id=0)
    ids = np.array([[3, 1, 4, 0, 0], [0, 0, 0, 0, 0], [2, 5, 0, 1, 3]], dtype=np.float64)  # (not perturbed)
    model = check_gradients(
        [
            embedding,
            TransformerBlock(2, mlp_ratio=1, causal=True, padding=embedding),
            SequencePool(padding=embedding),
            Dense(2),
        ],
        (5,),
        x=ids,
        input_grad=False,
    )
    assert np.isfinite(model.forward(ids)).all()
    cls = ClassToken(padding=embedding)
    check_gradients(
        [embedding, cls, MultiHeadAttention(2, padding=cls), SequencePool("first")],
        (5,),
        x=ids,
        input_grad=False,
    )
    assert cls.padding.shape == (3, 6) and not cls.padding[:, 0].any()


def test_a_padding_source_that_has_no_mask_is_a_shape_error_naming_it():
    embedding = Embedding(6, 4)  # no pad id: it computes no mask
    model = Sequential([embedding, MultiHeadAttention(2, padding=embedding)], (3,))
    with pytest.raises(nn.ShapeError, match=r"Embedding\(6, 4\).*has not computed one"):
        model.forward(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="pad_id 6"):
        Embedding(6, 4, pad_id=6)


# --- positions, class token, pooling ------------------------------------------------------------------------


def test_positional_embedding_adds_its_rows_and_refuses_longer_sequences():
    model = Sequential([PositionalEmbedding(8)], (5, 3), dtype=np.float64)
    model.init_params(0)
    table = model.layers[0].params["table"]
    assert table.shape == (8, 3) and 0.005 < table.std() < 0.05
    x = np.ones((2, 5, 3))
    np.testing.assert_array_equal(model.forward(x), x + table[:5])
    np.testing.assert_array_equal(model.forward(x[:, :2]), x[:, :2] + table[:2])
    with pytest.raises(nn.ShapeError, match="up to 8, got length 9"):
        Sequential([PositionalEmbedding(8)], (9, 3))
    with pytest.raises(nn.ShapeError, match="up to 8, got length 9"):
        model.forward(np.ones((1, 9, 3)))


def test_class_token_is_prepended_and_read_back_first():
    model = Sequential([ClassToken(), SequencePool("first")], (4, 3), dtype=np.float64)
    model.init_params(0)
    token = model.layers[0].params["token"]
    assert model.shapes[1] == (5, 3) and model.output_shape == (3,)
    np.testing.assert_array_equal(model.forward(np.ones((2, 4, 3))), np.stack([token, token]))
    with pytest.raises(ValueError, match="'max'"):
        SequencePool("max")


# --- the block ----------------------------------------------------------------------------------------------


def test_transformer_block_is_two_residuals_in_a_list_that_can_be_replaced_in_place():
    block = TransformerBlock(2, mlp_ratio=3, dropout=0.1, causal=True)
    assert block.sublayers() is block.layers and [type(layer) for layer in block.layers] == [
        Residual,
        Residual,
    ]
    attention, mlp = block.layers[0].layers, block.layers[1].layers
    assert [type(layer).__name__ for layer in attention] == ["LayerNorm", "MultiHeadAttention", "Dropout"]
    assert [type(layer).__name__ for layer in mlp] == ["LayerNorm", "Dense", "GELU", "Dense", "Dropout"]
    assert attention[1].causal and attention[2].rate == 0.1
    model = Sequential([block], (5, 4))
    assert (mlp[1].units, mlp[3].units) == (12, 4)
    assert model.num_params == (3 * 4 * 4 + 3 * 4 + 4 * 4 + 4) + 2 * (2 * 4) + (4 * 12 + 12 + 12 * 4 + 4)
    # a sublayer swapped for another before building keeps its own width, and the block applies it
    other = TransformerBlock(2)
    other.layers[1].layers[3] = Dense(4, bias=False)
    replaced = Sequential([other], (5, 4), dtype=np.float64)
    replaced.init_params(0)
    assert "b" not in other.layers[1].layers[3].params
    assert replaced.forward(np.ones((1, 5, 4))).shape == (1, 5, 4)


def test_a_tiny_causal_transformer_learns_to_copy_the_previous_token():
    """Next-token prediction on sequences ``(N, L)`` of ids whose next token is the current one shifted by
    1."""
    rng = np.random.default_rng(0)
    vocab, length = 5, 6
    model = Sequential(
        [
            Embedding(vocab, 16),
            PositionalEmbedding(length),
            TransformerBlock(2, causal=True),
            LayerNorm(),
            Dense(vocab),
        ],
        (length,),
        dtype=np.float64,
    )
    model.init_params(0)
    loss, opt = nn.SoftmaxCrossEntropy(np), nn.make_optimizer("adam", model.num_params, 0.01)
    for step in range(150):
        ids = rng.integers(0, vocab, (16, length))
        value = loss.forward(model.forward(ids, training=True), (ids + 1) % vocab)
        model.backward(loss.backward(), input_grad=False)
        opt.step(model.params, model.grads)
    assert value < 0.05


# --- the per-token loss -------------------------------------------------------------------------------------


def test_token_cross_entropy_is_the_mean_over_tokens_and_its_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(3, 4, 5)), rng.integers(0, 5, (3, 4))
    loss = nn.SoftmaxCrossEntropy(np)
    value = loss.forward(logits, labels)
    np.testing.assert_allclose(value, loss.forward(logits.reshape(12, 5), labels.reshape(12)), rtol=1e-14)
    loss.forward(logits, labels)
    grad = loss.backward(scale=0.5)
    assert grad.shape == (3, 4, 5)
    numeric = nn.gradcheck.numeric_gradient(lambda: 0.5 * float(loss.forward(logits, labels)), logits)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9)
    assert int(loss.correct(logits, labels)) == int((logits.argmax(-1) == labels).sum())
    assert loss.positions(labels) == 12
    with pytest.raises(ValueError, match=r"needs 12 labels.*got labels \(3,\)"):
        loss.forward(logits, labels[:, 0])


# --- the zoo's transformer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [1, 2, 3, 5])
def test_token_conv_is_conv1d_along_the_positions(kernel):
    """The same kernel as an independent reference, Conv1D on (N, F, L) ("same" padding, one more after if
    even)."""
    rng = np.random.default_rng(kernel)
    ours = Sequential([TokenConv(3, kernel)], (9, 2), xp=np, dtype=np.float64)
    conv = Sequential([nn.Conv1D(3, kernel)], (2, 9), xp=np, dtype=np.float64)
    ours.params[...] = rng.normal(size=ours.num_params)
    conv.layers[0].params["W"][...] = ours.layers[0].params["W"].transpose(2, 1, 0)  # (k, F, D) -> (D, F, k)
    conv.layers[0].params["b"][...] = ours.layers[0].params["b"]
    x = rng.normal(size=(4, 9, 2))
    np.testing.assert_allclose(
        ours.forward(x), conv.forward(x.transpose(0, 2, 1)).transpose(0, 2, 1), atol=1e-12
    )
    single = Sequential([TokenConv(3, 1)], (9, 2), xp=np, dtype=np.float64)  # kernel 1: a Dense per step
    single.params[...] = rng.normal(size=single.num_params)
    w, b = single.layers[0].params["W"][0], single.layers[0].params["b"]
    np.testing.assert_allclose(single.forward(x), x @ w + b, atol=1e-12)


def test_token_conv_refuses_a_kernel_longer_than_the_sequence_and_non_sequences():
    with pytest.raises(nn.ShapeError, match=r"TokenConv kernel 9 is longer than the sequences \(8 steps\)"):
        Sequential([TokenConv(4, 9)], (8, 1))
    with pytest.raises(
        nn.ShapeError, match=r"TokenConv needs sequences \(L, D\), got per-sample shape \(8,\)"
    ):
        Sequential([TokenConv(4, 3)], (8,))
    with pytest.raises(ValueError, match="TokenConv needs dim and kernel >= 1, got 4 and 0"):
        TokenConv(4, 0)


def test_the_transformer_spec_builds_blocks_of_the_given_width_and_heads_on_steps_of_one_feature():
    model = nn.build_model("transformer:3,16,2", (40,), 10, np, np.float32)
    assert model.input_shape == (40, 1) and nn.input_shape_for("transformer", (40,)) == (40, 1)
    assert repr(model.layers[0]) == "TokenConv(16, kernel=5)"  # tokens of 5 neighbouring steps
    assert [type(layer).__name__ for layer in model.layers] == [
        "TokenConv",
        "PositionalEmbedding",
        "TransformerBlock",
        "TransformerBlock",
        "TransformerBlock",
        "LayerNorm",
        "SequencePool",
        "Dense",
    ]
    attention = model.layers[2].layers[0].layers[1]
    assert (attention.heads, attention.dh, model.shapes[2], model.output_shape) == (2, 8, (40, 16), (10,))
    default = nn.build_model("transformer", (12, 3), 4, np, np.float32)  # (L, F): L steps of F features
    assert default.input_shape == (12, 3) and default.shapes[2] == (12, 32)
    assert sum(isinstance(layer, TransformerBlock) for layer in default.layers) == 2
    per_step = nn.build_model("transformer:2,32,4,1", (40,), 10, np, np.float32)  # KERNEL 1: a Dense per step
    wide = nn.build_model("transformer:2,32,4,7", (40,), 10, np, np.float32)
    assert (repr(per_step.layers[0]), repr(wide.layers[0])) == (
        "TokenConv(32, kernel=1)",
        "TokenConv(32, kernel=7)",
    )
    assert wide.num_params - per_step.num_params == 6 * 32  # 6 more weights per output feature


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "transformer:2,64",
            r"write transformer:LAYERS,DIM,HEADS\[,KERNEL\] with 3 or 4 positive integers \(blocks, "
            r"model width, attention heads, token kernel\)",
        ),
        ("transformer:2,64,4,5,1", "with 3 or 4 positive integers"),
        ("transformer:0,64,4", "with 3 or 4 positive integers"),
        ("transformer:2,64,4,0", "with 3 or 4 positive integers"),
        ("transformer:2,64,5", "5 heads do not divide the width 64"),
        ("nosuch", r"transformer\[:LAYERS,DIM,HEADS\[,KERNEL\]\]"),
    ],
)
def test_bad_transformer_specs_are_spec_errors_naming_the_form(spec, message):
    with pytest.raises(nn.SpecError, match=message):
        nn.build_model(spec, (40,), 10, np, np.float32)


def test_the_transformer_refuses_samples_of_three_axes_and_a_kernel_longer_than_the_steps():
    with pytest.raises(nn.ShapeError, match=r"TokenConv kernel 41 is longer than the sequences \(40 steps\)"):
        nn.build_model("transformer:2,32,4,41", (40,), 10, np, np.float32)
    with pytest.raises(nn.ShapeError, match=r"'transformer' needs sequences \(L,\) or \(L, F\).*\(1, 8, 8\)"):
        nn.build_model("transformer", (1, 8, 8), 10, np, np.float32)
