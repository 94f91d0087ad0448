"""The training loop's parts, each on its own, in one process: position, step window, evaluations, stops,
outputs, report, and the elastic state's restore and sync."""

import io
import json
import math
import sys
import types

import numpy as np
import pytest

from mpidist.loop.callbacks import EarlyStopping, Reporter
from mpidist.loop.elastic import State
from mpidist.loop.evaluations import Evaluations
from mpidist.parallel.saved_state import WholeState
from mpidist.loop.outputs import Outputs, trace_file
from mpidist.loop.position import Position
from mpidist.loop.report import Report
from mpidist.loop.stops import Stops
from mpidist.loop.window import StepWindow
from mpidist.runtime.preempt import EARLY_STOP, WRITE_FAILED
from mpidist.settings.config import Settings


def test_a_position_starts_at_a_checkpoints_and_rolls_a_full_epoch_over():
    assert Position.of(None, 10) == Position(0, 0, 0)
    resume = types.SimpleNamespace(step=25, epoch=2, epoch_step=5)
    assert Position.of(resume, 10) == Position(25, 2, 5)
    assert Position.of(types.SimpleNamespace(step=30, epoch=2, epoch_step=10), 10) == Position(30, 3, 0)
    shared = Position(1, 1, 1)
    holder = [shared]
    shared.move_to(Position(7, 0, 7))
    assert holder[0] == Position(7, 0, 7) and list(shared.as_array()) == [7, 0, 7]


@pytest.mark.parametrize(
    "position, steps, expected",
    [
        (Position(25, 2, 5), -1, Position(24, 2, 4)),
        (Position(25, 2, 5), 1, Position(26, 2, 6)),
        (Position(25, 2, 5), 0, Position(25, 2, 5)),
        (Position(30, 3, 0), -1, Position(29, 2, 9)),  # back over the start of an epoch: its last step
        (Position(30, 2, 10), 1, Position(31, 3, 1)),  # on from a finished epoch: the next one's first step
        (Position(29, 2, 9), 1, Position(30, 2, 10)),  # (the epoch's last step: Position.of rolls it over)
    ],
)
def test_a_position_moves_one_step_either_way_across_epochs(position, steps, expected):
    assert position.shifted(steps, 10) == expected


def test_a_position_moves_one_step_at_most():
    with pytest.raises(ValueError, match="one step at most, not 2"):
        Position(5, 0, 5).shifted(2, 10)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_step_window_averages_finite_losses_and_counts_rates_clips_and_skips():
    clock = Clock()
    window = StepWindow(nan_patience=2, clock=clock)
    assert not window.account(1.0, skipped=False, clipped=True)
    assert not window.account(math.nan, skipped=True)
    assert not window.account(3.0, skipped=False)
    clock.now = 102.0
    mean, rate, clipped, now = window.line(batch_size=8)
    assert (mean, rate, clipped, now) == (2.0, 3 * 8 / 2.0, 1, 102.0)
    assert window.trained == 3 and window.clipped_total == 1 and window.last_loss == 2.0
    assert window.steps == window.good == window.clipped == 0 and window.loss == 0.0  # a new window
    assert window.elapsed() == 2.0


def test_the_step_window_says_the_run_diverged_one_skip_past_the_patience():
    window = StepWindow(nan_patience=2, clock=Clock())
    assert [window.account(math.nan, skipped=True) for _ in range(3)] == [False, False, True]
    assert "NaN or Inf 3 step(s) in a row (--nan-patience 2), the last at step 9" in window.diverged(9)
    assert not window.account(0.5, skipped=False) and window.skipped_in_row == 0


def test_an_epochs_last_finite_losses_become_the_loss_reported_and_a_window_of_skips_keeps_the_old():
    window = StepWindow(nan_patience=5, clock=Clock())
    window.account(4.0, skipped=False)
    window.account(2.0, skipped=False)
    window.end_epoch()
    assert window.last_loss == 3.0
    window.line(1)
    window.account(math.nan, skipped=True)
    window.end_epoch()
    assert window.last_loss == 3.0
    assert math.isnan(window.line(1)[0])  # a line of skipped steps only has no loss


def test_evaluations_know_what_the_end_of_a_run_still_evaluates():
    with_val = Evaluations({"train": 10, "test": 5, "val": 2})
    assert with_val.monitored == "val" and with_val.missing_at(4) == ["val", "test"]
    with_val.record("val", {"loss": 1.0}, 4)
    assert with_val.missing_at(4) == ["test"] and with_val.val == {"loss": 1.0}
    with_val.record("test", {"loss": 2.0}, 4)
    assert with_val.missing_at(4) == [] and with_val.missing_at(5) == ["val", "test"]
    test_only = Evaluations({"train": 10, "test": 5})
    assert test_only.monitored == "test" and test_only.missing_at(0) == ["test"] and test_only.test is None


def test_a_resumed_run_judges_early_stopping_against_the_best_its_checkpoint_stored():
    stopping = EarlyStopping(3, monitor="val_loss")
    evaluations = Evaluations(
        {"val": 1}, "val_loss", {"figure": "val_loss", "value": 0.25, "step": 40}, stopping
    )
    assert stopping.best == 0.25 and evaluations.best.record() == {
        "figure": "val_loss",
        "value": 0.25,
        "step": 40,
    }
    assert not evaluations.best.offer(0.3, 50) and evaluations.best.offer(0.2, 60)
    other = Evaluations({"val": 1}, "val_accuracy", {"figure": "val_loss", "value": 0.25, "step": 40})
    assert other.best.record() is None  # the checkpoint's best was of another figure


class Log:
    def __init__(self, failure=None, stop_asked=False):
        self.failure, self.stop_asked, self.events, self.closed = failure, stop_asked, [], False

    def write(self, event, **figures):
        self.events.append((event, figures))

    def close(self):
        self.closed = True


def test_a_failed_write_outranks_a_signal_which_outranks_a_callbacks_stop():
    signals = types.SimpleNamespace(received=0)
    stops = Stops(signals)
    assert stops.request(Log()) == 0
    assert stops.request(Log(stop_asked=True)) == EARLY_STOP
    signals.received = 15
    assert stops.request(Log(stop_asked=True)) == 15
    assert stops.request(Log(failure="disk full")) == WRITE_FAILED
    stops.free()  # no agreement yet: nothing to free


def test_outputs_open_a_run_directory_claim_it_and_close_once(tmp_path):
    config = Settings(
        run_dir=str(tmp_path / "run"),
        metrics=str(tmp_path / "run" / "metrics.jsonl"),
        checkpoint_dir=str(tmp_path / "run" / "checkpoints"),
    )
    (tmp_path / "run").mkdir()
    terminal = io.StringIO()
    outputs = Outputs(terminal, chief=True)
    outputs.open(config, [], resume=None)
    assert outputs.claim is not None and outputs.claim.lineage
    outputs.say("hello")
    outputs.log.write("start", step=0)
    outputs.close()
    outputs.close()  # idempotent
    assert terminal.getvalue() == "hello\n"
    assert (tmp_path / "run" / "log.txt").read_text() == "hello\n"
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["event"] == "start"
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_outputs_off_the_chief_write_nothing(tmp_path):
    config = Settings(
        run_dir=str(tmp_path), metrics=str(tmp_path / "m.jsonl"), checkpoint_dir=str(tmp_path / "c")
    )
    outputs = Outputs(io.StringIO(), chief=False)
    outputs.open(config, [], resume=None)
    outputs.log.write("start", step=0)
    outputs.close()
    assert outputs.claim is None and not list(tmp_path.iterdir())


def test_a_resumed_runs_timeline_goes_beside_the_earlier_parts(tmp_path):
    config = Settings(run_dir=str(tmp_path))
    assert trace_file(config, None) == tmp_path / "trace.json"
    (tmp_path / "trace.json").write_text("{}")
    assert trace_file(config, types.SimpleNamespace(step=12)) == tmp_path / "trace-from-step-12.json"


def _report(tmp_path, chief=True, last=None, last_step=None):
    outputs = Outputs(io.StringIO(), chief=chief)
    outputs.log = Log()
    checkpointer = types.SimpleNamespace(last=last, last_step=last_step, best=None)
    config = Settings(checkpoint_dir=str(tmp_path / "ckpt"))
    cluster = types.SimpleNamespace(is_chief=chief)
    return Report(config, cluster, None, outputs, checkpointer, Position(12, 1, 2)), outputs


def test_a_stopped_run_says_which_signal_and_how_to_resume(tmp_path):
    report, outputs = _report(tmp_path, last=tmp_path / "ckpt" / "ckpt-12.h5", last_step=12)
    outcome = report.stopped({"signal": 15, "rank": 3})
    assert outcome == {
        "steps": 12,
        "epochs": 2,
        "stopped_by": "SIGTERM",
        "checkpoint": tmp_path / "ckpt" / "ckpt-12.h5",
    }
    event, figures = outputs.log.events[-1]
    assert event == "stopped" and figures["rank"] == 2 and outputs.log.closed
    assert "stopped by SIGTERM (rank 2) at step 12: checkpoint" in outputs.stream.getvalue()
    assert "--resume auto --checkpoint-dir" in outputs.stream.getvalue()


def test_a_failed_run_is_reported_by_the_chief_alone(tmp_path, capsys):
    report, outputs = _report(tmp_path, chief=False)
    assert report.failed("diverged") == {"steps": 12, "failed": "diverged"} and not outputs.log.events
    report, outputs = _report(tmp_path)
    report.failed("diverged")
    assert outputs.log.events == [("failed", {"step": 12, "epoch": 2, "reason": "diverged"})]
    assert "mpidist: error: diverged; checkpoints already written are kept in" in capsys.readouterr().err


class Strategy:
    """A strategy as the elastic state sees it: its hooks, and its optimizer's state names.

    ``behind``: the survivors' agreed step is this many steps before the chief's.
    """

    def __init__(self, held, behind=0):
        self.held, self.asked, self.behind = held, [], behind
        self.optimizer = types.SimpleNamespace(state_arrays=lambda: {"m": None, "v": None})

    def recovery(self):
        return self  # (its own recovery: the hooks below)

    def survivors_step(self, cluster, step):
        return step - self.behind

    def survivor_state(self, cluster, step):
        self.asked.append(step)
        return self.held


def test_the_elastic_state_restores_the_chiefs_position_and_syncs_its_state_as_a_checkpoint():
    from mpi4py import MPI

    config = Settings(seed=7)
    position = Position(30, 2, 4)
    state = State(config, position)
    params = np.arange(5, dtype=np.float32)
    held = WholeState(params, {"m": params * 2, "v": params * 3}, 9)
    strategy = Strategy(held)
    setup = types.SimpleNamespace(
        model=types.SimpleNamespace(num_params=5, dtype=np.float32), steps_per_epoch=10
    )
    cluster = types.SimpleNamespace(chief_rank=0)
    state.bind(cluster, setup, strategy)
    world = MPI.COMM_SELF
    agreed, got = state.restore(world, cluster)
    assert agreed == Position(30, 2, 4) and got is held and strategy.asked == [30]
    # (a pipeline stage never applied the chief's last step)
    state.bind(cluster, setup, Strategy(held, behind=1))
    assert state.restore(world, cluster)[0] == Position(29, 2, 3) and state.strategy.asked == [29]
    checkpoint = state.sync(world, cluster, agreed, got)
    assert (checkpoint.step, checkpoint.epoch, checkpoint.epoch_step, checkpoint.optimizer_steps) == (
        30,
        2,
        4,
        9,
    )
    assert np.array_equal(checkpoint.params, params) and np.array_equal(
        checkpoint.optimizer_state["v"], params * 3
    )
    assert checkpoint.seed == 7 and checkpoint.config["seed"] == 7


def test_the_elastic_state_calls_what_was_registered_in_order():
    state = State(Settings(), Position())
    seen = []
    state.register("recovered", lambda record: seen.append(("first", record)))
    state.register("recovered", lambda record: seen.append(("second", record)))
    state._fire("recovered", {"step": 3})
    assert seen == [("first", {"step": 3}), ("second", {"step": 3})]
    with pytest.raises(KeyError):
        state.register("lost", print)


@pytest.mark.parametrize(
    "spec, worker, expected",
    [
        ("", 0, (0.0, 0)),
        ("*:0.01", None, (0.0, 0)),  # unset; a ps (no worker index) never sleeps
        ("*:0.01", 3, (0.01, sys.maxsize)),
        ("2:0.5", 2, (0.5, sys.maxsize)),
        ("2:0.5", 1, (0.0, 0)),
        ("*:0.01:40", 0, (0.01, 40)),  # up to step 40, then at full speed
    ],
)
def test_the_test_delay_names_a_worker_its_seconds_and_the_last_step_it_slows(
    monkeypatch, spec, worker, expected
):
    # (imported here: a name beginning with test_ would be collected as a test)
    from mpidist.loop import (
        setup,
    )

    monkeypatch.setenv("MPIDIST_TEST_DELAY", spec)
    assert setup.test_delay(worker) == expected


def test_an_early_stopping_given_to_a_second_run_judges_it_afresh():
    """Reused, it stopped the second run at once: its stop, its waits and its best were the first run's
    (found by a hostile sweep)."""
    stopping = EarlyStopping(1, monitor="test_loss")
    Evaluations({"test": 1}, "", None, stopping)
    for step, loss in ((10, 0.5), (20, 0.6)):
        stopping.on_eval({"step": step, "test_loss": loss})
    assert stopping.stop_training and stopping.stopped_at == 20
    reporter = Reporter(Log(), [stopping])
    Evaluations({"test": 1}, "", None, stopping)  # (the second run)
    reporter.write("start", step=0)
    assert not reporter.stop_asked and stopping.best is None and stopping.stopped_at is None
    stopping.on_eval({"step": 10, "test_loss": 0.9})  # (worse than the first run's best: its first here)
    assert not stopping.stop_training and stopping.best == 0.9
