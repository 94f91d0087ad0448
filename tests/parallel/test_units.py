"""``--shard parameters``'s arithmetic: units, blocks and shards, and a rank's shards as regions of the
model (pure, no MPI)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpidist.nn import zoo
from mpidist.nn.placement import Placement
from mpidist.parallel.optimizer_factory import within
from mpidist.parallel.data.units import (
    ShardedUnits,
    Unit,
    cut_units,
    flat_rectangles,
    gathered_elements,
    slot_counts,
    sliced,
)


@pytest.mark.parametrize(
    "offsets, count, limit, expected",
    [
        # a layer over the limit is a unit alone; layers without parameters join the unit before them
        ([0, 6, 6, 10], 16, 8, [(0, 2, 0, 6), (2, 3, 6, 10), (3, 4, 10, 16)]),
        ([0, 6, 6, 10], 16, 100, [(0, 4, 0, 16)]),  # all of it under the limit: one unit
        (
            [0, 0, 4, 4],
            8,
            3,
            [(0, 3, 0, 4), (3, 4, 4, 8)],
        ),  # (a first layer without parameters: the first unit)
        ([0, 10, 10], 20, 8, [(0, 2, 0, 10), (2, 3, 10, 20)]),
        ([0, 0], 0, 8, [(0, 2, 0, 0)]),  # no parameters at all: one empty unit
    ],
)
def test_units_are_runs_of_layers_up_to_the_limit(offsets, count, limit, expected):
    assert [(u.first, u.end, u.lo, u.hi) for u in cut_units(offsets, count, limit)] == expected


def test_shards_are_equal_blocks_the_last_shorter_and_lie_one_after_the_other():
    units = [Unit(0, 1, 0, 10), Unit(1, 2, 10, 18)]
    every = [ShardedUnits(units, 4, rank) for rank in range(4)]
    assert every[0].blocks == [3, 2]
    assert [s.bounds for s in every[:1]] == [
        [[(0, 3), (3, 6), (6, 9), (9, 10)], [(0, 2), (2, 4), (4, 6), (6, 8)]]
    ]
    assert [s.size for s in every] == [5, 5, 5, 3]
    assert every[3].pieces() == [(9, 10), (16, 18)] and every[3].held(1) == (1, 3)
    assert every[1].within([(4, 13), (17, 18)]) == [(1, 3), (3, 4)]  # (its shards: [3, 6) and [12, 14))
    assert within([(4, 8), (10, 12)], [(2, 6), (7, 11)]) == [(0, 2), (3, 4), (4, 5)]


@pytest.mark.parametrize(
    "keep, ranks, expected",
    [(False, 4, 2 * (12 + 8)), (True, 4, 12 + 8 + 4 + 12 + 8), (False, 1, 2 * (10 + 8))],
)
def test_a_worker_gathers_into_two_slots_or_one_a_unit(keep, ranks, expected):
    """Units of 10, 8 and 3: slot 0 holds units 0 and 2 (padded to 4 blocks: 12 and 4), slot 1 unit 1 (8);
    two gradient slots likewise; kept, a parameter slot a unit."""
    units = [Unit(0, 1, 0, 10), Unit(1, 2, 10, 18), Unit(2, 3, 18, 21)]
    assert slot_counts(units, keep) == ((3 if keep else 2), 2)
    assert gathered_elements(units, keep, ranks) == expected


def test_without_prefetch_a_worker_gathers_every_unit_into_one_slot_of_each():
    """Units of 10, 8 and 3 on 4 workers: one parameter slot and one gradient slot, each the largest unit
    padded to 4 blocks (12): half the two slots' 2 x (12 + 8); kept, the prefetch does not apply."""
    units = [Unit(0, 1, 0, 10), Unit(1, 2, 10, 18), Unit(2, 3, 18, 21)]
    assert slot_counts(units, False, prefetch=False) == (1, 1)
    assert gathered_elements(units, False, 4, prefetch=False) == 2 * 12
    assert slot_counts(units, True, prefetch=False) == (3, 1)
    assert slot_counts(units[:1], False, prefetch=False) == slot_counts(units[:1], False) == (1, 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.integers(0, int(np.prod(shape))),
            st.integers(0, int(np.prod(shape))),
        )
    )
)
def test_a_flat_range_is_the_rectangles_that_cover_it_in_order(case):
    shape, a, b = case
    lo, hi = min(a, b), max(a, b)
    whole = np.arange(int(np.prod(shape))).reshape(shape)
    found = [
        whole[tuple(slice(s, e) for s, e in zip(start, stop))].reshape(-1)
        for start, stop in flat_rectangles(shape, lo, hi)
    ]
    assert np.array_equal(np.concatenate([np.zeros(0, dtype=int), *found]), np.arange(lo, hi))
    assert len(found) <= 2 * len(shape) - 1


@pytest.mark.parametrize("ranks", [1, 3, 4, 7])
def test_the_shards_of_every_rank_are_the_model_each_element_once(ranks):
    model = zoo.build_model("cnn:4,6", (1, 8, 8), 5, np, np.float64, buffers=False)
    units = cut_units(model.offsets, model.num_params, 200)
    whole = Placement.of_entries(model, 0, len(model.entries))
    placed = [sliced(whole, ShardedUnits(units, ranks, rank).pieces()) for rank in range(ranks)]
    positions = [p.positions() for p in placed]
    for rank, where in enumerate(positions):
        expected = [np.arange(lo, hi) for lo, hi in ShardedUnits(units, ranks, rank).pieces()]
        assert np.array_equal(where, np.concatenate([np.zeros(0, dtype=int), *expected]))
    assert np.array_equal(np.sort(np.concatenate(positions)), np.arange(model.num_params))
    # each rank's initial values are its elements of the whole model's
    drawn = np.empty(model.num_params)
    model.initial_values(5, range(model.num_params), out=drawn)
    for where, placement in zip(positions, placed):
        np.testing.assert_array_equal(placement.initial(5, np.empty(placement.size)), drawn[where])
