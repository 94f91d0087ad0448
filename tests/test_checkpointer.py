"""When a checkpoint is due: the one rule for the loop and the ps that decides for async workers."""

from mpidist.loop.checkpointer import CheckpointSchedule


def test_every_k_steps_a_checkpoint_is_due_at_each_multiple_passed_once():
    schedule = CheckpointSchedule(every=5, seconds=0, step=0, now=0.0)
    assert [step for step in range(1, 16) if schedule.crossed(step)] == [5, 10, 15]
    jumps = CheckpointSchedule(every=5, seconds=0, step=3, now=0.0)   # a ps sees the chief's step jump
    assert [jumps.crossed(step) for step in (4, 11, 12, 16, 16)] == [False, True, False, True, False]


def test_timed_checkpoints_restart_the_wait_when_due():
    schedule = CheckpointSchedule(every=0, seconds=10, step=0, now=100.0)
    assert [schedule.timed(now) for now in (105, 110, 115, 119.9, 120)] == [False, True, False, False, True]
    assert not CheckpointSchedule(every=0, seconds=0, step=0, now=0.0).periodic


def test_a_step_checkpoint_also_restarts_the_timed_wait():
    schedule = CheckpointSchedule(every=4, seconds=10, step=0, now=0.0)
    assert schedule.due(4, now=8.0)          # by step
    assert not schedule.due(5, now=15.0)     # 7 s after it, not 10
    assert schedule.due(6, now=18.5)         # by time
