"""ps-sync: sharded parameter servers must train exactly like allreduce / local."""

import numpy as np
import pytest
from mpi4py import MPI
from small_net import small_convnet, worker_slice

from mpidist import nn
from mpidist.parallel import LocalStrategy, PsSyncStrategy
from mpidist.parallel.rewind import PreviousSlice, StepLedger
from mpidist.parallel.shards import imbalance, shard_bounds
from mpidist.runtime.cluster import PS, build_cluster
from mpidist.store.checkpoint import Checkpoint


def test_shards_are_contiguous_balanced_and_cover_everything():
    for count, parts in [(10, 3), (7, 7), (100, 6), (26123, 4)]:
        bounds = shard_bounds(count, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [hi - lo for lo, hi in bounds]
        assert max(sizes) - min(sizes) <= 1
    assert imbalance(shard_bounds(12, 3)) == 0.0
    assert imbalance(shard_bounds(10, 3)) == pytest.approx(4 / (10 / 3) - 1)


def run_ps_sync(num_ps, optimizer, global_extra=0, steps=4, dtype=np.float64):
    world = MPI.COMM_WORLD
    cluster = build_cluster(world, num_ps=num_ps)
    workers = cluster.num_workers
    global_batch = 3 * workers + global_extra
    rng = np.random.default_rng(0)
    xs = rng.random((steps, global_batch, 1, 6, 6)).astype(dtype)
    ys = rng.integers(0, 4, (steps, global_batch))
    make = lambda size: nn.make_optimizer(optimizer, size, 0.05, xp=np, dtype=dtype)  # noqa: E731
    reference = LocalStrategy(small_convnet(dtype), nn.loss_for(4, np), make, seed=3)
    reference.initialize()
    strategy = PsSyncStrategy(small_convnet(dtype), nn.loss_for(4, np), make, cluster, seed=3)
    strategy.initialize()
    if cluster.role == PS:
        x = y = None
        weight = 0.0
    else:
        part = worker_slice(global_batch, workers, cluster.worker_index)
        weight = (part.stop - part.start) / global_batch
    for step in range(steps):
        if cluster.role != PS:
            x, y = xs[step][part], ys[step][part]
        loss = strategy.train_step(x, y, weight, step)
        assert np.isclose(loss, reference.train_step(xs[step], ys[step], 1.0, step), rtol=1e-9)
    return cluster, strategy, reference


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_ps", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_ps_sync_equals_local_training_on_the_global_batch(num_ps, optimizer):
    if MPI.COMM_WORLD.Get_size() < num_ps + 1:
        pytest.skip(f"--ps {num_ps} needs {num_ps + 1} ranks")
    cluster, strategy, reference = run_ps_sync(num_ps, optimizer, global_extra=1)
    # every rank, ps ranks included, ends with the full updated parameters
    np.testing.assert_allclose(strategy.model.params, reference.model.params, rtol=1e-9, atol=1e-12)
    assert not np.allclose(reference.model.params, small_convnet(np.float64).params)
    cluster.free()


@pytest.mark.mpi(min_size=2)
def test_ps_sync_gathers_the_sharded_optimizer_state_for_a_checkpoint_and_reloads_it():
    world = MPI.COMM_WORLD
    num_ps = min(2, world.Get_size() - 1)
    cluster, strategy, reference = run_ps_sync(num_ps, "adam")
    state = strategy.state()
    if cluster.is_chief:
        params, arrays, steps = state.params, state.optimizer, state.steps
        np.testing.assert_allclose(params, reference.model.params, rtol=1e-9)
        for name, array in reference.optimizer.state_arrays().items():
            np.testing.assert_allclose(arrays[name], array, rtol=1e-9, atol=1e-15)
        assert steps == reference.optimizer.steps == 4
    else:
        assert state is None
    # a fresh ps-sync run resumed from the gathered state continues identically
    full = world.bcast(state, root=cluster.chief_rank)
    ckpt = Checkpoint(
        path=None,
        params=full.params,
        optimizer_state=full.optimizer,
        optimizer_steps=full.steps,
        step=4,
        epoch=0,
        epoch_step=4,
        config={},
    )
    make = lambda size: nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    resumed = PsSyncStrategy(small_convnet(np.float64), nn.loss_for(4, np), make, cluster, seed=3)
    resumed.initialize(ckpt)
    if cluster.role == PS:
        np.testing.assert_array_equal(
            resumed.optimizer.state_arrays()["m"], strategy.optimizer.state_arrays()["m"]
        )
        assert resumed.optimizer.steps == 4
    np.testing.assert_array_equal(resumed.model.params, strategy.model.params)
    cluster.free()


@pytest.mark.mpi(min_size=3)
def test_ps_ranks_own_their_shards_and_count_their_traffic():
    world = MPI.COMM_WORLD
    cluster, strategy, _ = run_ps_sync(2, "sgd")
    shards = world.allgather(strategy.shard_of(world.Get_rank()))
    owned = sorted(s for s in shards if s is not None)
    assert owned[0][0] == 0 and owned[-1][1] == strategy.model.num_params + 1
    stats = strategy.stats()
    if cluster.role == PS:
        assert stats["updates"] == 4 and stats["bytes_in"] > 0 and stats["bytes_out"] > 0
    else:
        assert stats == {}
    cluster.free()


@pytest.mark.parametrize(
    "chief_step, params, steps",
    [
        (11, [0.9, 1.9, 2.9], 1),  # the chief got the update: the shard stays as it is
        (10, [1.0, 2.0, 3.0], 0),  # the chief never got it: the ps takes it back, optimizer state and all
    ],
)
def test_a_ps_one_update_ahead_of_the_chief_takes_it_back(chief_step, params, steps):
    optimizer = nn.make_optimizer("adam", 3, 0.1, xp=np, dtype=np.float64)
    shard = np.array([1.0, 2.0, 3.0])
    ledger = StepLedger(PreviousSlice(shard, optimizer))
    ledger.start_step = 10
    ledger.keep(shard, optimizer)
    optimizer.step(shard, np.ones(3))
    ledger.applied += 1
    ledger.rewind_to(chief_step, shard, optimizer)
    np.testing.assert_allclose(shard, params)
    assert optimizer.steps == steps and (optimizer.state_arrays()["m"] != 0).all() == (steps == 1)
    with pytest.raises(AssertionError, match="this rank is at step 11, the survivors agreed on step 9"):
        ledger.rewind_to(9, shard, optimizer)


def test_a_ps_without_elastic_keeps_no_previous_shard():
    ledger = StepLedger()
    ledger.keep(np.ones(3), None)  # nothing kept, nothing to fail
    ledger.applied = 2
    ledger.rewind_to(2, np.ones(3), None)
