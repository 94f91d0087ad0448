"""Pipeline parallelism: a pipeline step equals a local step on the same batch."""

import numpy as np
import pytest
from host_ipc import HostMemory, leftovers
from mpi4py import MPI
from small_net import small_convnet, worker_slice

from mpidist import nn
from mpidist.parallel import LocalStrategy, PipelineStrategy
from mpidist.parallel.pipeline import stage
from mpidist.parallel.pipeline.balance import balance_by_parameters, layer_costs
from mpidist.parallel.pipeline.schedule_runner import split_sizes
from mpidist.runtime.cluster import build_cluster
from mpidist.store.checkpoint import Checkpoint


def test_balance_minimises_the_largest_stage():
    costs = [0, 8320, 0, 16512, 0, 1290]
    sizes = balance_by_parameters(costs, 2)  # [2, 4] and [3, 3] tie at 16512 + 1290
    assert max(sum(costs[: sizes[0]]), sum(costs[sizes[0] :])) == 16512 + 1290
    assert balance_by_parameters([5, 5, 5, 5], 4) == [1, 1, 1, 1]
    assert balance_by_parameters([1, 1, 1, 10], 2) == [3, 1]
    sizes = balance_by_parameters(layer_costs(small_convnet(np.float32)), 3)
    assert sum(sizes) == 7 and min(sizes) >= 1
    with pytest.raises(ValueError, match="at least 5 layers"):
        balance_by_parameters([1, 1, 1], 5)


def test_micro_batches_split_the_batch_evenly():
    assert split_sizes(10, 4) == [3, 3, 2, 2] and split_sizes(8, 8) == [1] * 8


def run_pipeline(
    stages,
    micro_batches,
    schedule_name,
    optimizer="sgd",
    steps=3,
    balance=None,
    elastic=False,
    snapshots=None,
):
    """``(cluster, strategy, reference)`` after ``steps`` steps of a pipeline and of a local reference on the
    same global batches; ``snapshots``: a list the reference's (params, optimizer m) after each step go to."""
    world = MPI.COMM_WORLD
    cluster = build_cluster(world)
    replicas = world.Get_size() // stages
    global_batch = micro_batches * replicas + 1  # uneven on purpose
    rng = np.random.default_rng(0)
    xs = rng.random((steps, global_batch, 1, 6, 6))
    ys = rng.integers(0, 4, (steps, global_batch))
    make = lambda size: nn.make_optimizer(optimizer, size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    reference = LocalStrategy(small_convnet(np.float64), nn.loss_for(4, np), make, seed=3)
    reference.initialize()
    strategy = PipelineStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make,
        cluster,
        seed=3,
        stages=stages,
        micro_batches=micro_batches,
        schedule_name=schedule_name,
        balance=balance,
        global_batch=global_batch,
        elastic=elastic,
    )
    strategy.initialize()
    part = worker_slice(global_batch, replicas, strategy.replica)
    for step in range(steps):
        loss = strategy.train_step(
            xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step
        )
        expected = reference.train_step(xs[step], ys[step], 1.0, step)
        # (every rank learns the global loss: any may become chief)
        assert np.isclose(loss, expected, rtol=1e-9)
        if snapshots is not None:
            snapshots.append((reference.model.params.copy(), reference.optimizer.state_arrays()["m"].copy()))
    return cluster, strategy, reference


def bare_pipeline():
    """``(cluster, strategy)``: a 2-stage pipeline of the world's ranks, with no optimizer and no step
    taken."""
    fits(2)
    cluster = build_cluster(MPI.COMM_WORLD)
    return cluster, PipelineStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        None,
        cluster,
        seed=3,
        stages=2,
        micro_batches=2,
        schedule_name="1f1b",
        global_batch=4,
    )


def fits(stages):
    size = MPI.COMM_WORLD.Get_size()
    if size % stages:
        pytest.skip(f"{stages} stages do not divide {size} ranks")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 3), (2, 8), (4, 4), (4, 9)])
def test_a_pipeline_step_equals_a_local_step(schedule_name, stages, micro_batches):
    fits(stages)
    cluster, strategy, reference = run_pipeline(stages, micro_batches, schedule_name, optimizer="adam")
    np.testing.assert_allclose(
        strategy.model.params,
        reference.model.params[strategy.param_lo : strategy.param_hi],
        rtol=1e-9,
        atol=1e-12,
    )
    assert not np.allclose(reference.model.params, small_convnet(np.float64).params)
    peak = strategy.stats()["peak_activations"]
    assert peak <= (
        micro_batches if schedule_name == "gpipe" else min(stages - strategy.stage, micro_batches)
    )
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_hybrid_replicas_of_a_pipeline_equal_local_training_on_the_global_batch(schedule_name):
    fits(2)
    cluster, strategy, reference = run_pipeline(2, 4, schedule_name)
    assert strategy.replicas == MPI.COMM_WORLD.Get_size() // 2 >= 2
    np.testing.assert_allclose(
        strategy.model.params,
        reference.model.params[strategy.param_lo : strategy.param_hi],
        rtol=1e-9,
        atol=1e-12,
    )
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_an_explicit_balance_places_the_layers_and_checkpoints_stay_whole():
    fits(2)
    cluster, strategy, reference = run_pipeline(2, 2, "1f1b", optimizer="adam", balance=[5, 2])
    assert (strategy.first_layer, strategy.end_layer) == ((0, 5) if strategy.stage == 0 else (5, 7))
    state = strategy.state()
    if cluster.is_chief:
        params, arrays, steps = state.params, state.optimizer, state.steps
        np.testing.assert_allclose(params, reference.model.params, rtol=1e-9)
        np.testing.assert_allclose(
            arrays["m"], reference.optimizer.state_arrays()["m"], rtol=1e-9, atol=1e-15
        )
        assert steps == 3
    whole = MPI.COMM_WORLD.bcast(state, root=0)
    resumed = PipelineStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        lambda size: nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64),
        cluster,
        seed=3,
        stages=2,
        micro_batches=2,
        schedule_name="1f1b",
        balance=[5, 2],
        global_batch=5,
    )
    resumed.initialize(
        Checkpoint(
            path=None,
            params=whole.params,
            optimizer_state=whole.optimizer,
            optimizer_steps=whole.steps,
            step=3,
            epoch=0,
            epoch_step=3,
            config={},
        )
    )
    np.testing.assert_array_equal(resumed.model.params, strategy.model.params)
    np.testing.assert_array_equal(
        resumed.optimizer.state_arrays()["v"], strategy.optimizer.state_arrays()["v"]
    )
    resumed.free()
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_pipelined_evaluation_counts_every_test_sample_once():
    fits(2)
    cluster, strategy, reference = run_pipeline(2, 2, "1f1b")
    rng = np.random.default_rng(5)
    x, y = rng.random((30, 1, 6, 6)), rng.integers(0, 4, 30)
    replicas, replica = strategy.replicas, strategy.replica
    figures = strategy.evaluate([(x[replica::replicas], y[replica::replicas])])
    if cluster.is_chief:
        out = reference.model.forward(x)
        assert figures["samples"] == 30 and sum(figures["per_class"]["support"]) == 30
        assert np.isclose(figures["loss"], float(nn.SoftmaxCrossEntropy(np).forward(out, y)), rtol=1e-9)
        assert np.isclose(figures["accuracy"], (out.argmax(axis=1) == y).mean())
        assert np.array_equal(
            np.array(figures["confusion"]),
            np.bincount(y * 4 + out.argmax(axis=1), minlength=16).reshape(4, 4),
        )
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=4)
def test_survivors_of_a_pipeline_agree_on_the_least_step_and_the_stages_ahead_take_it_back():
    """A death may break a step's collective on some ranks only: the last rank plays one that never applied
    step 3, the others take step 3 back, and replica 0's slices gather on the chief as the local model after
    two steps (the survivors here are every rank: what a recovery does after the shrink)."""
    fits(2)
    snapshots = []
    cluster, strategy, _ = run_pipeline(
        2, 2, "1f1b", optimizer="adam", steps=3, elastic=True, snapshots=snapshots
    )
    if cluster.rank == cluster.size - 1:  # (its update of step 3 undone, as if the collective had failed)
        strategy.ledger.previous.restore(strategy.model.params, strategy.optimizer)
        strategy.ledger.applied -= 1
    assert strategy.recovery().survivors_step(cluster, 3) == 2
    state = strategy.recovery().survivor_state(cluster, 2)
    params, m = snapshots[1]
    lo, hi = strategy.param_lo, strategy.param_hi
    np.testing.assert_allclose(strategy.model.params, params[lo:hi], rtol=1e-9, atol=1e-12)
    if cluster.is_chief:
        np.testing.assert_allclose(state.params, params, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(state.optimizer["m"], m, rtol=1e-9, atol=1e-15)
        assert state.steps == 2
    assert not np.allclose(params, snapshots[2][0])  # (step 3 did change the model: the rewind is seen)
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=4)
def test_a_lost_rank_leaves_the_other_stages_of_its_replica_idle():
    cluster, strategy = bare_pipeline()
    assert (
        strategy.recovery().left_idle([3]) == [2]
        and strategy.recovery().left_idle([0]) == [1]
        and strategy.recovery().left_idle([0, 1]) == []
    )
    if cluster.size >= 6:
        assert strategy.recovery().left_idle([1, 4]) == [0, 5]
    # (the mesh's splits: with 2+ replicas of 2 stages, the pipe and the peers, and nothing it did not split)
    owned = strategy.recovery().communicators()
    assert len(owned) == 2 and all(
        any(comm is link for comm in owned) for link in (strategy.links.pipe, strategy.links.peers)
    )
    strategy.free()
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_freeing_twice_frees_the_stage_communicators_once():
    cluster, strategy = bare_pipeline()
    split = strategy.mesh.owned()  # (one replica of 2 stages at 2 ranks: the pipe alone, a split of its own)
    assert len(split) == (1 if cluster.size == 2 else 2)
    strategy.free()
    strategy.free()  # nothing left to free: no error, no second Free
    assert all(comm == MPI.COMM_NULL for comm in split)
    cluster.free()


def test_a_pipeline_refuses_accumulation_slices_smaller_than_its_micro_batches():
    from mpidist.parallel import AllreduceStrategy, PipelineStrategy
    from mpidist.runtime.errors import UsageError
    from mpidist.settings.config import Settings

    settings = Settings(strategy="pipeline", stages=2, micro_batches=4, accumulate=2)
    PipelineStrategy.check_slice(settings, 4)
    with pytest.raises(
        UsageError,
        match="--accumulate 2 leaves slices of 3 sample.s. per replica, fewer than --micro-batches 4",
    ):
        PipelineStrategy.check_slice(settings, 3)
    AllreduceStrategy.check_slice(Settings(strategy="allreduce"), 1)  # only pipelines cut slices further


class RefusingMemory(HostMemory):
    """Memory no other process can map (a GPU the rank next door cannot see)."""

    def open(self, handle):
        raise OSError("cudaErrorInvalidDevice: invalid device ordinal")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule_name, refusing", [("gpipe", False), ("1f1b", False), ("1f1b", True)])
def test_stages_of_one_node_send_by_ipc_links_and_train_as_by_mpi(monkeypatch, schedule_name, refusing):
    """Every stage told it holds device arrays that IPC can map (the host stand-in's), on one node: the
    links carry every activation and gradient, and the pipeline still equals the local step.  Where the
    start-up probe finds the memory cannot be mapped, every stage sends as it would without IPC."""
    fits(2)
    facts = stage._stage_facts
    monkeypatch.setattr(stage, "_stage_facts", lambda pipe, device, ipc, node: facts(pipe, True, True, node))
    memories, kind = [], RefusingMemory if refusing else HostMemory
    monkeypatch.setattr(stage, "_cuda_memory", lambda: memories.append(kind()) or memories[-1])
    cluster, strategy, reference = run_pipeline(2, 3, schedule_name, optimizer="adam")
    np.testing.assert_allclose(
        strategy.model.params,
        reference.model.params[strategy.param_lo : strategy.param_hi],
        rtol=1e-9,
        atol=1e-12,
    )
    pipe = strategy.links.pipe
    node = pipe.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == pipe.Get_size()  # (emulated nodes may put the two stages apart)
    node.Free()
    route = "ipc" if one_node and not refusing else "host-staged"
    assert f"sends {route}" in strategy.describe(cluster.rank)
    assert [route for route, _ in strategy.links.routes.values()] == [route]
    if refusing and one_node:
        (why,) = [why for _, why in strategy.links.routes.values()]
        assert "could not be mapped (OSError: cudaErrorInvalidDevice" in why
    memory = memories[0] if memories else HostMemory()
    # (the probe's granule made and opened once, then the sender's slots, one per micro-batch in flight at
    # most, each opened once by the receiver)
    if one_node and not refusing:
        assert 2 <= memory.made <= 4 and 2 <= memory.opened <= 4
    strategy.free()
    assert memory.made == memory.freed and memory.opened == memory.closed and leftovers() == []
    strategy.free()  # (a second free does nothing)
    cluster.free()


def test_a_send_of_another_shape_than_the_next_stage_takes_is_refused_in_words():
    """A layer at a stage boundary that drops a row or a feature: the receiver's buffer of the expected shape
    took the shorter message, the rest of it stale, and the run trained on (found by a hostile sweep)."""
    from mpidist.parallel.pipeline.schedule_runner import check_boundary
    from mpidist.runtime.errors import RunError

    check_boundary(np.zeros((8, 32)), (8, 32), 0, 1)
    with pytest.raises(
        RunError, match=r"stage 0's layers gave activations of shape \(7, 32\) to send to stage 1"
    ):
        check_boundary(np.zeros((7, 32)), (8, 32), 0, 1)
    with pytest.raises(
        RunError, match=r"stage 2's layers gave input gradients of shape \(8, 20\) .*takes \(8, 32\)"
    ):
        check_boundary(np.zeros((8, 20)), (8, 32), 2, 1)
