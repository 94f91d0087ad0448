"""Initial parameters: each element a function of (seed, parameter, element), so every layout starts alike.

The serial part checks the draws (any slice of a parameter equals the same
slice of a whole draw; the distributions have the moments they promise); the
multi-rank part builds each layout on real ranks and compares every
parameter's fingerprint, summed from the slices the ranks hold, with one
process's.
"""

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import init


class Gate(nn.Layer):
    """A layer of one's own whose initialiser knows only ``(rng, shape)``."""

    def build(self, input_shape):
        self.units = input_shape[-1]
        return input_shape

    def param_specs(self):
        return [("g", (self.units,), lambda rng, shape: rng.uniform(0.5, 1.5, shape))]

    def forward(self, x, training=False):
        return x * self.params["g"]

    def backward(self, dy):
        return dy * self.params["g"]


def layers():
    """Seven layers of each kind of initialiser: a Dense pair that splits, one that stays whole, a user's
    layer, a LayerNorm (constants) and a Glorot classifier."""
    return [
        nn.Dense(16),
        nn.ReLU(),
        nn.Dense(12),
        nn.Tanh(),
        nn.Dense(10),
        Gate(),
        nn.LayerNorm(),
        nn.Dense(4, init="glorot"),
    ]


def whole(dtype=np.float32, buffers=True):
    return nn.Sequential(layers(), (6,), dtype=dtype, buffers=buffers)


@pytest.mark.parametrize("initialiser", [init.Normal(0.3), init.Uniform(2.0), init.Constant(-1.5)])
def test_any_slice_of_a_draw_is_that_slice_of_the_whole_draw(initialiser):
    key = np.uint64(987654321)
    every = initialiser.values(key, np.arange(10_000))
    picked = np.random.default_rng(0).permutation(10_000)[:777]
    assert np.array_equal(initialiser.values(key, picked), every[picked])
    assert np.array_equal(initialiser.values(key, np.arange(5000, 6000)), every[5000:6000])
    # another key, another draw (but for the constant)
    assert np.array_equal(initialiser.values(np.uint64(1), np.arange(10)), every[:10]) == isinstance(
        initialiser, init.Constant
    )


def test_the_draws_have_the_moments_they_promise():
    n, key, index = 1_000_000, np.uint64(42), np.arange(1_000_000)
    normal = init.Normal(2.0).values(key, index)
    # mean 0 and std 2: the sample mean's standard error is 2e-3, the sample std's about 1.4e-3
    assert abs(normal.mean()) < 5 * 2.0 / np.sqrt(n) and abs(normal.std() - 2.0) < 5 * 2.0 / np.sqrt(2 * n)
    assert abs(np.mean(np.abs(normal) < 2.0) - 0.6827) < 3e-3  # one std either side holds 68.27%
    uniform = init.Uniform(3.0).values(key, index)
    assert -3.0 < uniform.min() and uniform.max() < 3.0
    assert abs(uniform.mean()) < 5 * np.sqrt(3.0) / np.sqrt(n) and abs(uniform.var() - 3.0) < 0.02
    # neighbouring elements are not correlated (Box-Muller's two uniforms come from distinct counters)
    assert abs(np.corrcoef(normal[:-1], normal[1:])[0, 1]) < 5 / np.sqrt(n)
    assert np.array_equal(init.Constant(0.25).values(key, index[:3]), [0.25] * 3)
    assert np.allclose(init.he_normal(50).std, np.sqrt(2 / 50)) and init.glorot_uniform(2, 4).limit == 1.0


def test_an_initialiser_called_as_a_plain_one_draws_a_whole_parameter_of_its_shape():
    drawn = init.he_normal(8)(np.random.default_rng(1), (8, 3))
    assert drawn.shape == (8, 3) and np.isfinite(drawn).all() and np.ptp(drawn) > 0


@pytest.mark.parametrize("chunk", [5, 64, 1 << 18])
def test_a_model_draws_any_set_of_its_elements_as_the_whole_draw_gives_them(chunk):
    model = whole(np.float64)
    model.init_params(7)
    every = model.params.copy()
    for positions in (
        np.random.default_rng(3).permutation(model.num_params)[:150],
        range(40, 333),
        np.arange(model.num_params)[::-1],
    ):
        assert np.array_equal(model.initial_values(7, positions, chunk=chunk), every[np.asarray(positions)])
    model.init_params(8)
    assert not np.allclose(model.params, every)  # (the seed matters)


def test_each_parameter_draws_from_its_own_key_and_a_plain_initialiser_from_its_own_generator():
    model = whole(np.float64)
    model.init_params(11)
    entries = {}  # (the first layer of each kind's)
    for index, (layer, name, lo, shape, _) in enumerate(model.entries):
        entries.setdefault((type(layer).__name__, name), (index, lo, shape))
    index, lo, shape = entries[("Gate", "g")]
    expected = np.random.default_rng([11, index]).uniform(0.5, 1.5, shape)
    assert np.array_equal(model.params[lo : lo + shape[0]], expected)
    index, lo, shape = entries[("Dense", "W")]  # (the first Dense: He normal, std sqrt(2 / 6))
    key = nn.Sequential.parameter_key(11, index)
    assert np.array_equal(model.params[lo : lo + 6 * 16], init.he_normal(6).values(key, np.arange(6 * 16)))
    index, lo, shape = entries[("LayerNorm", "gamma")]
    assert np.array_equal(model.params[lo : lo + 10], np.ones(10))


def test_a_model_built_without_buffers_makes_them_when_first_used_and_never_as_a_map_of_shapes():
    model = whole(buffers=False)
    assert model._params is None and model._grads is None  # (nothing allocated by building)
    assert model.layers[0].params == {}
    model.init_params(0)  # (first use: made and bound)
    assert np.shares_memory(model.layers[0].params["W"], model.params)
    out = model.forward(np.ones((2, 6), dtype=np.float32), training=True)
    model.backward(np.ones_like(out))
    assert np.shares_memory(model.layers[0].grads["W"], model.grads)
    shapes = whole(buffers=False)
    shapes.shapes_only = True  # (a pipeline stage's or a tensor part's whole model)
    with pytest.raises(RuntimeError, match="map of shapes"):
        shapes.params


# -- with real ranks -----------------------------------------------------------------------------------------
def fingerprints(model, positions, values):
    """``(sums, counts)`` per entry of ``model`` (the whole): a 64-bit hash of each held element (its place in
    the whole buffer and its bits) summed modulo 2^64, and how many elements are held."""
    if isinstance(positions, range):
        positions = np.arange(positions.start, positions.stop, dtype=np.int64)
    bits = np.ascontiguousarray(values).view(np.uint32 if values.dtype.itemsize == 4 else np.uint64)
    hashed = init.uniform_bits(
        np.uint64(0),
        (positions.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ bits.astype(np.uint64)).view(np.int64),
    )
    starts = np.array([lo for _, _, lo, _, _ in model.entries], dtype=np.int64)
    owners = np.searchsorted(starts, positions, side="right") - 1
    sums = np.zeros(len(starts), dtype=np.uint64)
    counts = np.bincount(owners, minlength=len(starts)).astype(np.uint64)
    np.add.at(sums, owners, hashed)  # (uint64 arithmetic wraps: a sum modulo 2^64)
    return sums, counts


def make_layout(name, cluster):
    """``(strategy, placement)``: the strategy ``name`` on ``cluster``, initialised, and the regions of the
    whole model it holds (None: it holds the whole model)."""
    from mpidist.parallel import AllreduceStrategy, LocalStrategy, PipelineStrategy

    model, loss = whole(buffers=False), nn.loss_for(4, np)
    make = lambda size: nn.make_optimizer("adam", size, 0.01, xp=np, dtype=np.float32)  # noqa: E731
    common = dict(seed=5)
    if name == "local":
        strategy = LocalStrategy(model, loss, make, **common)
    elif name.startswith("allreduce"):
        tensor = int(name.split("tensor ")[1]) if "tensor" in name else 1
        strategy = AllreduceStrategy(
            model,
            loss,
            make,
            cluster,
            exchange="mpi",
            tensor=tensor,
            shard="optimizer" if "shard" in name else "none",
            **common,
        )
    else:
        stages, tensor = (int(part) for part in name.split()[1].split("x"))
        strategy = PipelineStrategy(
            model,
            loss,
            make,
            cluster,
            stages=stages,
            micro_batches=2,
            schedule_name="1f1b",
            global_batch=8,
            tensor=tensor,
            balance=[3, 5] if stages == 2 else None,
            **common,
        )
    strategy.initialize()
    placement = getattr(strategy, "placement", None)  # (a pipeline's, or a tensor part's)
    if placement is None and getattr(strategy, "tensor", None) is not None:
        placement = strategy.tensor.placement
    return strategy, placement


#: Layout -> ranks: pipelines are "pipeline PxT" (stages x tensor parts).
LAYOUTS = {
    "local": 1,
    "allreduce --shard optimizer": 3,
    "pipeline 2x1": 2,
    "pipeline 4x1": 4,
    "allreduce --tensor 2": 2,
    "allreduce --tensor 4": 4,
    "pipeline 2x2": 4,
}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_starts_from_bit_identical_parameters(layout):
    """Each parameter's fingerprint, summed over the slices every rank holds, is the one process's times the
    number of ranks holding each element (replicas, a tensor group's parts); nothing is gathered."""
    from mpi4py import MPI

    from mpidist.runtime.cluster import build_cluster

    world, ranks = MPI.COMM_WORLD, LAYOUTS[layout]
    comm = world.Split(0 if world.Get_rank() < ranks else 1, key=world.Get_rank())
    if world.Get_rank() < ranks:
        cluster = build_cluster(comm)
        strategy, placement = make_layout(layout, cluster)
        positions = range(strategy.model.num_params) if placement is None else placement.positions()
        sums, counts = fingerprints(whole(), positions, np.asarray(strategy.model.params))
        assert len(positions) == strategy.model.num_params
        if placement is not None:  # of the ranks holding an element, exactly one writes it
            written = np.zeros(len(placement.whole.entries), dtype=np.int64)
            for region in placement.regions:
                written[region.entry] += region.size if region.writes else 0
            comm.Allreduce(MPI.IN_PLACE, written, op=MPI.SUM)
            assert written.tolist() == [int(np.prod(shape)) for _, _, _, shape, _ in placement.whole.entries]
        comm.Allreduce(MPI.IN_PLACE, [sums, MPI.UINT64_T], op=MPI.SUM)
        comm.Allreduce(MPI.IN_PLACE, [counts, MPI.UINT64_T], op=MPI.SUM)
        alone = whole()
        alone.init_params(5)
        expected, sizes = fingerprints(alone, range(alone.num_params), alone.params)
        held = counts // sizes
        # every element, alike
        assert np.array_equal(held * sizes, counts) and (held >= 1).all(), (
            counts,
            sizes,
        )
        assert np.array_equal(sums, expected * held), layout
        if layout == "allreduce --tensor 4":  # (and no rank of a split layout holds the whole model)
            assert strategy.model.num_params < alone.num_params
        strategy.free()
        cluster.free()
    comm.Free()
