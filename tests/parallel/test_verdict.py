"""The one step verdict every strategy takes: skip, squared norm, clip factor (tables), and its agreement over
a group."""

import math

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.parallel.verdict import Verdict, agree, decide

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "squared_norm, loss, clip_norm, skip, factor",
    [
        (25.0, 0.5, 1.0, False, 0.2),  # norm 5, brought down to 1
        (25.0, 0.5, 10.0, False, 1.0),  # within the limit
        (25.0, 0.5, 0.0, False, 1.0),  # no clipping
        (0.25, 0.5, 1.0, False, 1.0),
        (0.0, 0.0, 1.0, False, 1.0),  # a zero gradient is not clipped (nor divided by)
        (NAN, 0.5, 1.0, True, 1.0),  # a NaN in the gradients: skipped, not clipped
        (INF, 0.5, 0.0, True, 1.0),
        (25.0, NAN, 1.0, True, 1.0),  # a broken loss skips the step too
        (25.0, -INF, 0.0, True, 1.0),
    ],
)
def test_the_verdict_skips_a_broken_step_and_clips_a_sound_one(squared_norm, loss, clip_norm, skip, factor):
    verdict = decide(squared_norm, loss, clip_norm)
    assert verdict.skip is skip and verdict.factor == pytest.approx(factor)
    assert verdict.clipped is (not skip and factor < 1.0)
    assert verdict.squared_norm == squared_norm or (
        math.isnan(squared_norm) and math.isnan(verdict.squared_norm)
    )


@pytest.mark.parametrize(
    "shard_squares, loss, clip_norm, factor",
    [
        ([9.0, 16.0], 0.5, 1.0, 0.2),  # the norm over every shard: 5, brought down to 1
        ([9.0, 16.0], 0.5, 10.0, 1.0),  # within the limit
        ([0.25], 0.5, 1.0, 1.0),
        ([9.0, 16.0], math.nan, 1.0, None),  # a broken loss breaks the sum: the step is skipped, not clipped
        ([math.inf, 16.0], 0.5, 1.0, None),
    ],
)
def test_clipping_takes_the_norm_over_every_shard_and_a_broken_loss_skips_the_step(
    shard_squares, loss, clip_norm, factor
):
    # what agree sums over a group of ps ranks: each shard's squares and 0 x the loss one of them holds
    verdict = decide(sum(shard_squares), sum(0.0 * loss for _ in shard_squares), clip_norm)
    if factor is None:
        assert verdict.skip and not verdict.clipped and verdict.factor == 1.0
    else:
        assert not verdict.skip and verdict.factor == pytest.approx(factor)


def test_alone_the_verdict_is_this_ranks_own_and_the_carried_numbers_come_back():
    verdict, carried = agree(None, 16.0, 2.0, 2.0, carry=[3.0, 4.0], copies=4)
    assert verdict == Verdict(False, 4.0, pytest.approx(1.0)) and carried.tolist() == [3.0, 4.0]
    verdict, carried = agree(None, 16.0, 2.0, 1.0)
    assert verdict.factor == pytest.approx(0.25) and carried.size == 0


@pytest.mark.mpi(min_size=2)
def test_the_ranks_of_a_group_agree_on_one_verdict_from_their_shares():
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    # rank r holds squares (r + 1)^2; the sum is size (size + 1) (2 size + 1) / 6; each share held by 2
    # "replicas"
    total = size * (size + 1) * (2 * size + 1) / 6
    verdict, (carried,) = agree(world, float((rank + 1) ** 2), 1.0, 1.0, carry=[rank], copies=2)
    assert verdict.squared_norm == pytest.approx(total / 2) and not verdict.skip
    assert verdict.factor == pytest.approx(1.0 / math.sqrt(total / 2)) and carried == size * (size - 1) / 2
    # a broken loss on the last rank alone skips the step on every rank
    verdict, _ = agree(world, 1.0, np.nan if rank == size - 1 else 1.0, 1.0)
    assert verdict.skip and not verdict.clipped
