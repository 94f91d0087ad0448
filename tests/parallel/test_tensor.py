"""Tensor parallelism: a model split across the ranks of tensor groups trains as ``local`` on the global
batch.

The pure part (:mod:`mpidist.nn.tensor`: which layers split and where each
part's parameters sit in the whole model) is tested with the parts run in
threads, their sums carried between threads; the strategies' part with real
ranks.  Expected values are a single process's, in float64, to 1e-9.
"""

import re
import threading

import numpy as np
import pytest
from conftest import ROOT, run_mpi
from small_net import worker_slice

from mpidist import nn
from mpidist.nn import init
from mpidist.nn.tensor import Bias, TensorCopy, TensorSum, VocabularyPart, operators, part_range, split_model
from mpidist.parallel import LocalStrategy

# Attention's key bias has a zero gradient (a softmax ignores a shift of all its scores), so Adam steps on
# rounding noise there: lr * 1e-17 / eps, entries of ~1e-10 that differ with the order of any sum.
ATOL = 1e-9


def mlp():
    return [nn.Dense(8), nn.ReLU(), nn.Dense(7), nn.Tanh(), nn.Dense(4, init="glorot")]


def residual_mlp():
    return [nn.Dense(6), nn.Residual(nn.LayerNorm(), nn.Dense(12), nn.GELU(), nn.Dense(6)), nn.Dense(4)]


def embedded():
    return [nn.Embedding(11, 6), nn.Dense(8), nn.ReLU(), nn.Dense(6), nn.Flatten(), nn.Dense(4)]


def transformer():
    """Tokens with padding (id 0), learned positions, a transformer block (attention split by heads, its MLP
    by the pair rule), pooling that skips padding, a classifier."""
    tokens = nn.Embedding(11, 6, pad_id=0)
    return [
        tokens,
        nn.PositionalEmbedding(5),
        nn.TransformerBlock(3, mlp_ratio=2, padding=tokens),
        nn.LayerNorm(),
        nn.SequencePool("mean", padding=tokens),
        nn.Dense(4, init="glorot"),
    ]


MODELS = {
    "mlp": (mlp, (6,)),
    "residual": (residual_mlp, (6,)),
    "embedding": (embedded, (3,)),
    "transformer": (transformer, (5,)),
}


def whole_model(name):
    layers, shape = MODELS[name]
    model = nn.Sequential(layers(), shape, dtype=np.float64)
    model.init_params(3)
    return model


def inputs(name, batch=5, seed=0):
    rng = np.random.default_rng(seed)
    shape = MODELS[name][1]
    x = (
        rng.integers(0, 11, (batch,) + shape).astype(np.float64)
        if name in ("embedding", "transformer")
        else rng.random((batch,) + shape)
    )
    if name == "transformer":
        x[:, -2:] = 0  # (padding at the end of every sequence)
    return x, rng.integers(0, 4, batch)


class ThreadSum:
    """An in-place sum over ``parts`` threads: each calls its part's function with its own array."""

    def __init__(self, parts):
        self.barrier, self.slots = threading.Barrier(parts, timeout=20), [None] * parts

    def of(self, part):
        def reduce(array):
            self.slots[part] = array.copy()
            self.barrier.wait()
            total = sum(self.slots)
            self.barrier.wait()
            array[...] = total

        return reduce


def forward_backward(model, x, y):
    loss = nn.SoftmaxCrossEntropy(np)
    out = model.forward(x, training=True)
    value = float(loss.forward(out, y))
    model.backward(loss.backward(), input_grad=True)
    return out.copy(), value


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("parts", [2, 3])
def test_the_parts_of_a_split_model_compute_the_whole_models_outputs_and_gradients(name, parts):
    whole = whole_model(name)
    x, y = inputs(name)
    expected_out, expected_loss = forward_backward(whole, x, y)
    expected = whole.grads.copy()
    sums, results = ThreadSum(parts), [None] * parts

    def run(part):  # (each part's own copy of the whole model, as each rank builds one)
        model, placement = split_model(whole_model(name), part, parts)
        where = placement.positions()
        model.params[...] = whole.params[where]
        for operator in operators(model):
            operator.reduce = sums.of(part)
        results[part] = (*forward_backward(model, x, y), model.grads.copy(), where, model.num_params)

    threads = [threading.Thread(target=run, args=(part,)) for part in range(parts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    grads, seen = np.zeros_like(expected), np.zeros(len(expected), dtype=int)
    for out, loss, part_grads, where, size in results:
        np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-14)
        assert np.isclose(loss, expected_loss, rtol=1e-12)
        grads[where] = part_grads
        seen[where] += 1
        assert size < whole.num_params
    assert seen.min() >= 1  # every parameter of the whole model is in some part
    np.testing.assert_allclose(grads, expected, rtol=1e-10, atol=1e-14)


def test_a_dense_pair_splits_by_columns_then_rows_with_its_bias_after_the_sum():
    whole = whole_model("mlp")
    model, placement = split_model(whole, 1, 2)
    where = placement.positions()
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds == ["TensorCopy", "Dense", "ReLU", "Dense", "TensorSum", "Bias", "Tanh", "Dense"]
    assert model.layers[1].units == 4 and not model.layers[3].bias and isinstance(model.layers[5], Bias)
    # the first layer's W columns 4..7 of (6, 8); the whole model's W is its first entry, at offset 0
    np.testing.assert_array_equal(where[:24], (np.arange(48).reshape(6, 8)[:, 4:]).ravel())
    assert len(operators(model)) == 2 and isinstance(model.layers[0], TensorCopy)
    assert isinstance(model.layers[4], TensorSum)


def test_a_model_that_cannot_be_split_is_refused_naming_why():
    from mpidist.parallel import AllreduceStrategy, PipelineStrategy
    from mpidist.runtime.errors import UsageError
    from mpidist.settings.config import Settings

    model = whole_model("transformer")  # (3 heads)
    with pytest.raises(
        UsageError,
        match=r"--tensor 4: --model test: MultiHeadAttention\(3.*has 3 heads: --tensor 4 "
        r"leaves part 3 none",
    ):
        AllreduceStrategy.check_model(Settings(tensor=4, model="test"), model)
    assert AllreduceStrategy.check_model(Settings(tensor=3), model) == []
    with pytest.raises(
        UsageError, match=r"SequencePool.* in stage 1 reads its mask from Embedding.*another stage"
    ):
        PipelineStrategy.check_model(Settings(strategy="pipeline", stages=2, balance="3,3"), model)


def test_a_model_or_stage_with_nothing_to_split_is_said_to_run_whole():
    from mpidist.parallel import AllreduceStrategy, PipelineStrategy
    from mpidist.settings.config import Settings

    linear = nn.Sequential([nn.Dense(4)], (6,), dtype=np.float64)
    assert AllreduceStrategy.check_model(Settings(tensor=2, model="linear"), linear) == [
        "note: --tensor 2: no layer of --model linear splits (a Dense pair, attention, an embedding, a layer "
        "with tensor_split): each of its 2 parts holds and computes it whole"
    ]
    # stage 0: one Dense; stage 1: a pair, then a Dense
    notes = PipelineStrategy.check_model(
        Settings(strategy="pipeline", stages=2, balance="1,4", tensor=2), whole_model("mlp")
    )
    assert len(notes) == 1 and "no layer of stage 0 (layers 0-0) splits" in notes[0], notes


def decayed(model):
    return np.concatenate([np.arange(lo, hi) for lo, hi in model.decay_ranges()] or [np.zeros(0, dtype=int)])


def test_each_slice_decays_as_the_whole_parameter_it_is_part_of():
    whole = whole_model("transformer")
    whole.layers[0].weight_decay = {"W": False}  # choices a user made (docs/recipe.rst), kept by the slices
    mlp = whole.layers[2].layers[1].layers
    mlp[1].weight_decay, mlp[3].weight_decay = {"b": True, "W": False}, {"b": True}
    whole_decayed = set(decayed(whole).tolist())
    for part in range(2):
        model, placement = split_model(whole, part, 2)
        where = placement.positions()
        assert set(where[decayed(model)].tolist()) == whole_decayed & set(where.tolist()), part


def test_dropout_between_a_split_pair_draws_its_own_mask_on_each_part():
    whole = nn.Sequential([nn.Dense(8), nn.Dropout(0.5), nn.Dense(2)], (3,), dtype=np.float64)
    whole.init_params(0)
    masks = []
    for part in range(2):
        model, _ = split_model(whole, part, 2)
        model.reseed(7, 0, 0)  # (every part reseeds with the same key: seed, group, step)
        model.forward(np.ones((64, 3)), training=True)
        masks += [
            next(layer.mask for _, layer in nn.sequential.walk(model.layers) if isinstance(layer, nn.Dropout))
        ]
    assert masks[0].shape == masks[1].shape == (64, 4) and not np.array_equal(masks[0], masks[1])


def test_splitting_leaves_the_users_layers_as_they_were():
    """The whole model's layers (a user's objects, which Result.model and a second run rebuild) keep reading
    their own mask source; a subclass of Dense (it may compute otherwise) stays whole."""
    whole = whole_model("transformer")
    pool, tokens = whole.layers[4], whole.layers[0]
    split_model(whole, 1, 2)
    assert pool.padding is tokens and whole.layers[2].layers[0].layers[1].padding is tokens

    class Scaled(nn.Dense):
        pass

    layers = [Scaled(8), nn.ReLU(), nn.Dense(4)]
    model, _ = split_model(nn.Sequential(layers, (3,), dtype=np.float64), 0, 2)
    assert model.layers[0] is layers[0] and model.num_params == 3 * 8 + 8 + 8 * 4 + 4


def test_too_few_ids_or_a_split_piece_without_an_origin_is_refused_by_name():
    from mpidist.parallel.parts import check_split
    from mpidist.runtime.errors import UsageError

    small = nn.Sequential([nn.Embedding(2, 4), nn.Flatten(), nn.Dense(3)], (2,), dtype=np.float64)
    with pytest.raises(UsageError, match=r"Embedding.* has 2 ids: --tensor 3 leaves part 2 none"):
        check_split(small.layers, 3)

    class Orphan(Shift):
        def tensor_split(self, part, parts):
            return [Shift()]  # (parameters, and no tensor_origin)

    whole = nn.Sequential([nn.Dense(4), Orphan(), nn.Dense(2)], (3,), dtype=np.float64)
    with pytest.raises(ValueError, match="parameter t but no tensor_origin"):
        split_model(whole, 0, 2)


def test_parts_of_an_uneven_size_differ_by_one_and_cover_it():
    assert [part_range(7, part, 3) for part in range(3)] == [(0, 3), (3, 5), (5, 7)]


def test_an_embedding_splits_by_vocabulary_and_looks_up_zeros_for_the_ids_it_lacks():
    layer = VocabularyPart(3, 6, 2, whole=10)
    model = nn.Sequential([layer], (4,), dtype=np.float64)
    model.params[...] = np.arange(6.0)
    out = model.forward(np.array([[0.0, 3.0, 5.0, 9.0]]))
    np.testing.assert_array_equal(out[0], [[0, 0], [0, 1], [4, 5], [0, 0]])


class Shift(nn.Layer):
    """Elementwise, with a parameter, and no split declared."""

    elementwise = True

    def build(self, input_shape):
        self.size = input_shape[-1]
        return tuple(input_shape)

    def param_specs(self):
        return [("t", (self.size,), init.zeros)]


class Scale(Shift):
    """A user's layer that declares its split: a per-feature scale, split by features as the pair's hidden
    ones."""

    def param_specs(self):
        return [("s", (self.size,), init.ones)]

    def tensor_split(self, part, parts):
        lo, hi = part_range(self.size, part, parts)
        piece = Scale()
        piece.tensor_origin = {"s": ("s", slice(lo, hi))}
        return [piece]


def test_a_users_layer_may_declare_how_it_splits():
    whole = nn.Sequential([nn.Dense(4), Scale(), nn.Dense(2)], (3,), dtype=np.float64)
    model, placement = split_model(whole, 1, 2)
    where = placement.positions()
    scale = model.layers[2]  # (after the TensorCopy and the first Dense's columns)
    assert isinstance(scale, Scale) and scale.params["s"].shape == (2,)
    # the part's W (3x2) and b (2) first, then its scale: the whole W (3x4) and b (4) come first there
    np.testing.assert_array_equal(where[8:10], [12 + 4 + 2, 12 + 4 + 3])


def test_a_layer_with_parameters_between_a_split_pair_must_declare_its_split():
    whole = nn.Sequential([nn.Dense(4), Shift(), nn.Dense(2)], (3,), dtype=np.float64)
    with pytest.raises(ValueError, match="has parameters and stands between a split pair"):
        split_model(whole, 0, 2)


# -- with real ranks -----------------------------------------------------------------------------------------
def tensor_runs(tensor, name, optimizer="adam", steps=4, global_batch=12, clip=0.0, sharded=None):
    """``(cluster, strategy, reference)``: ``allreduce --tensor T`` on the world and ``local`` on the global
    batch, each step's loss and clipping alike; ``sharded``: ``--shard parameters``, units of at most these
    bytes."""
    from mpi4py import MPI

    from mpidist.parallel import AllreduceStrategy, FullyShardedStrategy
    from mpidist.parallel.recipe import Recipe
    from mpidist.runtime.cluster import build_cluster

    world = MPI.COMM_WORLD
    if world.Get_size() % tensor:
        pytest.skip(f"--tensor {tensor} does not divide {world.Get_size()} ranks")
    cluster = build_cluster(world)
    make = lambda size: nn.make_optimizer(optimizer, size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    recipe = Recipe(clip_norm=clip) if clip else None
    reference = LocalStrategy(whole_model(name), nn.loss_for(4, np), make, seed=3, recipe=recipe)
    layout = dict(exchange="mpi") if sharded is None else dict(bucket_bytes=sharded)
    strategy = (AllreduceStrategy if sharded is None else FullyShardedStrategy)(
        whole_model(name), nn.loss_for(4, np), make, cluster, seed=3, tensor=tensor, recipe=recipe, **layout
    )
    reference.initialize()
    strategy.initialize()
    groups = cluster.num_workers // tensor
    part = worker_slice(global_batch, groups, strategy.worker_index)
    for step in range(steps):
        x, y = inputs(name, global_batch, seed=step)
        expected = reference.train_step(x, y, 1.0, step)
        loss = strategy.train_step(x[part], y[part], (part.stop - part.start) / global_batch, step)
        assert np.isclose(loss, expected, rtol=1e-9) and strategy.clipped == reference.clipped
    return cluster, strategy, reference


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tensor", [2, 3])
def test_allreduce_with_tensor_parts_trains_as_local_on_the_global_batch(name, tensor):
    cluster, strategy, reference = tensor_runs(tensor, name)
    np.testing.assert_allclose(
        strategy.model.params,
        reference.model.params[strategy.tensor.placement.positions()],
        rtol=1e-9,
        atol=ATOL,
    )
    # the parameters every part holds alike (never re-synced) are alike to the bit on every rank: each part
    # updates them from the same sums
    shared = np.concatenate(
        [strategy.model.params[lo:hi] for lo, hi in strategy.tensor.shared] + [np.zeros(0)]
    )
    every = cluster.world.allgather(shared)
    assert shared.size and all(np.array_equal(other, every[0]) for other in every)
    state = strategy.state()  # the whole model's, gathered on the chief
    if cluster.is_chief:
        np.testing.assert_allclose(state.params, reference.model.params, rtol=1e-9, atol=ATOL)
        np.testing.assert_allclose(
            state.optimizer["m"], reference.optimizer.state_arrays()["m"], rtol=1e-9, atol=1e-15
        )
        assert state.steps == 4
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_a_clipped_tensor_run_clips_by_the_whole_models_norm():
    cluster, strategy, reference = tensor_runs(2, "residual", optimizer="sgd", clip=0.05)
    assert reference.clipped and strategy.clipped
    np.testing.assert_allclose(
        strategy.model.params,
        reference.model.params[strategy.tensor.placement.positions()],
        rtol=1e-9,
        atol=ATOL,
    )
    strategy.free()
    cluster.free()


def deep_mlp():
    return [
        nn.Dense(8),
        nn.ReLU(),
        nn.Dense(6),
        nn.Tanh(),
        nn.Dense(8),
        nn.ReLU(),
        nn.Dense(4, init="glorot"),
    ]


MODELS["deep"] = (deep_mlp, (6,))
# a split layer in each stage where the model has one; the transformer's pooling reads its mask from the
# embedding, so they share a stage
BALANCE = {"deep": [3, 4], "residual": [2, 1], "embedding": [3, 3], "transformer": [5, 1]}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("name", ["deep", "residual", "embedding", "transformer"])
def test_a_pipeline_with_tensor_parts_trains_as_local_on_the_global_batch(name):
    """pipeline x tensor 2 x 2 at 4 ranks (data x pipeline x tensor 2 x 2 x 2 at 8: see
    test_tensor_layouts)."""
    from mpi4py import MPI

    from mpidist.parallel import PipelineStrategy
    from mpidist.runtime.cluster import build_cluster

    world, stages, tensor, global_batch = MPI.COMM_WORLD, 2, 2, 12
    if world.Get_size() % (stages * tensor):
        pytest.skip(f"{stages} stages x {tensor} parts do not divide {world.Get_size()} ranks")
    cluster = build_cluster(world)
    make = lambda size: nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    reference = LocalStrategy(whole_model(name), nn.loss_for(4, np), make, seed=3)
    strategy = PipelineStrategy(
        whole_model(name),
        nn.loss_for(4, np),
        make,
        cluster,
        seed=3,
        stages=stages,
        micro_batches=2,
        schedule_name="1f1b",
        balance=BALANCE[name],
        global_batch=global_batch,
        tensor=tensor,
    )
    reference.initialize()
    strategy.initialize()
    part = worker_slice(global_batch, strategy.replicas, strategy.replica)
    for step in range(3):
        x, y = inputs(name, global_batch, seed=step)
        expected = reference.train_step(x, y, 1.0, step)
        loss = strategy.train_step(x[part], y[part], (part.stop - part.start) / global_batch, step)
        assert np.isclose(loss, expected, rtol=1e-9)
    np.testing.assert_allclose(
        strategy.model.params, reference.model.params[strategy.placement.positions()], rtol=1e-9, atol=ATOL
    )
    if strategy.stage == 0:  # (each model has a split layer in its first stage: a part holds less than it)
        assert strategy.model.num_params < strategy.param_hi - strategy.param_lo
    state = strategy.state()
    if cluster.is_chief:
        np.testing.assert_allclose(state.params, reference.model.params, rtol=1e-9, atol=ATOL)
        np.testing.assert_allclose(
            state.optimizer["v"], reference.optimizer.state_arrays()["v"], rtol=1e-9, atol=1e-15
        )
    strategy.free()
    cluster.free()


def test_data_pipeline_and_tensor_layouts_of_8_ranks_train_as_local():
    """The README's test command runs 2 to 6 ranks: data x pipeline x tensor 2 x 2 x 2 needs 8, and the tensor
    groups on two emulated nodes (4 ranks each: a group stays within a node)."""
    done, _ = run_mpi(
        8,
        [
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "mpi",
            "--with-mpi",
            str(ROOT / "tests" / "parallel" / "test_tensor.py"),
        ],
        nodes=2,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # every test runs at 8 ranks but --tensor 3's (3 does not divide 8)
    assert "failed" not in done.stdout and "9 passed, 4 skipped" in done.stdout, done.stdout


def test_a_checkpoint_written_by_tensor_parts_resumes_on_any_layout_and_evaluates(tmp_path):
    """Written at data x tensor 2 x 2; resumed as local, as allreduce on 3 ranks and as pipeline x tensor 2 x
    2, each 4 steps more: the same global batches (the lanes), so the same model to 1e-9 in float64; and eval
    gives the test figures the run ended with."""
    from conftest import checkpoint_at, events

    from mpidist.store import checkpoint

    common = [
        "-m",
        "mpidist",
        "--dtype",
        "float64",
        "--progress",
        "none",
        "--run-dir",
        "",
        "--checkpoint-wait",
    ]
    done, _ = run_mpi(
        4,
        [
            *common,
            "--tensor",
            "2",
            "--steps",
            "10",
            "--metrics",
            str(tmp_path / "m.jsonl"),
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--checkpoint-every",
            "5",
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written = checkpoint_at(tmp_path / "ck", 10)
    # the second gather of the run (its first at step 5) holds the whole state, as one process trained it
    done, _ = run_mpi(
        1,
        [*common, "--strategy", "local", "--steps", "10", "--checkpoint-dir", str(tmp_path / "one")],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    alone, split = checkpoint.load(checkpoint_at(tmp_path / "one", 10)), checkpoint.load(written)
    np.testing.assert_allclose(split.params, alone.params, rtol=1e-9, atol=ATOL)
    assert sorted(split.optimizer_state) == sorted(alone.optimizer_state) == ["m", "v"]
    for name in ("m", "v"):
        np.testing.assert_allclose(
            split.optimizer_state[name], alone.optimizer_state[name], rtol=1e-7, atol=1e-12
        )
    ended = events(tmp_path / "m.jsonl", "done")[0]
    # mlp on digits: Dense 64-128, 128-128, 128-10, 26,122 parameters. At T = 2 the first pair splits (the
    # first by columns, the second by rows, its 128 biases whole) and the last Dense stays whole: 12,352 +
    # 1,418 a part
    held = events(tmp_path / "m.jsonl", "start")[0]["held_bytes"]
    assert [(entry["rank"], entry["params"]) for entry in held] == [
        (rank, 13_770 * 8) for rank in range(4)
    ], held
    layouts = {
        "local": (1, ["--strategy", "local"]),
        "allreduce": (3, ["--strategy", "allreduce"]),
        "pipeline-tensor": (4, ["--strategy", "pipeline", "--stages", "2", "--tensor", "2"]),
    }
    params, held = {}, {"tensor": held}
    for name, (ranks, flags) in layouts.items():
        done, _ = run_mpi(
            ranks,
            [
                *common,
                *flags,
                "--resume",
                str(written),
                "--steps",
                "14",
                "--metrics",
                str(tmp_path / f"{name}.jsonl"),
                "--checkpoint-dir",
                str(tmp_path / name),
            ],
            timeout=120,
        )
        assert done.returncode == 0, (name, done.stderr)
        assert f"resumed from {written} at step 10" in done.stdout, (name, done.stdout)
        params[name] = checkpoint.load(checkpoint_at(tmp_path / name, 14)).params
        held[name] = [
            entry["params"] for entry in events(tmp_path / f"{name}.jsonl", "start")[0].get("held_bytes", [])
        ]
    assert held["allreduce"] == [26_122 * 8 // 3] * 3, held  # T = 1: the node's one whole copy, 1/3 a rank
    # two stages: the first holds Dense 64-128 alone (no pair to split: whole on both parts), the second
    # splits the pair 128-128 (by columns: 8,256) and 128-10 (by rows, its biases whole: 650)
    assert held["pipeline-tensor"] == [8_320 * 8] * 2 + [8_906 * 8] * 2, held
    assert not np.allclose(params["local"], checkpoint.load(written).params)  # (4 steps did train)
    for name in ("allreduce", "pipeline-tensor"):
        np.testing.assert_allclose(params[name], params["local"], rtol=1e-9, atol=ATOL, err_msg=name)
    done, _ = run_mpi(2, ["-m", "mpidist", "eval", str(written)], timeout=60)
    assert done.returncode == 0, done.stderr
    assert (
        f"{100 * ended['test_accuracy']:.2f}%" in done.stdout and f"{ended['test_loss']:.4f}" in done.stdout
    ), (done.stdout, ended)


@pytest.mark.parametrize(
    "hosts, across", [("127.0.0.1:2,localhost:2", False), ("127.0.0.1:1,localhost:1", True)]
)
def test_the_role_table_says_when_a_tensor_group_spans_nodes(hosts, across):
    """Two emulated nodes: ranks placed in blocks keep each group of 2 on a node; dealt out in turn (one slot
    a host), every group spans both, and every rank's row says so."""
    import subprocess
    import sys

    from conftest import child_environ, mpiexec_path

    done = subprocess.run(
        [
            mpiexec_path(),
            "-hosts",
            hosts,
            "-n",
            "4",
            sys.executable,
            "-m",
            "mpidist",
            "--tensor",
            "2",
            "--steps",
            "1",
            "--progress",
            "none",
            "--run-dir",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_environ(PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    # (its holds)
    rows = [line for line in done.stdout.splitlines() if re.search(r"cpu +tensor part \d/2", line)]
    assert len(rows) == 4 and all(("(group across nodes)" in row) == across for row in rows), done.stdout


def test_the_tensor_family_registers_its_part_as_the_split_of_the_part_axis_once():
    """The strategies that compose with the tensor axis reach TensorPart through the core's registry (they
    never import the tensor family): importing mpidist.parallel registers it, and a second split of the same
    axis is refused."""
    from mpidist.parallel import registry
    from mpidist.parallel.tensor import TensorPart

    assert registry.SPLITS["part"] is TensorPart
    with pytest.raises(ValueError, match="the 'part' axis has a split already"):
        registry.register_split("part")(type("Another", (), {}))
    assert registry.SPLITS["part"] is TensorPart
