"""When a checkpoint is due: the one rule for the loop and the ps that decides for async workers."""

import numpy as np
import pytest

from mpidist.loop.checkpoint_timing import CheckpointSchedule
from mpidist.loop.checkpointer import Checkpointer
from mpidist.parallel.saved_state import WholeState
from mpidist.runtime.errors import RunError
from mpidist.settings.config import Settings
from mpidist.store import checkpoint


def test_every_k_steps_a_checkpoint_is_due_at_each_multiple_passed_once():
    schedule = CheckpointSchedule(every=5, seconds=0, step=0, now=0.0)
    assert [step for step in range(1, 16) if schedule.crossed(step)] == [5, 10, 15]
    jumps = CheckpointSchedule(every=5, seconds=0, step=3, now=0.0)  # a ps sees the chief's step jump
    assert [jumps.crossed(step) for step in (4, 11, 12, 16, 16)] == [False, True, False, True, False]


def test_timed_checkpoints_restart_the_wait_when_due():
    schedule = CheckpointSchedule(every=0, seconds=10, step=0, now=100.0)
    assert [schedule.timed(now) for now in (105, 110, 115, 119.9, 120)] == [False, True, False, False, True]
    assert not CheckpointSchedule(every=0, seconds=0, step=0, now=0.0).periodic


def test_a_step_checkpoint_also_restarts_the_timed_wait():
    schedule = CheckpointSchedule(every=4, seconds=10, step=0, now=0.0)
    assert schedule.due(4, now=8.0)  # by step
    assert not schedule.due(5, now=15.0)  # 7 s after it, not 10
    assert schedule.due(6, now=18.5)  # by time


# -- writing behind training ------------------------------------------------------------------------------
def checkpointer(directory, every=1):
    config = Settings(checkpoint_dir=str(directory), checkpoint_every=every, keep=0)
    return Checkpointer(config, 0, lineage="0123abcd")


def state(value, size=1000):
    params = np.full(size, value, dtype=np.float32)
    return WholeState(params, {"m": params * 2, "v": params * 3}, 7)


def test_a_checkpoint_due_while_the_writer_is_busy_waits_for_it_and_several_become_one(tmp_path):
    writer = checkpointer(tmp_path)
    # every step due to step 7; the writer (as agreed, a step late) busy at 3-5
    taken = []
    for step, due, busy in [
        (1, True, False),
        (2, True, False),
        (3, True, True),
        (4, True, True),
        (5, True, True),
        (6, True, False),
        (7, True, False),
        (8, False, False),
        (9, False, False),
    ]:
        if writer.starts_at(step, due=due, busy=busy):
            writer.taken(step)
            taken.append(step)
    # not 2 nor 7: their flags were posted before the write of the step before started; 6 takes what 2 to 5
    # owed, 8 what 7 owed; 9 owes nothing
    assert taken == [1, 6, 8]


def test_survivors_rolled_back_to_a_checkpoint_decide_alike_whatever_each_owed_at_the_loss(tmp_path):
    """A loss finds the ranks at different points of a boundary: one past its agreement owes the checkpoint
    its writer deferred, one that failed in it owes none.  Rolled back to step 120, both decide the same from
    there: nothing at 121-129 (the deferred one was a checkpoint of steps now undone), the crossing at 130."""
    ahead, behind = checkpointer(tmp_path / "a", every=10), checkpointer(tmp_path / "b", every=10)
    for step in range(121, 131):
        ahead.schedule.crossed(step), behind.schedule.crossed(step)
    assert not ahead.starts_at(130, due=True, busy=True)  # (deferred: its writer was busy)
    assert ahead.behind.owed and not behind.behind.owed
    for writer in (ahead, behind):
        writer.rolled_back(120)
    taken = {"ahead": [], "behind": []}
    for name, writer in (("ahead", ahead), ("behind", behind)):
        for step in range(121, 136):
            if writer.starts_at(step, writer.schedule.crossed(step), busy=False):
                writer.taken(step)
                taken[name].append(step)
    assert taken["ahead"] == taken["behind"] == [130]


def test_after_a_write_the_writer_rests_so_that_writing_takes_a_bounded_share_of_the_time(tmp_path):
    from mpidist.loop.writer import WRITER_SHARE, BehindWrite

    # the copy's CPU: a second, whose rest (40 s at 2.5%) outlasts any pause of a busy machine before a look
    write = BehindWrite(lambda: "path", (5, 0), spent=1.0)
    assert write.result() == "path"
    assert write.spent >= 1.0
    assert write.free_at() == pytest.approx(write.began + write.spent / WRITER_SHARE)
    writer = checkpointer(tmp_path)
    writer.behind.last = write
    assert writer.busy  # resting
    write.spent = 0.0
    assert not writer.busy


def test_a_write_behind_holds_the_state_as_it_was_and_reports_once_done(tmp_path):
    writer = checkpointer(tmp_path)
    whole = state(1.0)
    params, optimizer = whole.params, whole.optimizer
    assert writer.write_behind(whole, 5, 0, 5, 2) == []
    params[:] = 99.0  # training goes on: the checkpoint holds the state as it was copied
    optimizer["m"][:] = 99.0
    kept = writer.behind.staging.arrays["params"]
    done = writer.collect(wait=True)
    assert [(path.name, step, epoch) for path, step, epoch in done] == [("ckpt-00000005-0123abcd.h5", 5, 0)]
    loaded = checkpoint.load(done[0][0])
    assert (loaded.params == 1.0).all() and (loaded.optimizer_state["m"] == 2.0).all() and loaded.step == 5
    assert writer.collect(wait=True) == [] and writer.last == done[0][0] and writer.behind.flight is None
    # the next write behind copies into the same arrays, and the one in flight is waited for first
    writer.write_behind(state(2.0), 6, 0, 6, 2)
    assert writer.behind.staging.arrays["params"] is kept
    assert [step for _, step, _ in writer.write_behind(state(3.0), 7, 0, 7, 2)] == [6]
    writer.collect(wait=True)
    assert [checkpoint.load(path).params[0] for path in writer.kept()] == [1.0, 2.0, 3.0]


def test_a_write_behind_that_fails_raises_in_the_training_thread(tmp_path):
    writer = checkpointer(tmp_path / "ck")
    (tmp_path / "ck").write_text("a file where the directory should be")
    writer.write_behind(state(1.0), 5, 0, 5, 2)
    with pytest.raises(RunError, match="checkpoint of step 5 not written"):
        writer.collect(wait=True)
    assert writer.last is None


@pytest.mark.parametrize("wait", [False, True])
def test_a_run_checkpointing_every_step_writes_behind_and_ends_with_its_last_step_whole(tmp_path, wait):
    from conftest import events, run_mpi

    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    done, _ = run_mpi(
        2,
        [
            "-m",
            "mpidist",
            "--model",
            "mlp-wide",
            "--data",
            "mnist-5k",
            "--steps",
            "12",
            "--checkpoint-every",
            "1",
            "--keep",
            "0",
            "--checkpoint-dir",
            str(ck),
            "--run-dir",
            "",
            "--metrics",
            str(metrics),
            "--log-every",
            "1",
            *(["--checkpoint-wait"] if wait else []),
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written = [event["step"] for event in events(metrics, "checkpoint")]
    if wait:  # every step's, in order, once: a write behind in flight is waited for
        assert written == list(range(1, 13))
    else:  # in order, once each; those due while one was written became one; the end's always
        assert written == sorted(set(written)) and written[0] == 1 and written[-1] == 12
    assert sorted(checkpoint.load(path).step for path in ck.glob("ckpt-*.h5")) == written
    # an event comes once its file is whole: after the step events of the steps it is behind
    order = [
        (event["event"], event["step"])
        for event in events(metrics)
        if event["event"] in ("step", "checkpoint")
    ]
    for index, (kind, step) in enumerate(order):
        if kind == "checkpoint":
            assert ("step", step) in order[:index]


class PartsUnderWay:
    """A sharded checkpoint begun at ``step`` (stands in for ShardedWrite): completing it gives its index."""

    def __init__(self, step, path):
        self.where, self.path, self.writing, self.completed = (step, 0), path, False, 0

    def complete(self):
        self.completed += 1
        return self.path


def test_a_sharded_checkpoint_behind_training_completes_at_the_first_boundary_whose_flags_postdate_it(
    tmp_path,
):
    writer = checkpointer(tmp_path)
    parts = writer.behind.parts = PartsUnderWay(5, tmp_path / "ckpt-5.h5")
    idle, syncing = {"writing": 0}, {"writing": 1}
    assert writer.at_boundary(6, idle) == [] and not parts.completed  # (flags posted before the write began)
    assert writer.at_boundary(7, syncing) == [] and not parts.completed  # (a rank still syncing its part)
    assert writer.at_boundary(8, idle) == [(tmp_path / "ckpt-5.h5", 5, 0)] and parts.completed == 1
    assert writer.behind.parts is None and writer.last == tmp_path / "ckpt-5.h5"
    # the index is written at 8: no checkpoint starts there, nor at 9 (whose flags predate the index's write)
    assert not writer.starts_at(8, due=True, busy=False) and not writer.starts_at(9, due=True, busy=False)
    assert writer.starts_at(10, due=True, busy=False)
    assert writer.at_boundary(11, idle) == [] and parts.completed == 1
