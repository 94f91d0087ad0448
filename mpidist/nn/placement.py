"""Where a rank's parameters sit in the whole model: regions, each a rectangular slice of one parameter.

A rank's flat buffer (its parameters; its gradients and optimizer state
follow the same order) is a sequence of regions.  A pipeline stage holds its
layers' parameters whole; a tensor part holds column or row slices of the
split ones and the replicated ones whole.  A :class:`Region` names the
whole model's parameter (its entry in the whole model's depth-first
:attr:`~mpidist.nn.Sequential.entries`), the slice of it (a start and a stop
on each axis), where it starts in the rank's buffer, and whether this rank
*writes* it: of the ranks that hold the same region (a pipeline's replicas,
a tensor group's parts for a replicated parameter) exactly one does, so a
gather or a checkpoint takes each element of the whole model once.

Initial values, slices taken from a whole-model array and whole arrays
filled from slices all derive from the regions, a few integers each: nothing
here is proportional to the whole model (pure array code, no MPI).
"""

import dataclasses

import numpy as np

CHUNK = 1 << 18  # elements drawn or indexed at a time
#: Axes a described region may have (a Conv2D kernel has 4), and the columns of a row that describes one.
AXES = 6
COLUMNS = 2 + 2 * AXES


@dataclasses.dataclass(frozen=True)
class Region:
    """A rectangular slice ``[start, stop)`` of the whole model's parameter ``entry``, at ``lo`` in a rank's
    buffer."""

    entry: int
    start: tuple
    stop: tuple
    lo: int
    writes: bool = True

    @property
    def shape(self):
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def index(self):
        """The region as a numpy index into its whole parameter."""
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))


def rectangle(index, shape):
    """``(start, stop)`` of ``index`` (a slice, or a tuple of slices with step 1) into an array of ``shape``;
    ValueError for any other index (a region must be rectangular)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(axis, slice) for axis in index):
        raise ValueError(f"index {index!r} of a parameter {tuple(shape)} is not a slice per axis")
    index += (slice(None),) * (len(shape) - len(index))
    start, stop = [], []
    for axis, size in zip(index, shape):
        lo, hi, step = axis.indices(size)
        if step != 1 or hi < lo:
            raise ValueError(f"index {axis!r} of a parameter {tuple(shape)} is not a contiguous range")
        start.append(lo)
        stop.append(hi)
    return tuple(start), tuple(stop)


class Placement:
    """The regions of one rank's buffer, in the buffer's order, over ``whole`` (a :class:`Sequential`,
    possibly a map of shapes).

    Args:
        whole: the whole model.
        regions: the :class:`Region` s, contiguous in the rank's buffer from 0.
    """

    def __init__(self, whole, regions):
        self.whole, self.regions = whole, list(regions)
        self.size = sum(region.size for region in self.regions)

    @classmethod
    def of_entries(cls, whole, first, end, writes=True):
        """Entries ``[first, end)`` of ``whole``, each whole, one after the other (a pipeline stage's)."""
        regions, lo = [], 0
        for entry in range(first, end):
            shape = whole.entries[entry][3]
            regions.append(Region(entry, (0,) * len(shape), tuple(shape), lo, writes))
            lo += int(np.prod(shape, dtype=np.int64))
        return cls(whole, regions)

    def within(self, whole, first_entry, writes=True):
        """These regions (over a model that is entries ``first_entry..`` of ``whole``: a stage) as regions of
        ``whole``; ``writes`` False: none written here (a replica that is not the first)."""
        return Placement(
            whole,
            [
                dataclasses.replace(region, entry=region.entry + first_entry, writes=region.writes and writes)
                for region in self.regions
            ],
        )

    def _shape(self, region):
        return tuple(self.whole.entries[region.entry][3])

    def _offset(self, region):
        return int(self.whole.entries[region.entry][2])

    def _elements(self, chunk):
        """``(region, lo, index)`` for pieces of at most ``chunk`` elements: ``index`` (int64) are the places
        in the region's whole parameter (C order) of the buffer's elements ``lo, lo + 1, ...``."""
        for region in self.regions:
            shape = self._shape(region)
            for begin in range(0, region.size, chunk):
                end = min(begin + chunk, region.size)
                if region.shape == shape:  # (a whole parameter: its elements in order)
                    yield region, region.lo + begin, np.arange(begin, end, dtype=np.int64)
                    continue
                coords = np.unravel_index(np.arange(begin, end), region.shape)
                placed = tuple(c + a for c, a in zip(coords, region.start))
                yield region, region.lo + begin, np.ravel_multi_index(placed, shape).astype(np.int64)

    def chunks(self, chunk=CHUNK):
        """``(lo, positions)`` for pieces of at most ``chunk`` elements: ``positions`` (int64) are where the
        buffer's elements ``lo, lo + 1, ...`` sit in the whole model's flat buffer."""
        for region, lo, index in self._elements(chunk):
            yield lo, self._offset(region) + index

    def positions(self):
        """Where each element of the buffer sits in the whole model's flat buffer (int64; for checks and
        tests)."""
        return np.concatenate([positions for _, positions in self.chunks()] + [np.zeros(0, dtype=np.int64)])

    def initial(self, seed, out):
        """Fill ``out`` (host, the rank's buffer) with its initial values (``whole.entry_values`` of each
        region's
        elements: a region is one parameter, so no element's parameter is looked up)."""
        drawn = {}  # (an initialiser of one's own: its parameter drawn whole once)
        for region, lo, index in self._elements(CHUNK):
            out[lo : lo + len(index)] = self.whole.entry_values(seed, region.entry, index, drawn)
        return out

    def take(self, array, out=None):
        """This rank's elements of ``array``, a whole-model flat array (host), in the buffer's order."""
        out = np.empty(self.size, dtype=array.dtype) if out is None else out
        for region in self.regions:
            values = parameter(self.whole, array, region.entry)[region.index]
            out[region.lo : region.lo + region.size] = values.reshape(-1)
        return out

    def pieces(self, array):
        """The elements of ``array`` (the rank's buffer) in the regions this rank writes: views, one a region
        (a file takes them one after the other, with no copy)."""
        return [array[r.lo : r.lo + r.size] for r in self.regions if r.writes]

    def written(self, array):
        """The elements of ``array`` (the rank's buffer) in the regions this rank writes, one after the other:
        one array (a copy where a region between is not written)."""
        kept = self.pieces(array)
        if len(kept) == len(self.regions):
            return array[: self.size]
        return np.concatenate(kept) if kept else array[:0]

    def describe(self):
        """The regions this rank writes as an int64 table: a row per region, ``[entry, size, start...,
        stop...]`` padded to :data:`AXES` axes (-1), to move between ranks without pickle."""
        rows = np.full((sum(r.writes for r in self.regions), COLUMNS), -1, dtype=np.int64)
        for row, region in zip(rows, (r for r in self.regions if r.writes)):
            if len(region.start) > AXES:
                raise ValueError(f"a parameter of {len(region.start)} axes: at most {AXES} are described")
            row[0], row[1] = region.entry, region.size
            row[2 : 2 + len(region.start)] = region.start
            row[2 + AXES : 2 + AXES + len(region.stop)] = region.stop
        return rows

    @staticmethod
    def fill(whole, rows, values, arrays):
        """Place ``values`` (written regions' elements, in ``rows``' order: :meth:`describe` tables one after
        the other) into ``arrays`` (whole-model flat arrays of ``whole``), in place."""
        at = 0
        for row in rows:
            entry, size = int(row[0]), int(row[1])
            ndim = int(np.count_nonzero(row[2 : 2 + AXES] >= 0))
            start, stop = row[2 : 2 + ndim], row[2 + AXES : 2 + AXES + ndim]
            target = parameter(whole, arrays, entry)
            target[tuple(slice(int(a), int(b)) for a, b in zip(start, stop))] = values[
                at : at + size
            ].reshape(tuple(int(b - a) for a, b in zip(start, stop)))
            at += size


def parameter(whole, array, entry):
    """Entry ``entry`` of ``whole`` (a :class:`Sequential`) in ``array``, a flat array of the whole model: a
    view, in the parameter's shape."""
    _, _, offset, shape, _ = whole.entries[entry]
    return array[offset : offset + int(np.prod(shape, dtype=np.int64))].reshape(shape)
