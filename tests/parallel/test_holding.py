"""What a rank holds of the model under each layout, priced at start-up before any strategy exists."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from mpidist import nn
from mpidist.loop.pricing import check_holds
from mpidist.parallel import holding
from mpidist.runtime.errors import UsageError

ADAM = 2  # Adam's state arrays: m and v


def model():
    # Flatten, Dense 64->32, ReLU, Dense 32->32, ReLU, Dense 32->10: 2080 + 1056 + 330 parameters
    return nn.build_model("mlp:32,32", (8, 8), 10, np, np.float32, buffers=False)


def settings(strategy="allreduce", stages=1, tensor=1, shard="none"):
    return SimpleNamespace(
        strategy=strategy,
        stages=stages,
        tensor=tensor,
        shard=shard,
        balance="",
        model="mlp:32,32",
        optimizer="adam",
        bucket_mb=64.0,
        reshard_after_forward=True,
        exchange="auto",
        device="cpu",
    )


def cluster(rank, size, workers=None):
    return SimpleNamespace(
        rank=rank,
        size=size,
        is_chief=rank == 0,
        num_workers=workers or size,
        worker_index=rank,
        num_nodes=size,  # (a node each: nothing shared)
        local_size=1,
    )


def test_a_data_parallel_rank_holds_the_whole_model_and_the_chiefs_copy():
    whole = model().num_params
    assert whole == 2080 + 1056 + 330
    for rank in (0, 1):
        assert holding.held(settings(), cluster(rank, 2), model(), ADAM) == holding.Held(whole, whole, whole)


def test_a_worker_under_shard_optimizer_holds_its_slice_of_the_state_and_the_chief_assembles_it():
    whole = model().num_params
    chief, other = (
        holding.held(settings(shard="optimizer"), cluster(rank, 3), model(), ADAM) for rank in (0, 1)
    )
    # its copy of the parameters for a checkpoint, and the whole m and v assembled from the slices
    assert (chief.params, chief.optimizer, chief.gathered) == (
        whole,
        math.ceil(whole / 3),
        whole * (1 + ADAM),
    )
    assert (other.params, other.optimizer, other.gathered) == (whole, math.ceil(whole / 3), whole)


def test_pipeline_stages_hold_their_layers_and_nothing_of_the_whole():
    whole = model().num_params
    stages = [
        holding.held(settings("pipeline", stages=2), cluster(rank, 2), model(), ADAM) for rank in (0, 1)
    ]
    assert sum(stage.params for stage in stages) == whole  # every parameter on exactly one stage
    assert all(0 < stage.params < whole for stage in stages)
    assert stages[0].gathered == stages[1].gathered == 0  # (the chief too: a split model is never assembled)
    assert stages[1].part == "stage 1 of 2"
    # with --tensor 2 each of a stage's two ranks holds its part: stage 0's lone Dense 64->32 has no pair to
    # split with, and is held whole by both; stage 1's pair is split, columns of Dense 32->32 (32 x 16 + 16)
    # and rows of Dense 32->10 (16 x 10), the bias (10) after the sum (not half of each stage: 2080 and 693)
    parts = [
        holding.held(settings("pipeline", stages=2, tensor=2), cluster(rank, 4), model(), ADAM)
        for rank in range(4)
    ]
    assert [part.params for part in parts] == [2080, 2080, 528 + 160 + 10, 528 + 160 + 10]
    assert parts[3].part == "stage 1 of 2, part 1 of 2"


def test_a_tensor_part_holds_its_slices_and_the_layers_it_keeps_whole():
    # columns of Dense 64->32 (64 x 8 + 8), rows of Dense 32->32 (8 x 32) and its bias after the sum (32), and
    # the last Dense 32->10 whole (330: it has no pair to split with); a quarter of the whole would be 867
    part = holding.held(settings(tensor=4), cluster(5, 8), model(), ADAM)
    held = 520 + 256 + 32 + 330
    assert (part.params, part.optimizer, part.gathered, part.part) == (held, held, 0, "tensor part 1 of 4")


def test_the_start_up_check_prices_this_ranks_share_not_the_whole_model(monkeypatch):
    from mpidist.runtime import memory

    whole = model().num_params
    last_stage = holding.held(settings("pipeline", stages=2), cluster(1, 2), model(), ADAM).params
    # parameters, a micro-batch's gradients and the step's sum, m, v of its stage: nothing assembled
    need = 4 * (3 + ADAM) * last_stage
    monkeypatch.setattr(memory, "ranks_per_node", lambda: 1)
    monkeypatch.setattr(memory, "available_bytes", lambda: need)
    check_holds(settings("pipeline", stages=2), cluster(1, 2), model())  # fits exactly
    with pytest.raises(UsageError, match=f"training {whole:,} parameters with adam needs "):
        check_holds(settings(), cluster(1, 2), model())  # the whole model on this rank does not
    first_stage = holding.held(settings("pipeline", stages=2), cluster(0, 2), model(), ADAM).params
    # (the chief holds its stage alone, as every stage does)
    assert (first_stage, last_stage) == (
        2080,
        1056 + 330,
    )
    with pytest.raises(
        UsageError,
        match=r"stage 0 of 2 \(2,080 of the model's 3,466 parameters\), trained with "
        r"adam needs",
    ):
        check_holds(settings("pipeline", stages=2), cluster(0, 2), model())
    monkeypatch.setattr(memory, "available_bytes", lambda: need - 1)
    with pytest.raises(UsageError, match=f"stage 1 of 2 .* needs {memory.human(need)}"):
        check_holds(settings("pipeline", stages=2), cluster(1, 2), model())


def test_a_whole_model_that_does_not_fit_is_refused_naming_the_pipeline_it_would_fit_as(monkeypatch):
    from mpidist.runtime import memory

    monkeypatch.setattr(memory, "ranks_per_node", lambda: 1)
    largest = 4 * (3 + ADAM) * 2080  # the Dense 64->32 layer's training state: no stage can be smaller
    monkeypatch.setattr(memory, "available_bytes", lambda: largest)
    with pytest.raises(
        UsageError,
        match=r"training 3,466 parameters with adam needs .*; split, it fits: "
        r"--strategy pipeline --stages 2 on 2 or more ranks \(its largest stage "
        r"needs 40.6 KiB\)",
    ):
        check_holds(settings(), cluster(0, 2), model())
    monkeypatch.setattr(memory, "available_bytes", lambda: largest - 1)
    with pytest.raises(UsageError, match=r"training 3,466 parameters with adam needs [^;]*$"):
        check_holds(settings(), cluster(0, 2), model())
    # over 8 workers each holding an eighth of it (and the one unit, gathered with its gradients), it fits
    sharded = holding.held_bytes(holding.fully_sharded_held(settings(), cluster(0, 8), model()), ADAM, 4)
    assert sharded == 4 * (4 * 434 + 2 * 3472) < largest - 1
    with pytest.raises(
        UsageError,
        match=r"training 3,466 parameters with adam needs [^;]*; sharded, it fits: --shard parameters \(each "
        rf"of the 8 workers needs {memory.human(sharded)}\)$",
    ):
        check_holds(settings(), cluster(0, 8), model())
