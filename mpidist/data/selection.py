"""The rows a run picks of a split, computed row by row: a split of 10^11 rows costs what is read of it.

A run cuts splits of its own from a file's: ``--val-fraction`` holds out a
validation split from ``train`` (:class:`Carved`: the rows held out, or the
rows kept), ``--eval-samples`` takes evenly spread rows of an evaluated split
(:class:`Strided`).  Each is a sorted selection of the file's rows that
answers, for any of its positions, which row is there (``selection[k]``), and
for any row, how many of its rows come before it (:meth:`~Carved.below`: where
a read's blocks cross the files' boundaries), without a table: each costs the
rows asked about, never the split's size.

The rows held out are drawn block by block: the split's rows are cut into
blocks of :data:`DRAW_ROWS`, block ``b`` holds out ``C(end_b) - C(start_b)`` of
them, ``C(g) = floor(g x held / n)`` (so the blocks hold out ``held`` rows in
all, each its share of them), and which rows a block holds out is drawn by a
keyed permutation of the block (:func:`~mpidist.data.order.permute`, keyed by
``(seed, VAL_SEED, b)``).  Every class of a file sorted by label keeps its
share of the validation split.
"""

import numpy as np

from .lanes import seeds
from .order import permute

VAL_SEED = 0x7661  # mixed into --seed for the carving, so it is not the data order's stream
DRAW_ROWS = 4096  # rows of a block whose rows held out are drawn together
EXACT = 2**50  # quotients below this come exactly from a float's estimate and one correction
PIECE = (
    1 << 16
)  # positions computed at once where many are asked for: the arithmetic's temporaries stay small


def divided(values, times, by):
    """``(floor(values x times / by), the remainder)`` of non-negative int64 ``values`` and Python integers
    ``times`` and ``by > 0``, exact where ``values x times`` passes int64 (10^11 rows times 10^10)."""
    values = np.asarray(values, dtype=np.int64)
    if values.size == 0 or int(values.max()) * times < 2**63:
        return values * times // by, values * times % by
    if int(values.max()) * times // by < EXACT and by < 2**60 and times < 2**63:
        quotient = np.floor(values.astype(np.float64) * (times / by)).astype(np.int64)
        with np.errstate(over="ignore"):  # (the remainder of the estimate, exact modulo 2^64: it is small)
            rest = (
                values.astype(np.uint64) * np.uint64(times) - quotient.astype(np.uint64) * np.uint64(by)
            ).astype(np.int64)
        return quotient + rest // by, rest % by
    pairs = [divmod(value * times, by) for value in values.ravel().tolist()]  # (Python's integers)
    return tuple(np.array(part, dtype=np.int64).reshape(values.shape) for part in zip(*pairs))


class Carved:
    """The rows of a split of ``n`` rows that ``--val-fraction`` holds out (``held_out``), ``held`` of them
    drawn by ``seed``, or the ``n - held`` rows it keeps: a sorted selection, any row computed alone."""

    def __init__(self, n, held, seed, held_out):
        self.n, self.held, self.seed, self.held_out = int(n), int(held), int(seed), bool(held_out)

    def __len__(self):
        return self.held if self.held_out else self.n - self.held

    def _before(self, rows):
        """Rows held out before each of ``rows`` that is a block's first (or ``n``): ``floor(row x held /
        n)``."""
        return divided(rows, self.held, self.n)[0]

    def _drawn(self, blocks):
        """``(blocks, keys)``: the distinct ``blocks`` sorted, and their rows held out, as ``keys``: the rank
        of its block x DRAW_ROWS + its row in the block, sorted (each block's rows held out in turn)."""
        blocks = np.unique(blocks)
        starts = blocks * DRAW_ROWS
        sizes = np.minimum(DRAW_ROWS, self.n - starts)
        counts = self._before(starts + sizes) - self._before(starts)
        offsets = np.cumsum(counts) - counts
        ranks = np.repeat(np.arange(len(blocks), dtype=np.int64), counts)
        places = np.arange(int(counts.sum()), dtype=np.int64) - offsets[ranks]
        keys = seeds(self.seed, VAL_SEED, blocks)[ranks]
        return blocks, np.sort(ranks * DRAW_ROWS + permute(places, sizes[ranks], keys))

    def __getitem__(self, numbers):
        """The split rows at positions ``numbers`` (an int array, each below ``len(self)``) of the
        selection."""
        numbers = np.asarray(numbers, dtype=np.int64)
        if numbers.size == 0:
            return numbers.copy()
        if self.held_out:  # (the block holding the k-th row held out: the first row g with C(g) > k, less 1)
            least, rest = divided(numbers + 1, self.n, self.held)
            block = (least + (rest > 0) - 1) // DRAW_ROWS
            skipped = self._before(block * DRAW_ROWS)
        else:  # (the k-th row kept: rows kept before g are g - C(g))
            block = divided(numbers, self.n, self.n - self.held)[0] // DRAW_ROWS
            skipped = block * DRAW_ROWS - self._before(block * DRAW_ROWS)
        blocks, keys = self._drawn(block)
        rank = np.searchsorted(blocks, block)
        first = np.searchsorted(keys, rank * DRAW_ROWS)
        place = numbers - skipped  # its place among its block's rows of the selection
        if self.held_out:
            return block * DRAW_ROWS + keys[first + place] - rank * DRAW_ROWS
        # the place-th row kept is place + the rows held out at or before it: with v_i the i-th held out,
        # those with v_i - i <= place (v_i - i grows with i)
        shifted = keys - (np.arange(len(keys)) - np.searchsorted(keys, keys // DRAW_ROWS * DRAW_ROWS))
        return block * DRAW_ROWS + place + np.searchsorted(shifted, rank * DRAW_ROWS + place, "right") - first

    def below(self, rows):
        """How many rows of the selection come before each of the file's ``rows`` (an int array)."""
        rows = np.clip(np.asarray(rows, dtype=np.int64), 0, self.n)
        block = np.minimum(rows // DRAW_ROWS, max(0, (self.n - 1) // DRAW_ROWS))
        blocks, keys = self._drawn(block)
        rank = np.searchsorted(blocks, block)
        within = np.searchsorted(keys, rank * DRAW_ROWS + rows - block * DRAW_ROWS) - np.searchsorted(
            keys, rank * DRAW_ROWS
        )
        held = self._before(block * DRAW_ROWS) + within
        return held if self.held_out else rows - held


class Strided:
    """Rows ``0, step, 2 x step, ...`` (``count`` of them) of the selection ``within`` (None: of the file's
    rows)."""

    def __init__(self, count, step, within=None):
        self.count, self.step, self.within = int(count), int(step), within

    def __len__(self):
        return self.count

    def __getitem__(self, numbers):
        """The rows at positions ``numbers`` (an int array, each below ``len(self)``)."""
        rows = np.asarray(numbers, dtype=np.int64) * self.step
        return rows if self.within is None else self.within[rows]

    def below(self, rows):
        """How many rows of the selection come before each of the file's ``rows`` (an int array)."""
        rows = np.asarray(rows, dtype=np.int64)
        inner = np.maximum(rows, 0) if self.within is None else self.within.below(rows)
        return np.minimum(-(-inner // self.step), self.count)
