"""--precision bf16|fp16: float32 master weights, fp16's dynamic loss scale, sums in float32, what runs where.

The logic is tested on the CPU with small shapes (numpy float16, ``ml_dtypes.bfloat16``); the same code runs
on a GPU with cupy's arrays of the same types.
"""

import json

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from small_net import small_convnet

from conftest import mpidist

from mpidist import nn
from mpidist.nn.loss_scale import GROWTH_INTERVAL, INITIAL, SMALLEST, LossScale
from mpidist.nn.precision import MasterWeights, compute_dtype, is_low, master_dtype, squared_sum
from mpidist.parallel import LocalStrategy
from mpidist.parallel.verdict import decide
from mpidist.runtime import comm as mpi
from mpidist.runtime.errors import UsageError
from mpidist.settings.config import Settings
from mpidist.settings.validation import check_for

BF16, FP16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)


def test_a_precision_names_its_compute_type_and_the_optimizer_works_in_float32():
    assert compute_dtype("bf16") == BF16 and compute_dtype("fp16") == FP16
    assert compute_dtype("float32") == np.float32 and compute_dtype("float32", "float64") == np.float64
    assert [is_low(t) for t in (BF16, FP16, np.float32, np.float64, np.int16)] == [True, True] + [False] * 3
    assert master_dtype(BF16) == master_dtype(FP16) == np.float32 and master_dtype(np.float64) == np.float64
    with pytest.raises(
        UsageError, match="--precision bf16 keeps float32 master weights: it runs with --dtype "
    ):
        compute_dtype("bf16", "float64")


def test_the_loss_scale_halves_on_an_overflow_and_doubles_after_a_clean_interval():
    scale = LossScale()
    assert scale.value == INITIAL == 2.0**16
    for _ in range(GROWTH_INTERVAL - 1):
        scale = scale.after(False)
    assert scale == LossScale(INITIAL, GROWTH_INTERVAL - 1)
    scale = scale.after(False)  # the interval's last clean step
    assert scale == LossScale(2 * INITIAL, 0)
    scale = scale.after(False).after(False).after(True)  # an overflow: halved, the count starts again
    assert scale == LossScale(INITIAL, 0)
    floor = LossScale(2.0)
    assert [floor.after(True).value, floor.after(True).after(True).value] == [1.0, SMALLEST]
    still = LossScale.for_precision("bf16")
    assert still.after(True) == still.after(False) == still == LossScale(1.0, 0, False)


def test_the_verdict_reads_the_true_norm_of_a_scaled_gradient_and_takes_the_scale_out():
    # a true gradient of norm 5 taken at scale 1024: summed squares 25 * 1024^2
    verdict = decide(25.0 * 1024**2, 0.5, clip_norm=1.0, scale=1024.0)
    assert verdict.squared_norm == 25.0 and verdict.factor == pytest.approx(0.2)
    assert verdict.clipped and verdict.multiplier == pytest.approx(0.2 / 1024)
    unclipped = decide(0.25 * 1024**2, 0.5, clip_norm=1.0, scale=1024.0)
    assert not unclipped.clipped and unclipped.multiplier == 1.0 / 1024
    assert decide(float("inf"), 0.5, 0.0, scale=1024.0).skip  # fp16's overflow: skipped like any Inf


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_squares_are_summed_in_float32_where_16_bits_would_overflow_or_round(dtype):
    values = np.full(3000, 300.0, dtype=dtype)  # 300^2 x 3000 = 2.7e8: fp16's largest is 65504
    assert squared_sum(values) == 2.7e8
    assert squared_sum(values, np.empty(7, np.float32)) == 2.7e8  # (through a small block)
    odd = np.arange(1, 1001).astype(dtype)  # bfloat16 rounds some of them: sum their values as they are
    assert squared_sum(odd) == pytest.approx(float((odd.astype(np.float64) ** 2).sum()), rel=1e-6)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_updates_below_a_16_bit_spacing_are_kept_by_the_master(dtype):
    """SGD at lr 1 on a gradient of 2^-13, 30 times, from 1.0: the 16-bit parameter alone never moves (1 -
    2^-13 rounds back to 1: the spacing below 1 is 2^-11 in fp16, 2^-8 in bf16); through the master it
    reaches 1 - 30 x 2^-13, rounded."""
    model = nn.Sequential([nn.Dense(1, bias=False)], (1,), dtype=dtype)
    model.params[...] = 1.0
    alone = model.params.copy()
    master = MasterWeights(model)
    master.take(np.ones(1, np.float32))
    sgd = nn.make_optimizer("sgd", 1, 1.0, momentum=0.0, xp=np, dtype=np.float32)
    for _ in range(30):
        alone -= np.asarray(2.0**-13, dtype)
        sgd.step(master.params, master.widened(np.full(1, 2.0**-13, dtype), 1.0))
        master.narrow()
    assert float(alone[0]) == 1.0
    assert float(master.params[0]) == 1 - 30 * 2.0**-13
    assert model.params[0] == np.float32(1 - 30 * 2.0**-13).astype(dtype) != 1.0


def test_an_fp16_gradient_is_unscaled_in_float32_where_fp16_would_flush_it_to_zero():
    master = MasterWeights(nn.Sequential([nn.Dense(1, bias=False)], (1,), dtype=FP16))
    scaled = np.full(1, 2e-8 * 2**15, FP16)  # a true gradient of 2e-8: below half fp16's smallest (6e-8)
    assert float(scaled[0] / FP16.type(2**15)) == 0.0  # (unscaled in fp16: gone)
    assert float(master.widened(scaled, 2.0**-15)[0]) == pytest.approx(2e-8, rel=1e-3)


def local(dtype, lr=0.05):
    return LocalStrategy(
        small_convnet(dtype),
        nn.loss_for(4, np),
        lambda size: nn.make_optimizer("adam", size, lr, xp=np, dtype=master_dtype(dtype)),
        seed=3,
    )


def batches(steps=6, n=16):
    rng = np.random.default_rng(0)
    return rng.random((steps, n, 1, 6, 6)), rng.integers(0, 4, (steps, n))


def test_an_fp16_step_that_overflows_is_skipped_its_scale_halved_until_the_gradients_fit():
    strategy = local(FP16)
    strategy.initialize()
    strategy.mixed.loss_scale = LossScale(2.0**30)  # far past fp16's range: the first gradients are Inf
    xs, ys = batches(steps=40)
    before = strategy.mixed.master.params.copy()
    skipped = []
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(40):
            skipped.append(strategy.step(xs[step].astype(FP16), ys[step], 1.0, step).skipped)
            if not skipped[-1]:
                break
            assert np.array_equal(strategy.mixed.master.params, before)  # (a skipped step changes nothing)
    # a run of overflows, each halving the scale, then a step taken at the scale that fits
    skips = skipped.index(False)
    assert skips >= 10 and skipped == [True] * skips + [False]
    assert strategy.mixed.loss_scale == LossScale(2.0**30 / 2**skips, 1)
    assert not np.array_equal(strategy.mixed.master.params, before)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_a_16_bit_step_follows_float32s_and_its_checkpoint_is_the_float32_master(dtype):
    wide, low = local(np.float32), local(dtype)
    wide.initialize()
    low.initialize()
    assert low.mixed.master.params.dtype == np.float32 and low.model.params.dtype == dtype
    np.testing.assert_array_equal(low.mixed.master.params, wide.model.params)  # (the same draw, in float32)
    xs, ys = batches()
    for step in range(len(xs)):
        wide.step(xs[step].astype(np.float32), ys[step], 1.0, step)
        low.step(xs[step].astype(dtype), ys[step], 1.0, step)
    start = local(np.float32)
    start.initialize()
    change = wide.model.params - start.model.params
    drift = low.mixed.master.params - wide.model.params
    # the 16-bit run moves as float32's does, to a few 16-bit roundings of the change
    assert np.linalg.norm(drift) < 0.1 * np.linalg.norm(change)
    state = low.state()
    assert state.params.dtype == np.float32 and np.array_equal(state.params, low.mixed.master.params)
    # what the model computes with is the master rounded
    np.testing.assert_array_equal(low.model.params, low.mixed.master.params.astype(dtype))


def settings(**values):
    return Settings(data="digits", **values)


@pytest.mark.parametrize(
    ("values", "ranks", "refused"),
    [
        (
            {"strategy": "ps-sync", "ps": 1},
            3,
            "--precision bf16 trains with --strategy local or allreduce, not ",
        ),
        ({"strategy": "pipeline", "stages": 2}, 2, "not pipeline"),
        ({"strategy": "allreduce", "shard": "optimizer"}, 2, "not with --shard optimizer"),
        ({"strategy": "allreduce", "tensor": 2}, 2, "not with --tensor 2"),
        ({"strategy": "allreduce", "compress": "fp16"}, 2, "not with --compress fp16"),
        ({"strategy": "allreduce", "exchange": "node"}, 2, "not with --exchange node"),
        ({"strategy": "allreduce", "elastic": True}, 2, "not with --elastic"),
    ],
)
def test_layouts_without_a_master_copy_are_refused_with_what_runs(values, ranks, refused):
    with pytest.raises(UsageError, match=refused):
        check_for(settings(precision="bf16", **values), ranks)
    check_for(settings(precision="float32", **values), ranks)  # (the same layout in float32 runs)


def test_local_and_allreduce_accept_both_precisions():
    for precision in ("bf16", "fp16"):
        check_for(settings(precision=precision, strategy="local"), 1)
        check_for(settings(precision=precision, strategy="allreduce"), 4)


def done(metrics):
    return next(e for e in map(json.loads, metrics.read_text().splitlines()) if e["event"] == "done")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_digits_in_16_bits_reach_float32s_test_accuracy_within_a_point(tmp_path, precision):
    """Two workers (their gradients summed by MPI in 16 bits), five epochs, the same seed."""
    figures = {}
    for name in ("float32", precision):
        metrics = tmp_path / f"{name}.jsonl"
        flags = ("--data", "digits", "--epochs", "5", "--precision", name, "--metrics", str(metrics))
        done_run, _ = mpidist(2, *flags, "--run-dir", "", "--progress", "none")
        assert done_run.returncode == 0, done_run.stderr
        figures[name] = done(metrics)["test_accuracy"]
    assert abs(figures[precision] - figures["float32"]) <= 0.01, figures


def test_a_16_bit_runs_checkpoint_holds_its_float32_master_evaluates_and_resumes(tmp_path):
    import h5py

    flags = ("--data", "digits", "--precision", "bf16", "--checkpoint-dir", str(tmp_path / "ck"))
    first, _ = mpidist(1, "train", *flags, "--epochs", "1", "--run-dir", "", "--progress", "none")
    assert first.returncode == 0, first.stderr
    assert (
        "mpidist: computing in bf16 (parameters, activations, gradients and their exchange)" in first.stdout
    )
    (saved,) = (tmp_path / "ck").glob("ckpt-*.h5")
    with h5py.File(saved) as file:
        params = file["params"][...]
    # float32, and the master's own values: most of them between two bfloat16 values
    assert params.dtype == np.float32
    assert np.mean(params != params.astype(BF16).astype(np.float32)) > 0.9
    evaluated, _ = mpidist(1, "eval", str(saved))
    assert evaluated.returncode == 0 and "test accuracy" in evaluated.stdout, evaluated.stderr
    resumed, _ = mpidist(
        1, "train", *flags, "--epochs", "2", "--resume", "auto", "--run-dir", "", "--progress", "none"
    )
    assert resumed.returncode == 0 and f"resumed from {saved}" in resumed.stdout, resumed.stderr


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_16_bit_gradients_are_summed_by_mpi_in_16_bits(dtype):
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    values = (np.arange(64) % 8 + rank).astype(dtype)  # small integers: exact in both types
    expected = (size * (np.arange(64) % 8) + size * (size - 1) // 2).astype(np.float32)
    summed = values.copy()
    mpi.allreduce_sum(comm, summed)
    assert summed.dtype == dtype and np.array_equal(summed.astype(np.float32), expected)
    pending = values.copy()
    mpi.iallreduce_sum(comm, pending).wait()
    assert np.array_equal(pending.astype(np.float32), expected)
