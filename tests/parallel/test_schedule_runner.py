"""A pipeline stage's layout and its schedule runner, without MPI: a one-stage pipeline is a local step."""

import numpy as np
import pytest
from small_net import small_convnet

from mpidist import nn
from mpidist.parallel.pipeline.schedule import schedule
from mpidist.parallel.pipeline.schedule_runner import ScheduleRunner
from mpidist.parallel.pipeline.stage import StageLayout


# small_convnet: Conv2D(3,3) ReLU MaxPool2D(2) | Flatten Dense(8) ReLU Dense(4), 30 + 224 + 36 = 290
# parameters
@pytest.mark.parametrize(
    "rank,stage,replica,layers,params,in_shape,out_shape",
    [
        (0, 0, 0, (0, 3), (0, 30), (1, 6, 6), (3, 3, 3)),
        (1, 1, 0, (3, 7), (30, 290), (3, 3, 3), (4,)),
        (2, 0, 1, (0, 3), (0, 30), (1, 6, 6), (3, 3, 3)),
        (3, 1, 1, (3, 7), (30, 290), (3, 3, 3), (4,)),
    ],
)
def test_a_stage_layout_places_each_rank(rank, stage, replica, layers, params, in_shape, out_shape):
    model = small_convnet(np.float64)
    layout = StageLayout(model, [3, 4], rank, world_size=4)
    assert (layout.stages, layout.replicas, layout.stage, layout.replica) == (2, 2, stage, replica)
    assert (layout.first_layer, layout.end_layer) == layers
    assert (layout.param_lo, layout.param_hi) == params and layout.param_offsets == [0, 30, 290]
    assert (layout.in_shape, layout.out_shape) == (in_shape, out_shape)
    assert (layout.is_first, layout.is_last) == (stage == 0, stage == 1)
    assert layout.stage_model(model).num_params == params[1] - params[0]


class NoLinks:
    """The links of a pipeline of one stage: nothing is sent or received; what is tracked and waited for is
    kept."""

    def __init__(self):
        self.phases, self.waited = [], []

    def track(self, phase):
        self.phases.append(phase)

    def wait(self, requests):
        self.waited.append(list(requests))


def one_stage(schedule_name, micro_batches, global_batch):
    model = small_convnet(np.float64)
    model.init_params(3)
    layout = StageLayout(model, [len(model.layers)], rank=0, world_size=1)
    params = model.params.copy()
    stage_model = layout.stage_model(model)
    stage_model.params[...] = params
    loss = nn.loss_for(4, np)
    stage_model.use_workspace(loss)
    counted, figures, links = [], {"peak_activations": 0}, NoLinks()
    runner = ScheduleRunner(
        stage_model,
        loss,
        layout,
        links,
        schedule(schedule_name, 0, 1, micro_batches),
        micro_batches,
        global_batch,
        3,
        figures,
        lambda out, y: counted.append(len(out)),
    )
    return stage_model, runner, links, figures, counted


@pytest.mark.parametrize("schedule_name,peak", [("gpipe", 5), ("1f1b", 1)])
def test_a_one_stage_runner_adds_the_batch_mean_gradient_and_holds_what_its_schedule_says(
    schedule_name, peak
):
    rng = np.random.default_rng(0)
    x, y = rng.random((11, 1, 6, 6)), rng.integers(0, 4, 11)
    stage_model, runner, links, figures, counted = one_stage(schedule_name, 5, 11)
    gradients = np.zeros(stage_model.num_params)
    loss = runner.run(x, y, 0, 0, gradients)
    local, local_loss = small_convnet(np.float64), nn.loss_for(4, np)  # (the stage model took model's layers)
    local.params[...] = stage_model.params
    expected = float(local_loss.forward(local.forward(x, training=True), y))
    local.backward(local_loss.backward(scale=1.0), input_grad=False)
    assert np.isclose(loss, expected, rtol=1e-12)
    np.testing.assert_allclose(gradients, local.grads, rtol=1e-9, atol=1e-12)
    assert counted == [3, 2, 2, 2, 2]  # 11 samples in 5 micro-batches
    assert figures["peak_activations"] == peak  # gpipe holds all 5, 1f1b one at a time
    assert runner.slots.size == peak  # a slot per micro-batch held, reused after
    assert links.waited == [[]] and links.phases == ["compute"] and runner.round is None
    runner.run(x, y, 1, 0, gradients)  # a second step reuses the same slots
    assert runner.slots.size == peak and figures["peak_activations"] == peak


def test_a_schedule_operation_without_a_method_is_refused_by_name():
    stage_model, runner, links, figures, _ = one_stage("gpipe", 2, 4)
    with pytest.raises(ValueError, match=r"\['jump'\] have no method"):
        ScheduleRunner(
            stage_model, runner.loss, runner.layout, links, [("fwd", 0), ("jump", 0)], 1, 4, 3, figures, None
        )
