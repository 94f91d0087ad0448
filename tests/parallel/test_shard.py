"""``--shard optimizer`` (ZeRO stage 1): each worker keeps the optimizer state of its slice.

That it trains as ``local`` does (clipping and accumulation included) is
tests/parallel/test_recipe.py's allreduce test, run with ``shard="optimizer"`` too.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import nn
from mpidist.parallel import AllreduceStrategy
from mpidist.parallel.shards import shard_bounds
from mpidist.runtime.cluster import build_cluster
from mpidist.store.checkpoint import Checkpoint

from conftest import events, mpidist
from small_net import small_convnet, worker_slice
from test_recipe import batches, make, recipe


def _sharded(cluster, optimizer):
    # (flat: see test_node_model)
    return AllreduceStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make(optimizer),
        cluster,
        seed=3,
        recipe=recipe(clip=2.0),
        shard="optimizer",
        exchange="mpi",
    )


@pytest.mark.mpi(min_size=2)
def test_each_worker_holds_its_slice_of_the_state_and_a_checkpoint_holds_it_whole():
    cluster = build_cluster(MPI.COMM_WORLD)
    workers, worker = cluster.num_workers, cluster.worker_index
    global_batch = 2 * workers
    xs, ys = batches(global_batch)
    strategy = _sharded(cluster, "adam")
    strategy.initialize()
    count = strategy.model.num_params
    lo, hi = shard_bounds(count, workers)[worker]
    assert {name: array.size for name, array in strategy.optimizer.state_arrays().items()} == {
        "m": hi - lo,
        "v": hi - lo,
    }
    assert strategy.stats()["optimizer_state_bytes"] == 2 * 8 * (hi - lo)  # Adam's two moments, float64
    part = worker_slice(global_batch, workers, worker)
    for step in range(2):
        strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
    state = strategy.state()
    if cluster.is_chief:
        arrays, steps = state.optimizer, state.steps
        assert arrays["m"].shape == arrays["v"].shape == (count,) and steps == 2
        assert np.array_equal(arrays["m"][lo:hi], strategy.optimizer.state_arrays()["m"])
    whole = MPI.COMM_WORLD.bcast(state, root=0)
    again = _sharded(cluster, "adam")  # resumed, sharded the same way or another: each takes its slice
    again.initialize(
        Checkpoint(
            path=None,
            params=whole.params,
            optimizer_state=whole.optimizer,
            optimizer_steps=whole.steps,
            step=2,
            epoch=0,
            epoch_step=2,
            config={},
        )
    )
    assert np.array_equal(again.optimizer.state_arrays()["v"], whole.optimizer["v"][lo:hi])
    assert again.optimizer.steps == 2
    np.testing.assert_array_equal(again.model.params, strategy.model.params)
    for done in (strategy, again):
        done.free()
    cluster.free()


def test_a_sharded_run_resumes_unsharded_and_elastic_is_refused(tmp_path):
    checkpoints = str(tmp_path / "ckpt")
    done, _ = mpidist(
        4,
        "train",
        "--shard",
        "optimizer",
        "--epochs",
        "2",
        "--optimizer",
        "adam",
        "--checkpoint-dir",
        checkpoints,
        "--run-dir",
        str(tmp_path / "a"),
        "--exchange",
        "mpi",
    )
    assert done.returncode == 0, done.stderr
    final = events(tmp_path / "a" / "metrics.jsonl", "done")[-1]
    held = [role["optimizer_state_bytes"] for role in final["roles"]]
    assert len(held) == 4 and max(held) - min(held) <= 2 * 4 * 2 and final["test_accuracy"] >= 0.8
    # the start event says what each rank holds: the whole parameters and gradients, a quarter of Adam's
    # moments
    start = events(tmp_path / "a" / "metrics.jsonl", "start")[0]
    count = start["params"]
    assert [entry["rank"] for entry in start["held_bytes"]] == [0, 1, 2, 3]
    for entry, role in zip(start["held_bytes"], final["roles"]):
        assert entry["params"] == 4 * count and entry["grads"] == 4 * (count + 1)
        assert (
            entry["optimizer_state"] == role["optimizer_state_bytes"] == role["held_bytes"]["optimizer_state"]
        )
        assert abs(entry["optimizer_state"] - 2 * 4 * count / 4) <= 2 * 4
    resumed, _ = mpidist(
        2,
        "train",
        "--epochs",
        "3",
        "--optimizer",
        "adam",
        "--checkpoint-dir",
        checkpoints,
        "--resume",
        "auto",
        "--run-dir",
        str(tmp_path / "b"),
    )
    assert resumed.returncode == 0, resumed.stderr
    assert events(tmp_path / "b" / "metrics.jsonl", "done")[-1]["epochs"] == 3
    refused, _ = mpidist(2, "train", "--shard", "optimizer", "--elastic")
    assert (
        refused.returncode == 2
        and "--shard optimizer keeps a slice of the optimizer state on one worker alone" in refused.stderr
    )
