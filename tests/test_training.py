"""The training loop in-process, driven by a fake strategy registered for the test: no MPI traffic to mock.

The fake strategy returns closed-form losses and records every call the loop
makes, so these tests pin down the loop's own bookkeeping: the steps and
epochs it walks, the weights it passes, the metrics it writes, checkpoints,
skipped steps, stop requests and resuming.
"""

import io
import json

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist.parallel import Strategy
from mpidist.parallel.registry import STRATEGIES, register

from conftest import checkpoint_steps


class FakeStrategy(Strategy):
    """Loss ``step + 1`` at each step; optional NaN steps and a stop request; records every call."""

    name = "fake"
    nan_steps = ()
    stop_after = None
    calls = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = self.optimizers.make(self.model.num_params)
        self.stop_requested = False

    def initialize(self, checkpoint=None):
        if checkpoint is None:
            self.model.init_params(self.passes.seed)
        else:
            self.model.params[...] = checkpoint.params
        type(self).calls.append(("initialize", None if checkpoint is None else checkpoint.step))

    def train_step(self, x, y, weight, step):
        type(self).calls.append(("step", step, len(x), weight))
        self.model.params[0] = step + 1  # a trace of the step in the model
        self.skipped = step in self.nan_steps
        self.stop_requested = self.stop_after is not None and step >= self.stop_after
        return float("nan") if self.skipped else float(step + 1)

    def evaluate(self, batches):
        count = sum(len(x) for x, _ in batches)
        type(self).calls.append(("evaluate", count))
        return {"loss": 0.5, "accuracy": 0.75, "samples": count}


@pytest.fixture
def fake():
    FakeStrategy.calls, FakeStrategy.nan_steps, FakeStrategy.stop_after = [], (), None
    register(FakeStrategy)
    yield FakeStrategy
    del STRATEGIES["fake"]


def run(tmp_path, **settings):
    metrics = tmp_path / "metrics.jsonl"
    result = mpidist.train(
        "mlp",
        "digits",
        strategy="fake",
        comm=MPI.COMM_SELF,
        progress="none",
        metrics=str(metrics),
        stream=io.StringIO(),
        **settings,
    )
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    return result, events


def test_the_loop_walks_every_step_of_every_epoch_with_the_whole_batch(fake, tmp_path):
    result, events = run(tmp_path, epochs=2, batch_size=100, log_every=7)
    steps = [call for call in fake.calls if call[0] == "step"]
    assert [call[1] for call in steps] == list(range(28))  # 1438 // 100 = 14 steps per epoch
    assert {call[2] for call in steps} == {100} and {call[3] for call in steps} == {1.0}
    assert [call for call in fake.calls if call[0] == "evaluate"] == [("evaluate", 359)] * 2
    logged = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in logged] == [7, 14, 21, 28]
    assert [e["loss"] for e in logged] == [4.0, 11.0, 18.0, 25.0]  # means of steps 1-7, 8-14, ...
    assert [e["epoch"] for e in logged] == [1, 1, 2, 2]
    assert result.status == "done" and result.figures["steps"] == 28
    assert result.figures["test_accuracy"] == 0.75
    assert result.params[0] == 28.0


def test_checkpoints_resume_at_the_next_step_of_the_same_epoch(fake, tmp_path):
    ck = tmp_path / "ck"
    run(
        tmp_path,
        epochs=2,
        batch_size=100,
        steps=10,
        checkpoint_dir=str(ck),
        checkpoint_every=4,
        checkpoint_wait=True,
    )
    assert checkpoint_steps(ck) == [4, 8, 10]
    fake.calls.clear()
    result, _ = run(tmp_path, epochs=2, batch_size=100, checkpoint_dir=str(ck), resume="auto")
    assert fake.calls[0] == ("initialize", 10)
    assert [call[1] for call in fake.calls if call[0] == "step"] == list(range(10, 28))
    assert result.figures["steps"] == 28


def test_skipped_steps_are_counted_and_past_the_patience_the_run_fails(fake, tmp_path):
    fake.nan_steps = (3, 4)
    result, events = run(tmp_path, epochs=1, batch_size=100, log_every=5)
    assert [e["step"] for e in events if e["event"] == "skipped"] == [4, 5]
    assert next(e for e in events if e["event"] == "step")["loss"] == pytest.approx((1 + 2 + 3) / 3)
    assert result.status == "done"
    fake.nan_steps = tuple(range(2, 14))
    result, events = run(tmp_path, epochs=1, batch_size=100, nan_patience=3)
    assert result.status == "failed" and result.exit_code == 1
    assert events[-1]["event"] == "failed" and events[-1]["step"] == 6  # the 4th skipped step in a row


def test_a_stop_request_from_the_strategy_ends_the_loop_at_that_step(fake, tmp_path):
    fake.stop_after = 5  # as a strategy not in lockstep reports a stop another rank asked for
    FakeStrategy.lockstep = False
    try:
        result, events = run(tmp_path, epochs=3, batch_size=100)
    finally:
        FakeStrategy.lockstep = True
    assert [call[1] for call in fake.calls if call[0] == "step"] == list(range(6))
    assert result.figures["steps"] == 6


def test_a_strategy_registered_from_outside_gets_its_name_in_the_settings_and_the_role_table(fake, tmp_path):
    assert "fake" in STRATEGIES
    result, events = run(tmp_path, epochs=1, batch_size=700)
    assert events[0]["config"]["strategy"] == "fake"
    assert result.figures["strategy"] == "fake"
    with pytest.raises(SystemExit):
        mpidist.train(
            "mlp",
            "digits",
            strategy="fake",
            comm=MPI.COMM_SELF,
            sync_every=2,
            progress="none",
            metrics="",
            stream=io.StringIO(),
        )


def test_local_sgd_averaging_every_step_with_plain_sgd_is_allreduce(tmp_path):
    """Here on one rank (an average of one); tests/test_api.py runs it on real ranks."""
    common = dict(
        epochs=1,
        optimizer="sgd",
        momentum=0.0,
        lr=0.05,
        dtype="float64",
        progress="none",
        metrics="",
        stream=io.StringIO(),
        comm=MPI.COMM_SELF,
    )
    a = mpidist.train("mlp", "digits", strategy="local-sgd", sync_every=1, **common)
    b = mpidist.train("mlp", "digits", strategy="local", **common)
    assert np.abs(a.params - b.params).max() < 1e-12
