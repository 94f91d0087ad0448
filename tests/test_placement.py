"""Placements: a rank's regions of the whole model's parameters, and what derives from them (no MPI)."""

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn.placement import COLUMNS, Placement, Region, rectangle
from mpidist.nn.tensor import split_model


def whole():
    model = nn.Sequential(
        [nn.Dense(6), nn.ReLU(), nn.Dense(5), nn.LayerNorm(), nn.Dense(3)], (4,), dtype=np.float64
    )
    model.init_params(2)
    return model


def test_a_rectangle_is_a_slice_per_axis_and_anything_else_is_refused():
    assert rectangle((slice(None), slice(2, 4)), (3, 6)) == ((0, 2), (3, 4))
    assert rectangle(slice(1, 3), (5, 2)) == ((1, 0), (3, 2))  # (the axes left out are whole)
    assert rectangle((), (5,)) == ((0,), (5,))
    for index in ([0, 2], (slice(None, None, 2),), (0, slice(None))):
        with pytest.raises(ValueError, match="not a"):
            rectangle(index, (5, 4))


def test_a_stages_regions_are_its_parameters_whole_in_order():
    model = whole()
    placement = Placement.of_entries(model, 2, 6)  # (the second Dense, the LayerNorm)
    assert [region.entry for region in placement.regions] == [2, 3, 4, 5]
    lo, hi = model.entries[2][2], model.entries[5][2] + 5
    assert placement.size == hi - lo
    assert np.array_equal(placement.positions(), np.arange(lo, hi))
    assert np.array_equal(placement.take(model.params), model.params[lo:hi])


@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_tensor_parts_regions_give_its_slices_its_draws_and_fill_the_whole_back(part):
    model = whole()
    piece, placement = split_model(model, part, 3)
    positions = placement.positions()
    assert len(positions) == piece.num_params == placement.size
    # its values are the whole's at those positions, taken by region, drawn alone, and in small chunks
    assert np.array_equal(placement.take(model.params), model.params[positions])
    assert np.array_equal(placement.initial(2, np.empty(placement.size)), model.params[positions])
    assert np.array_equal(np.concatenate([p for _, p in placement.chunks(chunk=7)]), positions)
    # the first pair splits (Dense 6 by columns, Dense 5 by rows); the rest is whole, written by part 0 alone
    split = {
        region.entry
        for region in placement.regions
        if region.size < int(np.prod(model.entries[region.entry][3]))
    }
    assert split == {0, 1, 2}
    assert all(region.writes == (part == 0 or region.entry in split) for region in placement.regions)


def test_the_written_regions_of_every_part_fill_the_whole_model_once():
    model = whole()
    filled, counted = np.zeros(model.num_params), np.zeros(model.num_params)
    for part in range(3):
        piece, placement = split_model(model, part, 3)
        values = placement.take(model.params)
        rows = placement.describe()
        assert rows.shape[1] == COLUMNS and rows[:, 1].sum() == len(placement.written(values))
        Placement.fill(model, rows, placement.written(values), filled)
        Placement.fill(model, rows, np.ones(int(rows[:, 1].sum())), counted)
    assert np.array_equal(filled, model.params) and (counted == 1).all()


def test_a_region_says_its_shape_size_and_index():
    region = Region(entry=3, start=(0, 2), stop=(4, 5), lo=10)
    assert region.shape == (4, 3) and region.size == 12 and region.index == (slice(0, 4), slice(2, 5))
    assert region.writes


class Scale(nn.Layer):
    """One learned scalar (a parameter of shape ()), drawn by an initialiser of one's own."""

    def param_specs(self):
        return [("s", (), lambda rng, shape: np.asarray(rng.normal()))]

    def forward(self, x, training=False):
        return x * self.params["s"]


def test_a_scalar_parameter_and_an_initialiser_of_ones_own_are_placed_and_drawn_as_the_whole_draw():
    model = nn.Sequential([nn.Dense(3), Scale(), nn.Dense(600)], (2,), dtype=np.float64)
    model.init_params(4)
    placement = Placement.of_entries(model, 0, len(model.entries))
    assert np.array_equal(placement.positions(), np.arange(model.num_params))
    assert np.array_equal(placement.initial(4, np.empty(placement.size)), model.params)
