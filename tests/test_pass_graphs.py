"""A GPU's training pass as a CUDA graph (mpidist.nn.graphs, mpidist.parallel.data.graphed_passes), on
the host.

A stand-in for the device captures a pass as the function it is and runs it
again at each launch, on the Python state the capture left and leaving
Python as it found it: a driver that left this step's batch out of the
record, kept a value that changes in Python, or counted a figure in Python
inside the pass trains on stale values here as it would on a GPU.  ``tests/test_gpu.py``
runs the same comparisons with CUDA graphs.
"""

import contextlib
import gc
import types
import weakref

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn.capture import PassKey
from mpidist.nn import graphs as graphs_module
from mpidist.nn.graphs import PassGraphs
from mpidist.nn.pass_state import PassState
from mpidist.nn.workspace import Workspace
from mpidist.parallel import LocalStrategy
from mpidist.parallel.data.graphed_passes import GraphedPasses, why_eager

from small_net import small_convnet


class HostGraphs:
    """:class:`~mpidist.nn.graphs.CudaGraphs`' stand-in: a graph is the captured pass, run again at each
    launch as a GPU replays it, on the Python state its capture left and leaving Python as it found it.

    A capture runs nothing (its first launch runs the pass and takes the Python state it leaves: what the
    capture saw); a replay puts that state back, runs the pass, and puts back what Python held before it.
    So a value the driver keeps in Python and changes between steps reads stale in a replay, as it would on a
    device, and a figure the pass counts in Python is not counted.

    Args:
        refuse: a capture raises this message (a pass that reads a value on the host).
        midway: the refused capture first runs the pass's Python, and every workspace array it made holds
            NaN (made, never computed), as a capture that failed at its end leaves them.
    """

    def __init__(self, refuse=None, midway=False):
        self.refuse, self.midway = refuse, midway
        self.objects = tuple  # (the pass's objects: set by the test)
        self.pools = self.released = self.captures = self.launches = 0
        self.in_use = []  # (pools whose arrays are still used: kept once their run is over)

    def pool(self):
        self.pools += 1
        return object()

    def allocating(self, pool):
        return contextlib.nullcontext()

    def release(self, pool):
        self.released += 1

    def used(self, pool):
        return pool in self.in_use

    def capture(self, work, pool):
        if self.refuse:
            if self.midway:
                before = self._workspace_arrays()
                work()
                for key, array in self._workspace_arrays().items():
                    if key not in before:
                        array[...] = np.nan
            raise RuntimeError(self.refuse)
        self.captures += 1
        return [work, None]

    def launch(self, graph):
        self.launches += 1
        work, captured = graph
        if captured is None:  # (the launch after the capture: the pass as the capture recorded it)
            work()
            graph[1] = PassState(self.objects())
            return
        now = PassState(self.objects())
        captured.restore()
        work()
        now.restore()

    def _workspace_arrays(self):
        found = (obj for obj in self.objects() if isinstance(obj, Workspace))
        return {id(array): array for workspace in found for array in workspace._arrays.values()}


def _mlp(norm=False):
    layers = [nn.Dense(16), nn.ReLU(), *([nn.BatchNorm()] if norm else []), nn.Dense(4)]
    return nn.Sequential(layers, (6,), xp=np, dtype=np.float32)


def _local(graphs=None, norm=False, outputs=4, model=None):
    model = _mlp(norm) if model is None else model
    model.init_params(7)
    strategy = LocalStrategy(
        model,
        nn.loss_for(outputs, np),
        lambda size: nn.make_optimizer("adam", size, 0.01, xp=np, dtype=np.float32),
        seed=3,
    )
    if graphs is not None:
        strategy.passes.graphed = GraphedPasses(strategy.passes, device=graphs)
        graphs.objects = strategy.passes.graphed.objects
    return strategy


def _batches(outputs=4):
    """Seven steps: full batches of 8, the epoch's last batch of 5 between them, then full again."""
    rng = np.random.default_rng(11)
    sizes = [8, 8, 8, 5, 8, 5, 8]
    for size in sizes:
        x = rng.standard_normal((size, 6)).astype(np.float32)
        y = rng.integers(0, 4, size) if outputs else rng.standard_normal((size, 4)).astype(np.float32)
        yield x, y, size / 8


@pytest.mark.parametrize("norm", [False, True], ids=["mlp", "batch-norm"])
@pytest.mark.parametrize("outputs", [4, 0], ids=["classes", "regression"])
def test_a_graphed_pass_trains_as_the_eager_pass_does(norm, outputs):
    """Each step's loss, the parameters (a BatchNorm's running statistics among them) and the training figures
    of graphed passes are the eager passes'; each shape runs eagerly once, is captured the next time and
    replayed after."""
    device = HostGraphs()
    eager, graphed = _local(norm=norm, outputs=outputs), _local(device, norm=norm, outputs=outputs)
    for step, (x, y, weight) in enumerate(_batches(outputs)):
        losses = [strategy.train_step(x, y, weight, step) for strategy in (eager, graphed)]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    np.testing.assert_allclose(graphed.model.params, eager.model.params, rtol=1e-5, atol=1e-7)
    figures = [strategy.passes.take_counts() for strategy in (eager, graphed)]
    assert figures[1][1] == figures[0][1] == 50
    np.testing.assert_allclose(figures[1][0], figures[0][0], rtol=1e-6)
    ran = graphed.passes.graphed.graphs.ran
    assert dict(ran) == {"eager": 2, "capture": 2, "replay": 3}
    assert device.captures == 2 and device.launches == 5


def test_a_refused_capture_runs_the_pass_eagerly_for_good_and_says_why():
    device = HostGraphs(refuse="operation not permitted when stream is capturing")
    eager, graphed = _local(), _local(device)
    for step, (x, y, weight) in enumerate(_batches()):
        losses = [strategy.train_step(x, y, weight, step) for strategy in (eager, graphed)]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
    np.testing.assert_allclose(graphed.model.params, eager.model.params, rtol=1e-5, atol=1e-7)
    graphs = graphed.passes.graphed.graphs
    assert dict(graphs.ran) == {"eager": 7, "capture": 0, "replay": 0}
    assert device.launches == 0
    reason = "RuntimeError: operation not permitted when stream is capturing"
    assert f"eager for good: {reason}" in graphs.summary()


def test_a_graph_the_rule_lets_go_of_gives_back_its_pools_spare_memory_and_keeps_its_arrays():
    """cupy frees a pool's memory, in use or not, when the pool goes: a key's pool and record are kept while
    its run goes on (its arrays may be a model's workspace), its free blocks given back when its graph goes;
    at the end of the run its pools go once nothing uses them."""
    device = HostGraphs()
    graphs = PassGraphs(device, keep=1)
    made = []

    def make():
        made.append(np.zeros(1))
        return made[-1]

    def work(record):
        record += 1

    a, b = (PassKey("train", (shape,), "float32") for shape in (8, 5))
    # a: eager, capture; b: eager, capture (a's graph goes); a: captured again, replayed
    for key in (a, a, b, b, a, a):
        graphs.record(key, make)
        graphs.run(key, work)
    assert graphs.held == 1 and graphs.ran == {"eager": 2, "capture": 3, "replay": 1}
    assert len(made) == 2 and device.pools == 2 and device.released == 2  # (a's, then b's)
    assert made[0][0] == 4 and made[1][0] == 2
    pools = list(graphs._pools.values())
    device.in_use.append(pools[0])  # (a model still holds arrays of a's pool)
    graphs.free()
    assert graphs.held == 0 and graphs._records == {} and device.released == 4
    retired = [pool for _, pool in graphs_module._RETIRED]
    assert pools[0] in retired and pools[1] not in retired
    device.in_use.clear()  # (the model is gone: the next run's first pool lets a's go)
    later = PassGraphs(device)
    later.record(a, make)
    assert pools[0] not in [pool for _, pool in graphs_module._RETIRED]
    graphs.record(a, make)  # (a pass after the end starts afresh: eagerly, on a record of its own)
    graphs.run(a, work)
    assert graphs.ran["eager"] == 3 and made[-1][0] == 1


def test_what_a_pass_held_before_its_capture_stays_allocated_while_its_graph_is_kept():
    """An array made by another pass (an evaluation's row indices) and replaced after the capture is still the
    graph's: it is pinned until the graph goes."""
    holder = types.SimpleNamespace(rows=np.arange(8), caches={"bias": np.zeros(3)})
    graphs = PassGraphs(HostGraphs(), objects=lambda: [holder], keep=1)
    before = [weakref.ref(holder.rows), weakref.ref(holder.caches["bias"])]
    key, other = PassKey("train", (8,), "float32"), PassKey("train", (5,), "float32")
    for _ in range(2):  # (eager, then captured)
        graphs.record(key, lambda: np.zeros(1))
        graphs.run(key, lambda record: None)
    holder.rows, holder.caches["bias"] = np.arange(5), np.ones(3)  # (another pass replaces them)
    gc.collect()
    assert all(ref() is not None for ref in before)
    for _ in range(2):  # (another key's capture pushes the first graph out)
        graphs.record(other, lambda: np.zeros(1))
        graphs.run(other, lambda record: None)
    gc.collect()
    assert all(ref() is None for ref in before)


def test_a_capture_refused_half_way_leaves_the_pass_as_it_was_before_it():
    """A capture that fails at its end made arrays it never computed (NaN here): the objects are put back as
    they were, and the eager pass makes them anew.  The full batch's capture comes after the last batch's
    pass changed the workspace's shapes, so the capture makes them (the convolution's column of ones)."""
    device = HostGraphs(refuse="operation not permitted when stream is capturing", midway=True)
    eager = _local(model=small_convnet(np.float32))
    graphed = _local(device, model=small_convnet(np.float32))
    rng = np.random.default_rng(4)
    for step, size in enumerate([8, 5, 8, 5, 8]):
        x, y = rng.standard_normal((size, 1, 6, 6)).astype(np.float32), rng.integers(0, 4, size)
        losses = [strategy.train_step(x, y, size / 8, step) for strategy in (eager, graphed)]
        assert np.isfinite(losses[1]) and losses[1] == pytest.approx(losses[0], rel=1e-6)
    np.testing.assert_allclose(graphed.model.params, eager.model.params, rtol=1e-5, atol=1e-7)
    assert graphed.passes.graphed.graphs.ran == {"eager": 5, "capture": 0, "replay": 0}


def test_the_loss_scale_may_change_after_the_capture_and_the_stand_in_catches_a_baked_one():
    """The scale is read from the device: a weight that changes after the capture (fp16's loss scale) trains
    as the eager passes do.  The stand-in has teeth: a driver that kept the scale in Python (baked into a
    graph on a device) trains otherwise."""

    class BakedScale(GraphedPasses):
        def backprop(self, x, y, weight, before_backward=None, ready=None):
            self.weight = float(weight)
            return super().backprop(x, y, weight, before_backward, ready)

        def _work(self, record):
            record.scale[...] = self.weight  # (inside the pass: a replay reads the captured value)
            super()._work(record)

    eager, graphed, baked = _local(), _local(HostGraphs()), _local(HostGraphs())
    device = baked.passes.graphed.graphs.device
    baked.passes.graphed = BakedScale(baked.passes, device=device)
    device.objects = baked.passes.graphed.objects
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 4, 8)
    for step, weight in enumerate([1.0, 1.0, 0.5, 0.25]):  # (eager, captured, then replayed at other weights)
        for strategy in (eager, graphed, baked):
            strategy.train_step(x, y, weight, step)
    assert graphed.passes.graphed.graphs.ran["replay"] == baked.passes.graphed.graphs.ran["replay"] == 2
    np.testing.assert_allclose(graphed.model.params, eager.model.params, rtol=1e-5, atol=1e-7)
    assert not np.allclose(baked.model.params, eager.model.params, rtol=1e-5, atol=1e-7)


def test_a_pass_state_puts_back_attributes_and_the_items_of_dicts_and_lists():
    obj = types.SimpleNamespace(a=1, table={"x": 1}, items=[1, 2])
    state = PassState([obj])
    obj.a, obj.added = 2, 3
    obj.table["x"], obj.table["y"] = 5, 6
    obj.items.append(3)
    state.restore()
    assert vars(obj) == {"a": 1, "table": {"x": 1}, "items": [1, 2]}
    assert set(map(id, state.pinned())) >= {id(obj.table), id(obj.items)}


def test_where_a_models_passes_stay_eager(monkeypatch):
    def model(layers=(), gate=None):
        return types.SimpleNamespace(xp=types.SimpleNamespace(), gate=gate, layers=list(layers))

    synced = nn.BatchNorm(sync=True)
    synced.reduce = print
    assert why_eager(model([nn.Dense(3)])) is None
    assert why_eager(model([nn.BatchNorm(sync=True)])) is None  # (one worker: its statistics are its own)
    assert (
        why_eager(model([nn.Dense(3), nn.Dropout(0.1)])) is None
    )  # (its draws read their key on the device)
    assert "MPI inside the pass" in why_eager(model([synced]))
    assert "MPI inside the pass" in why_eager(model(gate=object()))
    assert "MPI inside the pass" in why_eager(model(), collective=True)
    assert "--accumulate" in why_eager(model(), accumulate=2)
    assert "an Embedding" in why_eager(model([nn.Embedding(10, 4)]))
    assert why_eager(_mlp()) == "arrays on the host"
    monkeypatch.setenv("MPIDIST_GRAPHS", "0")
    assert why_eager(model()) == "MPIDIST_GRAPHS=0"


def test_on_the_host_a_strategys_passes_are_eager_and_its_figures_unchanged():
    strategy = _local()
    assert strategy.passes.graphed is None and strategy.graphs_off == "arrays on the host"
    assert "graphs" not in strategy.stats()


@pytest.mark.parametrize("outputs", [4, 0], ids=["cross-entropy", "squared-error"])
def test_a_losss_scale_may_be_a_0d_array(outputs):
    """A graph's pass reads its scale from the device: the gradient is the one a number gives."""
    rng = np.random.default_rng(2)
    out = rng.standard_normal((5, 4)).astype(np.float32)
    target = rng.integers(0, 4, 5) if outputs else rng.standard_normal((5, 4)).astype(np.float32)
    grads = []
    for scale in (0.625, np.array(0.625)):
        loss = nn.loss_for(outputs, np)
        loss.forward(out, target)
        grads.append(loss.backward(scale=scale).copy())
    assert grads[1].dtype == grads[0].dtype == np.float32
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-7)


@pytest.mark.mpi(min_size=2)
def test_allreduce_of_graphed_passes_sums_what_the_eager_passes_do():
    """The exchange starts once the pass is launched (every bucket ready at once): with buckets of 256 bytes,
    float64, each step's loss and the parameters are the eager exchange's to rounding."""
    from mpi4py import MPI

    from mpidist.parallel import AllreduceStrategy
    from mpidist.runtime.cluster import build_cluster

    from small_net import small_convnet, worker_slice

    cluster = build_cluster(MPI.COMM_WORLD)
    make = lambda size: nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    strategies = [
        AllreduceStrategy(
            small_convnet(np.float64), nn.loss_for(4, np), make, cluster, seed=3, bucket_bytes=256
        )
        for _ in range(2)
    ]
    device = HostGraphs()
    strategies[1].passes.graphed = GraphedPasses(strategies[1].passes, device=device)
    device.objects = strategies[1].passes.graphed.objects
    for strategy in strategies:
        strategy.initialize()
    rng = np.random.default_rng(0)  # the same data on every rank
    for step, size in enumerate([4, 4, 3, 4] * cluster.num_workers):
        x, y = rng.random((size * 2, 1, 6, 6)), rng.integers(0, 4, size * 2)
        part = worker_slice(len(x), cluster.num_workers, cluster.worker_index)
        weight = (part.stop - part.start) / len(x)
        losses = [strategy.train_step(x[part], y[part], weight, step) for strategy in strategies]
        assert losses[1] == pytest.approx(losses[0], rel=1e-12)
    np.testing.assert_allclose(strategies[1].model.params, strategies[0].model.params, rtol=1e-12, atol=1e-14)
    assert strategies[1].passes.graphed.graphs.ran["replay"] > 0
    for strategy in strategies:
        strategy.free()
