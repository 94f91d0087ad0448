"""ps-async's rules as literal tables, without MPI: the staleness bound, the serving loop, lost workers."""

import math

import numpy as np
import pytest

from mpidist.parallel.ps.async_rounds import (
    LOOK_EVERY,
    NEVER,
    POLL_MAX_SECONDS,
    POLL_SECONDS,
    Act,
    Lost,
    Serving,
    WorkerPace,
    ahead_of_slowest,
    carries_gradient,
    follower_action,
    inbox_action,
    look_now,
    mean_step,
    next_pause,
    own_squared_norm,
    sort_lost,
    watches_checkpoints,
    within_bound,
)
from mpidist.parallel.base import SkipCounter, finite
from mpidist.parallel.recipe import clip_factor
from mpidist.runtime.cluster import PS, WORKER
from mpidist.runtime.errors import RunError


@pytest.mark.parametrize(
    "completed, clocks, ahead",
    [
        (5, [5, 3, 4], 2),  # two steps ahead of the slowest
        (3, [5, 3, 4], 0),  # the slowest itself
        (5, [5, NEVER, 4], 1),  # a finished (or retired, lost) worker holds nobody back
        (5, [NEVER, NEVER, 7], -2),  # behind everyone still training
        (0, [0, 0], 0),
    ],
)
def test_a_worker_is_as_far_ahead_as_its_steps_over_the_slowest_clock(completed, clocks, ahead):
    assert ahead_of_slowest(completed, np.array(clocks, dtype=np.int64)) == ahead


@pytest.mark.parametrize(
    "ahead, bound, go",
    [
        (0, 0, True),
        (1, 0, False),  # --staleness 0: lock step
        (2, 2, True),
        (3, 2, False),  # the default bound
        (10**6, None, True),  # -1: fully asynchronous
        (-2, 0, True),
    ],
)
def test_the_staleness_bound_holds_a_worker_only_past_s_steps_ahead(ahead, bound, go):
    assert within_bound(ahead, bound) is go


@pytest.mark.parametrize(
    "bound, completed, clocks, expected",
    [
        (2, 5, [5, 2], (False, 3)),
        (2, 5, [5, 3], (True, 2)),
        (2, 5, [5, NEVER], (True, 0)),  # the slow worker retired: nothing holds this one back
        (0, 4, [4, NEVER, NEVER], (True, 0)),
        (None, 9, [9, 0], (True, 9)),
    ],
)
def test_a_worker_pace_checks_its_completed_steps_against_the_clocks(bound, completed, clocks, expected):
    pace = WorkerPace(bound)
    for _ in range(completed):
        pace.step_done()
    assert pace.check(np.array(clocks, dtype=np.int64)) == expected


def test_a_held_worker_looks_for_the_lost_every_so_many_clock_reads():
    assert [polls for polls in range(1, 3 * LOOK_EVERY + 1) if look_now(polls)] == [
        LOOK_EVERY,
        2 * LOOK_EVERY,
        3 * LOOK_EVERY,
    ]


@pytest.mark.parametrize(
    "weighted_squares, weight, clip_norm, factor",
    [
        (0.25 * 25.0, 0.5, 1.0, 0.2),  # its batch's gradient has norm 5 (weighted by 0.5: 2.5): clipped to 1
        (0.25 * 0.25, 0.5, 1.0, 1.0),  # norm 0.5: within the limit
        (1.0 * 4.0, 1.0, 1.0, 0.5),
    ],
)
def test_a_worker_clips_its_own_batchs_gradient_undoing_its_share(
    weighted_squares, weight, clip_norm, factor
):
    assert clip_factor(own_squared_norm(weighted_squares, weight), clip_norm) == pytest.approx(factor)


@pytest.mark.parametrize(
    "asked, snapshots, drained, over, act",
    [
        # the first ps asked for a checkpoint this ps has not sent its shard to
        (
            1,
            0,
            False,
            False,
            Act.SNAPSHOT,
        ),
        # ... even once over: a checkpoint asked for before the end is answered
        (
            3,
            2,
            True,
            True,
            Act.SNAPSHOT,
        ),
        (2, 2, True, True, Act.LEAVE),  # drained, and the first ps ended serving
        (2, 2, False, True, None),  # not drained yet: take what is left first
        (2, 2, True, False, None),  # drained, but the first ps may still ask for a checkpoint
        (0, 0, False, False, None),
    ],
)
def test_a_ps_other_than_the_first_snapshots_when_asked_and_leaves_once_drained_and_over(
    asked, snapshots, drained, over, act
):
    assert follower_action(asked, snapshots, drained, over) is act


@pytest.mark.parametrize(
    "pending, drained, done, workers, act",
    [
        (3, False, None, 2, Act.TAKE),  # arrivals counted: take them
        (1, True, None, 2, Act.TAKE),
        (0, False, 1, 2, Act.IDLE),  # nothing arrived, a worker still trains: wait
        (0, False, 2, 2, Act.DRAIN),  # every worker signed off after its last count: take the last
        (0, True, None, 2, Act.IDLE),  # drained: wait for the first ps to end serving
    ],
)
def test_a_ps_takes_what_arrived_idles_while_workers_train_and_drains_once_all_signed_off(
    pending, drained, done, workers, act
):
    assert inbox_action(pending, drained, done, workers) is act


def test_an_idle_ps_backs_off_doubling_its_sleep_up_to_the_most():
    pauses, pause = [], POLL_SECONDS
    for _ in range(7):
        pauses.append(pause)
        pause = next_pause(pause)
    assert pauses == pytest.approx(
        [0.0002, 0.0004, 0.0008, 0.0016, 0.0032, POLL_MAX_SECONDS, POLL_MAX_SECONDS]
    )


@pytest.mark.parametrize(
    "first, periodic, drained, watches",
    [
        (True, True, False, True),
        (False, True, False, False),  # the first ps alone decides checkpoints
        (True, False, False, False),  # no periodic checkpoints
        (True, True, True, False),  # every worker signed off: the final checkpoint follows
    ],
)
def test_only_the_first_ps_watches_the_chiefs_clock_for_checkpoints_while_workers_train(
    first, periodic, drained, watches
):
    assert watches_checkpoints(first, periodic, drained) is watches


@pytest.mark.parametrize("start, chief_clock, step", [(0, 0, 0), (0, 7, 7), (40, 3, 43), (40, NEVER, None)])
def test_the_runs_step_is_the_chiefs_clock_after_the_start_and_none_once_it_signed_off(
    start, chief_clock, step
):
    assert Serving(start).run_step(chief_clock) == step


@pytest.mark.parametrize(
    "takes, steps",
    [
        ([], [40]),  # before anything arrived: the start step
        ([(2, 85)], [42]),  # two gradients of steps 42 and 43: 42.5 rounds to 42 (to even)
        ([(3, 132), (0, 0)], [44, 44]),  # a count of 0 keeps the last
        ([(1, 45), (4, 190)], [45, 48]),  # 47.5 rounds to 48
    ],
)
def test_the_learning_rate_is_the_mean_step_of_the_gradients_taken(takes, steps):
    serving = Serving(40)
    seen = [serving.learning_step] if not takes else []
    for arrivals, step_sum in takes:
        serving.took(arrivals, step_sum)
        seen.append(serving.learning_step)
    assert seen == steps
    assert mean_step(0, 0, 7.5) == 7.5 and mean_step(4, 10, 7.5) == 2.5


@pytest.mark.parametrize(
    "values, carries",
    [
        (np.zeros(1000), False),  # a count that outlived its data: never step on zeros
        (np.r_[np.zeros(999), 1e-30], True),  # past the prefix checked first
        (np.r_[1.0, np.zeros(999)], True),
        (np.r_[np.zeros(10), np.nan], True),  # taken; then skipped as NaN
    ],
)
def test_a_ps_steps_only_on_a_gradient_that_carries_something(values, carries):
    assert carries_gradient(values) is carries


def test_a_ps_skips_nan_gradients_until_its_patience_runs_out():
    guard = SkipCounter(patience=1)
    table = [
        (np.ones(4), True),
        (np.r_[1.0, math.nan, 0, 0], False),
        (np.ones(4), True),
        (np.r_[math.inf, 0, 0, 0], False),
    ]
    for gradient, applied in table:
        assert carries_gradient(gradient) and guard.update_allowed(finite(gradient), "x were") is applied
    assert guard.total == 2
    with pytest.raises(RunError, match=r"NaN or Inf 2 time\(s\) in a row \(--nan-patience 1\)"):
        guard.update_allowed(finite(np.r_[math.nan, 0.0]), "x were")


ROLES = [PS, WORKER, WORKER, WORKER, PS]  # the chief is rank 1


@pytest.mark.parametrize(
    "lost, expected",
    [
        ([], Lost((), ())),
        ([2], Lost((), ((2, 1),))),  # worker 1 (rank 2): its clock is retired
        ([2, 3], Lost((), ((2, 1), (3, 2)))),
        ([0], Lost((0,), ())),  # a ps: its shard is held nowhere else
        ([1], Lost((1,), ())),  # the chief
        ([3, 4], Lost((4,), ((3, 2),))),  # a ps among them: the job ends
    ],
)
def test_a_lost_worker_is_retired_and_a_lost_ps_or_chief_ends_the_job(lost, expected):
    assert sort_lost(lost, ROLES, chief_rank=1) == expected


@pytest.mark.parametrize(
    "lost, earlier, rollback, recover",
    [
        ([0], [], True, True),  # a ps, the other left, checkpoints: every rank recovers (rolls back)
        ([4], [2], True, True),  # (a worker lost before changes nothing)
        ([0], [], False, False),  # no checkpoints to go back to: the job ends
        ([0, 4], [], True, False),  # no ps left
        ([4], [0], True, False),  # the other ps was lost before
        ([0, 1], [], True, True),  # the chief too: a survivor takes its place
        ([1], [], True, True),  # the chief alone (its position is the run's: back to a checkpoint too)
        ([1], [], False, False),  # ... where there are checkpoints
        ([2], [], True, False),  # a worker: retired, nobody recovers
    ],
)
def test_a_lost_ps_makes_every_rank_recover_where_another_ps_is_left_and_there_are_checkpoints(
    lost, earlier, rollback, recover
):
    verdict = sort_lost(lost, ROLES, chief_rank=1, earlier=earlier, rollback=rollback)
    assert verdict.recover is recover
    # (what the ending message names)
    assert verdict.fatal == tuple(rank for rank in lost if rank in (0, 1, 4))
