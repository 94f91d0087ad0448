"""The training recipe: schedules and warm-up, decoupled weight decay, clipping, accumulation.

Closed-form values first (no MPI), then every lockstep strategy against the
local reference on the same global batch, with clipping that bites, a
warm-up schedule and accumulation in slices: equal to 1e-9 in float64.
"""

import functools
import io
import math

import numpy as np
import pytest
from mpi4py import MPI
from small_net import small_convnet, worker_slice

import mpidist
from mpidist import nn
from mpidist.nn import BatchNorm, Dense, LayerNorm, ReLU, Sequential
from mpidist.nn.schedules import LearningRate
from mpidist.parallel import AllreduceStrategy, LocalStrategy, PipelineStrategy, PsSyncStrategy
from mpidist.parallel.recipe import Recipe, clip_factor
from mpidist.runtime.cluster import PS, build_cluster
from mpidist.store import checkpoint


# -- schedules ---------------------------------------------------------------------------------------------
def test_warmup_ramps_linearly_from_a_fraction_of_the_rate():
    rate = LearningRate(0.8, "constant", total_steps=100, warmup_steps=4, warmup_from=0.25)
    assert [rate(s) for s in range(6)] == pytest.approx([0.2, 0.35, 0.5, 0.65, 0.8, 0.8])


def test_step_and_exponential_schedules_count_epochs_from_the_start():
    step = LearningRate(1.0, "step", total_steps=100, steps_per_epoch=10, gamma=0.5, step_epochs=2)
    assert [step(s) for s in (0, 19, 20, 39, 40, 99)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.0625])
    exponential = LearningRate(1.0, "exponential", total_steps=100, steps_per_epoch=10, gamma=0.9)
    assert [exponential(s) for s in (0, 9, 10, 25)] == pytest.approx([1, 1, 0.9, 0.81])


def test_cosine_and_linear_decay_to_the_minimum_after_the_warmup():
    cosine = LearningRate(1.0, "cosine", total_steps=12, warmup_steps=2, warmup_from=0.0, minimum=0.1)
    # after the warm-up, p = (s - 2) / 10
    expected = [0.1 + 0.9 * (1 + math.cos(math.pi * (s - 2) / 10)) / 2 for s in range(2, 13)]
    assert [cosine(s) for s in range(2, 13)] == pytest.approx(expected)
    assert cosine(0) == 0.0 and cosine(1) == pytest.approx(0.5) and cosine(7) == pytest.approx(0.55)
    # (past the end: the minimum)
    assert cosine(12) == pytest.approx(0.1) and cosine(50) == pytest.approx(0.1)
    linear = LearningRate(2.0, "linear", total_steps=10, minimum=0.0)
    assert [linear(s) for s in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'cyclic'"):
        LearningRate(0.1, "cyclic")


# -- weight decay ------------------------------------------------------------------------------------------
def test_adamw_follows_loshchilov_and_hutter():
    """theta_t = theta_{t-1} - eta_t (alpha m_hat / (sqrt(v_hat) + eps) + lambda theta_{t-1}), by hand.

    mpidist's ``weight_decay`` w multiplies the step's rate lr_t: in the paper's
    terms eta_t = lr_t / alpha and lambda = alpha * w, so the decay is lr_t * w * theta.
    """
    alpha, w, b1, b2, eps = 0.1, 0.5, 0.9, 0.999, 1e-8
    opt = nn.Adam(2, lr=alpha, beta1=b1, beta2=b2, eps=eps, dtype=np.float64, weight_decay=w)
    theta = np.array([1.0, -2.0])
    grads = [np.array([0.5, 0.25]), np.array([-1.0, 2.0])]
    rates = [0.1, 0.05]  # a schedule's lr_t
    expected, m, v = theta.copy(), np.zeros(2), np.zeros(2)
    for t, (g, lr_t) in enumerate(zip(grads, rates), start=1):
        eta, lam = lr_t / alpha, alpha * w
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        expected = expected - eta * (alpha * m_hat / (np.sqrt(v_hat) + eps) + lam * expected)
        opt.step(theta, g, lr=lr_t)
    np.testing.assert_allclose(theta, expected, rtol=1e-12)
    # the first step by hand: m_hat = g, v_hat = g^2, so the update is lr_t * (sign(g) + w * theta)
    one = np.array([1.0, -2.0])
    nn.Adam(2, lr=alpha, dtype=np.float64, weight_decay=w, eps=0.0).step(one, np.array([0.5, -0.25]), lr=0.1)
    np.testing.assert_allclose(one, [1.0 - 0.1 * (1 + 0.5 * 1.0), -2.0 - 0.1 * (-1 - 0.5 * 2.0)], rtol=1e-12)


def test_sgdw_decays_the_weights_apart_from_the_gradient():
    opt = nn.SGD(3, lr=0.1, momentum=0.0, dtype=np.float64, weight_decay=0.2, decay_ranges=[(0, 2)])
    params = np.array([1.0, 2.0, 3.0])
    opt.step(params, np.array([1.0, 1.0, 1.0]))
    # decayed: p (1 - 0.1 * 0.2) - 0.1 g; the third is outside the decay ranges
    np.testing.assert_allclose(params, [0.98 - 0.1, 1.96 - 0.1, 3.0 - 0.1], rtol=1e-14)


def test_biases_and_normalisation_parameters_do_not_decay_by_default():
    model = Sequential([Dense(3), BatchNorm(), LayerNorm(), ReLU(), Dense(2)], (4,), dtype=np.float64)
    # Dense W (4x3) at 0, b (3) at 12; BatchNorm gamma, beta, running mean, var; LayerNorm gamma, beta;
    # Dense W (3x2), b (2)
    w2 = 12 + 3 + 4 * 3 + 2 * 3
    assert model.decay_ranges() == [(0, 12), (w2, w2 + 6)]
    model.layers[0].weight_decay = {"b": True}  # a rule users change per layer
    rebuilt = Sequential(model.layers, (4,), dtype=np.float64)
    assert rebuilt.decay_ranges() == [(0, 15), (w2, w2 + 6)]


def test_a_shard_optimizer_decays_the_part_of_the_ranges_it_holds():
    model = Sequential([Dense(3), Dense(2)], (4,), dtype=np.float64)  # W1 [0,12) b1 [12,15) W2 [15,21) b2
    strategy = LocalStrategy(model, nn.loss_for(2, np), lambda size: nn.make_optimizer("sgd", size, 0.1))
    assert strategy.optimizers.make(10, offset=10).decay_ranges == [(0, 2), (5, 10)]
    assert strategy.optimizers.make(23).decay_ranges == [(0, 12), (15, 21)]


# -- clipping ----------------------------------------------------------------------------------------------
def test_clip_factor_brings_the_norm_down_to_the_limit():
    assert clip_factor(25.0, 1.0) == pytest.approx(0.2)
    assert clip_factor(0.25, 1.0) == 1.0
    assert clip_factor(25.0, 0.0) == 1.0  # off
    assert clip_factor(math.nan, 1.0) == 1.0  # a skipped step


def test_local_clipping_scales_the_gradient_to_the_norm():
    model = Sequential([Dense(2)], (3,), dtype=np.float64)
    strategy = LocalStrategy(
        model,
        nn.loss_for(0, np),
        lambda size: nn.make_optimizer("sgd", size, 1.0, momentum=0, dtype=np.float64),
        recipe=Recipe(clip_norm=1e-3),
    )
    strategy.initialize()
    before = model.params.copy()
    x, y = np.ones((4, 3)), np.full((4, 2), 5.0)
    strategy.train_step(x, y, 1.0, 0)
    assert strategy.clipped and strategy.figures["clipped"] == 1
    # lr 1: the step is the clip
    assert np.linalg.norm(before - model.params) == pytest.approx(1e-3, rel=1e-9)


# -- every strategy alike ----------------------------------------------------------------------------------
STEPS = 4


def recipe(accumulate=1, clip=0.0):
    """A warm-up into cosine, and a clip of ``clip`` (:func:`clip_for`: one that bites on some steps only)."""
    return Recipe(
        learning_rate=LearningRate(0.05, "cosine", total_steps=STEPS, warmup_steps=2, warmup_from=0.5),
        clip_norm=clip,
        accumulate=accumulate,
    )


@functools.lru_cache
def clip_for(global_batch, optimizer):
    """A clip between the gradient norms of the run without one (halfway between its middle two of the four
    steps'): the clipped run then clips some steps and not others (``reference_run`` checks it does)."""
    xs, ys = batches(global_batch)
    local = LocalStrategy(
        small_convnet(np.float64), nn.loss_for(4, np), make(optimizer), seed=3, recipe=recipe()
    )
    local.initialize()
    norms = []
    for step in range(STEPS):
        local.train_step(xs[step], ys[step], 1.0, step)
        norms.append(float(np.linalg.norm(local.model.grads)))
    middle = sorted(norms)[STEPS // 2 - 1 : STEPS // 2 + 1]
    return sum(middle) / 2


def make(optimizer):
    return lambda size: nn.make_optimizer(optimizer, size, 0.05, xp=np, dtype=np.float64, weight_decay=0.1)


def batches(global_batch):
    rng = np.random.default_rng(0)
    return rng.random((STEPS, global_batch, 1, 6, 6)), rng.integers(0, 4, (STEPS, global_batch))


def reference_local(global_batch, optimizer, accumulate=1):
    """The local strategy after training on the whole global batch, the parameters after each step, and the
    clipped steps."""
    xs, ys = batches(global_batch)
    local = LocalStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make(optimizer),
        seed=3,
        recipe=recipe(accumulate, clip_for(global_batch, optimizer)),
    )
    local.initialize()
    params, clipped = [], []
    for step in range(STEPS):
        local.train_step(xs[step], ys[step], 1.0, step)
        params.append(local.model.params.copy())
        clipped.append(local.clipped)
    return local, params, clipped


def reference_run(global_batch, optimizer):
    """The local strategy on the whole global batch: the parameters after each step, and the clipped steps."""
    _, params, clipped = reference_local(global_batch, optimizer)
    assert any(clipped) and not all(clipped)  # the test covers both
    return params, clipped


def test_accumulating_in_slices_equals_one_pass_locally():
    xs, ys = batches(10)
    runs = []
    for accumulate in (1, 3, 10):
        local = LocalStrategy(
            small_convnet(np.float64),
            nn.loss_for(4, np),
            make("adam"),
            seed=3,
            recipe=recipe(accumulate, clip_for(10, "adam")),
        )
        local.initialize()
        losses = [local.train_step(xs[s], ys[s], 1.0, s) for s in range(STEPS)]
        runs.append((local.model.params.copy(), losses))
    for params, losses in runs[1:]:
        np.testing.assert_allclose(params, runs[0][0], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(losses, runs[0][1], rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shard", ["none", "optimizer"])  # (--shard optimizer: each worker updates a slice)
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_allreduce_clips_schedules_and_accumulates_as_local(accumulate, optimizer, shard):
    cluster = build_cluster(MPI.COMM_WORLD)
    global_batch = 3 * cluster.num_workers + 2
    expected, clipped = reference_run(global_batch, optimizer)
    xs, ys = batches(global_batch)
    strategy = AllreduceStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make(optimizer),
        cluster,
        seed=3,
        recipe=recipe(accumulate, clip_for(global_batch, optimizer)),
        shard=shard,
    )
    strategy.initialize()
    part = worker_slice(global_batch, cluster.num_workers, cluster.worker_index)
    for step in range(STEPS):
        strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
        np.testing.assert_allclose(strategy.model.params, expected[step], rtol=1e-9, atol=1e-12)
        assert strategy.clipped == clipped[step]
    every = cluster.workers.allgather(strategy.model.params.tobytes())
    assert all(params == every[0] for params in every)  # bit-identical on every worker
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_ps_sync_clips_by_the_norm_over_every_shard(accumulate):
    world = MPI.COMM_WORLD
    num_ps = 2 if world.Get_size() >= 3 else 1
    cluster = build_cluster(world, num_ps=num_ps)
    global_batch = 2 * cluster.num_workers + 1
    expected, clipped = reference_run(global_batch, "adam")
    xs, ys = batches(global_batch)
    strategy = PsSyncStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make("adam"),
        cluster,
        seed=3,
        recipe=recipe(accumulate, clip_for(global_batch, "adam")),
    )
    strategy.initialize()
    if cluster.role != PS:
        part = worker_slice(global_batch, cluster.num_workers, cluster.worker_index)
    for step in range(STEPS):
        if cluster.role == PS:
            strategy.train_step(None, None, 0.0, step)
        else:
            strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
        np.testing.assert_allclose(strategy.model.params, expected[step], rtol=1e-9, atol=1e-12)
        assert strategy.clipped == clipped[step]  # workers and ps alike know the step was clipped
    cluster.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_pipeline_clips_by_the_norm_over_every_stage(accumulate):
    world = MPI.COMM_WORLD
    stages = 2 if world.Get_size() % 2 == 0 else world.Get_size()
    cluster = build_cluster(world)
    replicas = world.Get_size() // stages
    global_batch = 4 * replicas * accumulate + 1
    expected, clipped = reference_run(global_batch, "sgd")
    xs, ys = batches(global_batch)
    strategy = PipelineStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make("sgd"),
        cluster,
        seed=3,
        stages=stages,
        micro_batches=2,
        schedule_name="1f1b",
        global_batch=global_batch,
        recipe=recipe(accumulate, clip_for(global_batch, "sgd")),
    )
    strategy.initialize()
    part = worker_slice(global_batch, replicas, strategy.replica)
    for step in range(STEPS):
        strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
        np.testing.assert_allclose(
            strategy.model.params,
            expected[step][strategy.param_lo : strategy.param_hi],
            rtol=1e-9,
            atol=1e-12,
        )
        assert strategy.clipped == clipped[step]
    strategy.free()
    cluster.free()


# -- through the API: a resumed schedule, the rate in the update, accumulation's memory ---------------------
DIGITS_TRAIN = 1438  # rows of the bundled digits' training split


def test_a_cosine_run_stopped_inside_its_warmup_resumes_exactly(tmp_path):
    """Stopped with ``steps=`` inside the warm-up, then resumed to the end: bit for bit the uninterrupted run.

    A smaller ``steps`` shortens the cosine's ``T`` too, but not the warm-up,
    so the stopped run's steps took the whole run's rates.
    """
    flags = dict(
        data="digits",
        model="mlp:32",
        epochs=2,
        batch_size=64,
        lr=0.01,
        lr_schedule="cosine",
        warmup_steps=10,
        warmup_from=0.2,
        lr_min=0.001,
        dtype="float64",
        eval_every=0,
        progress="none",
        metrics="",
    )
    stop_at, every = 7, 3
    steps_per_epoch = DIGITS_TRAIN // flags["batch_size"]
    total = flags["epochs"] * steps_per_epoch

    def rate(total_steps):
        return LearningRate(
            flags["lr"],
            "cosine",
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
            warmup_steps=flags["warmup_steps"],
            warmup_from=flags["warmup_from"],
            minimum=flags["lr_min"],
        )

    assert 0 < stop_at < flags["warmup_steps"] < total and stop_at % every != 0  # stopped inside the warm-up
    assert [rate(stop_at)(s) for s in range(stop_at)] == [rate(total)(s) for s in range(stop_at)]

    flags = dict(flags, checkpoint_every=every, checkpoint_wait=True)
    whole = mpidist.train(checkpoint_dir=str(tmp_path / "whole"), **flags)
    stopped = mpidist.train(checkpoint_dir=str(tmp_path / "cut"), steps=stop_at, **flags)
    assert stopped.figures["steps"] == stop_at
    assert [checkpoint.load(path).step for path in stopped.checkpoints] == [3, 6, 7]
    stream = io.StringIO()
    resumed = mpidist.train(checkpoint_dir=str(tmp_path / "cut"), resume="auto", stream=stream, **flags)
    assert f"ckpt-{stop_at:08d}-" in stream.getvalue()  # resumed from the stopped run's last checkpoint
    assert whole.figures["steps"] == resumed.figures["steps"] == total
    np.testing.assert_array_equal(resumed.params, whole.params)
    a, b = checkpoint.load(whole.checkpoints[-1]), checkpoint.load(resumed.checkpoints[-1])
    assert a.step == b.step == total and a.optimizer_steps == b.optimizer_steps == total
    for name in ("m", "v"):
        np.testing.assert_array_equal(b.optimizer_state[name], a.optimizer_state[name])


def test_the_scheduled_rate_is_the_rate_of_each_update(tmp_path):
    """Plain SGD on a linear least-squares model, one full batch per step: p' = p - lr(s) x grad(p), in closed
    form.

    Every step is checkpointed, so each update is read back and compared with
    the one the schedule's rate gives, through the warm-up and the cosine.
    """
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3 + 0.1 * rng.normal(size=32)
    data = mpidist.ArrayData(train=(x, y), test=(x[:8], y[:8]), num_classes=0)
    epochs, warmup = 8, 3
    rate = LearningRate(
        0.05, "cosine", total_steps=epochs, warmup_steps=warmup, warmup_from=0.25, minimum=0.001
    )
    result = mpidist.train(
        "linear",
        data,
        epochs=epochs,
        batch_size=len(x),
        optimizer="sgd",
        momentum=0.0,
        lr=0.05,
        lr_schedule="cosine",
        warmup_steps=warmup,
        warmup_from=0.25,
        lr_min=0.001,
        dtype="float64",
        checkpoint_dir=str(tmp_path),
        checkpoint_every=1,
        checkpoint_wait=True,
        keep=0,
        eval_every=0,
        progress="none",
        metrics="",
    )
    saved = {ck.step: ck.params for ck in map(checkpoint.load, result.checkpoints)}
    assert sorted(saved) == list(range(1, epochs + 1))  # one step per epoch, each kept
    rates = []
    for step in range(1, epochs):  # the update computed at `step` takes the parameters after `step` steps
        before, after = saved[step], saved[step + 1]
        weights, bias = before[:3], before[3]
        residual = 2.0 * (x @ weights + bias - y) / len(x)  # d(mean squared error)/d(prediction)
        gradient = np.concatenate([x.T @ residual, [residual.sum()]])
        np.testing.assert_allclose(after, before - rate(step) * gradient, rtol=1e-12, atol=1e-15)
        rates.append(float(np.median((before - after) / gradient)))
    assert rates == pytest.approx([rate(s) for s in range(1, epochs)], rel=1e-9)
    assert rates[0] < rates[1] < rates[2] > rates[3] > rates[-1]  # warming up, then the cosine's decay
    np.testing.assert_array_equal(result.params, saved[epochs])


def test_accumulating_holds_a_quarter_of_the_activations_for_the_same_step():
    """One step of the same batch in 4 slices: the workspace holds a slice's arrays, the parameters are the
    same."""
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 8, 8)), rng.integers(0, 10, 64)
    held, params = {}, {}
    for accumulate in (1, 4):
        model = nn.build_model("mlp:256,256", (8, 8), 10, np, np.float64)
        strategy = LocalStrategy(
            model,
            nn.loss_for(10, np),
            lambda size: nn.make_optimizer("sgd", size, 0.1, xp=np, dtype=np.float64),
            seed=1,
            recipe=Recipe(accumulate=accumulate),
        )
        strategy.initialize()
        strategy.train_step(x, y, 1.0, 0)
        held[accumulate], params[accumulate] = model.workspace.nbytes, model.params.copy()
    assert held[1] >= 64 * (64 + 256 + 256) * 8  # (at least the activations of the whole batch)
    assert held[4] < 0.35 * held[1], f"{held[4]} bytes held with 4 slices against {held[1]} with one"
    np.testing.assert_allclose(params[4], params[1], rtol=0, atol=1e-12)
