"""``--shard parameters``'s arithmetic: the model cut into units, each unit's shard per worker, and the rank's
buffer of shards (pure, no MPI).

A unit is a run of consecutive top-level layers whose parameters are at most
a size (``--bucket-mb``, as gradient buckets are); a layer larger than that is
a unit alone, and layers without parameters join the unit before them.  Each
unit ``[lo, hi)`` of the flat buffer is cut in ``W`` contiguous shards of one
block each, ``ceil(size / W)`` elements (:func:`block_of`; the last shards
shorter or empty), so gathering a unit is one ``Allgather`` of equal blocks
into a workspace padded to ``W`` blocks, and summing its gradients one
``Reduce_scatter_block``, each rank receiving its block.  Equal blocks, as
FSDP pads its flat parameters: MPICH's ``Allgatherv`` of 2.7 MB over two
ranks took three times its ``Allgather``.  A rank holds
its shards of every unit one after the other: that buffer is all it keeps of
the parameters, their gradients and the optimizer state between steps.
"""

import dataclasses

import numpy as np

from ...nn.placement import Placement, Region
from ..optimizer_factory import within


@dataclasses.dataclass(frozen=True)
class Unit:
    """Top-level layers ``[first, end)`` whose parameters are ``[lo, hi)`` of the model's flat buffer."""

    first: int
    end: int
    lo: int
    hi: int

    @property
    def size(self):
        return self.hi - self.lo


def cut_units(offsets, num_params, limit):
    """The units of a model whose top-level layer ``i`` has its parameters from ``offsets[i]`` on (to the
    next layer's offset, or ``num_params``), each at most ``limit`` parameters unless one layer alone is
    more.

    A layer without parameters joins the unit of the layers before it (the next one's, at the start).

    >>> [(u.first, u.end, u.lo, u.hi) for u in cut_units([0, 6, 6, 10], 16, 8)]
    [(0, 2, 0, 6), (2, 3, 6, 10), (3, 4, 10, 16)]
    """
    ends = [*offsets[1:], num_params]
    units, first = [], 0
    for index in range(1, len(offsets)):
        has_params = ends[index] > offsets[index]
        if has_params and offsets[index] > offsets[first] and ends[index] - offsets[first] > limit:
            units.append(Unit(first, index, offsets[first], offsets[index]))
            first = index
    if offsets:
        units.append(Unit(first, len(offsets), offsets[first], num_params))
    return units


def units_of(offsets, num_params, bucket_bytes, itemsize):
    """:func:`cut_units` with at most ``bucket_bytes`` (``--bucket-mb``) of ``itemsize``-byte parameters a
    unit."""
    return cut_units(offsets, num_params, max(1, int(bucket_bytes) // itemsize))


class ShardedUnits:
    """Rank ``rank`` of ``ranks``'s shards of ``units``: where each sits in the unit and in the rank's buffer.

    Args:
        units: the model's :class:`Unit` s, in order.
        ranks, rank: the workers that share the shards, and this one's index.
    """

    def __init__(self, units, ranks, rank):
        self.units, self.ranks, self.rank = list(units), int(ranks), int(rank)
        #: each unit's block: the elements of a shard, the last ones' padded (a gathered unit is ``ranks``
        #: blocks)
        self.blocks = [block_of(unit.size, self.ranks) for unit in self.units]
        self.bounds = [
            [(min(r * block, unit.size), min((r + 1) * block, unit.size)) for r in range(self.ranks)]
            for unit, block in zip(self.units, self.blocks)
        ]
        self.counts = [[hi - lo for lo, hi in bounds] for bounds in self.bounds]
        held, self.held_lo = 0, []
        for counts in self.counts:
            self.held_lo.append(held)
            held += counts[self.rank]
        #: the parameters this rank holds (its shard of every unit)
        self.size = held

    def shard(self, index):
        """``(lo, hi)`` of this rank's shard of unit ``index`` within the unit."""
        return self.bounds[index][self.rank]

    def held(self, index):
        """``(lo, hi)`` of this rank's shard of unit ``index`` in its buffer of shards."""
        lo = self.held_lo[index]
        return lo, lo + self.counts[index][self.rank]

    def pieces(self):
        """``(lo, hi)`` in the model's flat buffer of each of this rank's shards, in its buffer's order (they
        lie one after the other there)."""
        return [(unit.lo + lo, unit.lo + hi) for unit, (lo, hi) in zip(self.units, self._shards())]

    def _shards(self):
        return [bounds[self.rank] for bounds in self.bounds]

    def unit_of(self, layer):
        """The index of the unit that holds top-level layer ``layer``."""
        for index, unit in enumerate(self.units):
            if unit.first <= layer < unit.end:
                return index
        raise IndexError(f"layer {layer} is in no unit")

    def within(self, ranges):
        """``ranges`` of the model's flat buffer as ranges of this rank's buffer of shards
        (:func:`~mpidist.parallel.optimizer_factory.within`)."""
        return within(self.pieces(), ranges)


def block_of(size, ranks):
    """The elements of each of ``ranks`` equal blocks a unit of ``size`` is gathered in: its shards, the last
    ones shorter (or empty) where ``ranks`` does not divide it, as FSDP pads its flat parameters.

    >>> block_of(10, 4), block_of(8, 4)
    (3, 2)
    """
    return -(-size // ranks)


def slot_counts(units, keep, prefetch=True):
    """``(parameter slots, gradient slots)`` of a worker gathering ``units``: two of each (unit ``u`` in slot
    ``u % 2``), one where there is one unit, and with ``keep`` a parameter slot per unit; one of each
    without ``prefetch`` (a unit gathered only as it runs: the layout of a model whose two units in flight
    do not fit)."""
    pair = max(1, min(2 if prefetch else 1, len(units)))
    return (max(1, len(units)) if keep else pair), pair


def slot_sizes(units, slots, ranks):
    """Elements of each of ``slots`` slots where unit ``u`` lives in slot ``u % slots``: its largest unit's,
    padded to ``ranks`` equal blocks.

    >>> slot_sizes([Unit(0, 1, 0, 5), Unit(1, 2, 5, 8), Unit(2, 3, 8, 16)], 2, 2)
    [8, 4]
    """
    return [
        max((ranks * block_of(unit.size, ranks) for unit in units[slot::slots]), default=0)
        for slot in range(slots)
    ]


def gathered_elements(units, keep, ranks, prefetch=True, sharing=1):
    """Elements of a worker's slots gathering ``units`` from ``ranks`` workers: its gathered units' parameters
    and gradients (:func:`slot_counts`); where ``sharing`` workers of a node read one copy of the parameter
    slots (:class:`~mpidist.parallel.data.unit_routes.NodeRoute`), its share of them."""
    params, grads = slot_counts(units, keep, prefetch)
    return sum(slot_sizes(units, params, ranks)) // sharing + sum(slot_sizes(units, grads, ranks))


def node_sharing(exchange, per_node, tensor=1):
    """The workers of a node that read one copy of each gathered unit: the replicas of one part among its
    ``per_node`` ranks (``tensor`` parts, split evenly) where ``--exchange`` lets them share one (auto,
    node), else 1 (a copy each).  Callers that can tell the route cannot serve after all say 1 themselves
    (:func:`~mpidist.parallel.data.unit_routes.unit_route`).

    >>> [node_sharing(exchange, 4, tensor) for exchange, tensor in [("auto", 1), ("node", 2), ("mpi", 1)]]
    [4, 2, 1]
    >>> node_sharing("auto", 3, tensor=2)  # (the parts of 3 ranks do not split evenly)
    1
    """
    if exchange == "mpi" or per_node % tensor:
        return 1
    return max(per_node // tensor, 1)


def window_bytes(units, keep, ranks, prefetch, sharing, itemsize):
    """Bytes of a node's shared windows where ``sharing`` workers read one copy of the parameter slots
    (:class:`~mpidist.parallel.data.unit_routes.NodeRoute`): those slots once, and each worker's gradient
    slots."""
    params, grads = slot_counts(units, keep, prefetch)
    return itemsize * (sum(slot_sizes(units, params, ranks)) + sharing * sum(slot_sizes(units, grads, ranks)))


def flat_rectangles(shape, lo, hi):
    """``(start, stop)`` rectangles of an array of ``shape`` (C order) that together are its flat elements
    ``[lo, hi)``, in that order: a partial row, whole rows, a partial row, recursively (a region of a
    checkpoint must be rectangular).

    >>> flat_rectangles((3, 4), 2, 11)
    [((0, 2), (1, 4)), ((1, 0), (2, 4)), ((2, 0), (3, 3))]
    """
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi,))]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    first, last = lo // inner, (hi - 1) // inner
    if first == last:  # within one row: that row's rectangles, on the row's index
        return [
            ((first, *a), (first + 1, *b))
            for a, b in flat_rectangles(shape[1:], lo - first * inner, hi - first * inner)
        ]
    found = []
    if lo % inner:  # the first row's tail
        found += flat_rectangles(shape, lo, (first + 1) * inner)
        first += 1
    whole_end = hi // inner  # rows [first, whole_end) whole
    if whole_end > first:
        found.append(((first, *(0,) * (len(shape) - 1)), (whole_end, *shape[1:])))
    if hi % inner:  # the last row's head
        found += flat_rectangles(shape, whole_end * inner, hi)
    return found


def sliced(placement, pieces):
    """The :class:`~mpidist.nn.placement.Placement` of a buffer made of ``pieces`` (``(lo, hi)`` ranges of
    the buffer ``placement`` describes, laid one after the other): each piece's elements as rectangles of
    the whole model's parameters, so a checkpoint writes and reads a rank's shards as it does a stage's."""
    regions, at = [], 0
    for lo, hi in pieces:
        for region in placement.regions:
            a, b = max(lo, region.lo), min(hi, region.lo + region.size)
            for start, stop in flat_rectangles(region.shape, a - region.lo, b - region.lo):
                shifted = [tuple(r + s for r, s in zip(region.start, corner)) for corner in (start, stop)]
                regions.append(Region(region.entry, *shifted, at, region.writes))
                at += int(np.prod([e - s for s, e in zip(start, stop)], dtype=np.int64))
    return Placement(placement.whole, regions)
