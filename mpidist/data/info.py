"""What a checked dataset is (:class:`DatasetInfo`, one :class:`Member` per file), and the splits a run makes
of it.

:func:`mpidist.data.layout.inspect` makes a :class:`DatasetInfo` from a file
or a directory of files, every item checked; everything after reads the
record, not the file.  A run's own cuts of a split (a validation split carved
from ``train`` by ``--val-fraction``, evaluations limited by
``--eval-samples``) are new records of the same dataset, picking rows, so
they sit beside the record rather than among the file's checks.
"""

import dataclasses
import math
from pathlib import Path

from ..runtime.errors import UsageError
from .selection import Carved, Strided
from .sources import CHUNK_CACHE


@dataclasses.dataclass(frozen=True)
class Member:
    """One file of a dataset: its rows per split, and how its ``x`` is stored (for reads aligned to its
    chunks)."""

    path: object  # a Path, or the ArrayData given in Python
    sizes: dict  # split -> rows in this file
    chunk_rows: dict  # split -> rows per HDF5 chunk of x (1 where x is not chunked)
    row_bytes: dict  # split -> bytes of one sample of x as stored
    #: split -> (x, y): bytes HDF5 decompresses to read any row of a compressed chunk (a chunk's rows, all
    #: their values), 0 where the item is not compressed
    spans: dict = dataclasses.field(default_factory=dict)

    def span(self, group):
        """Bytes of the larger of ``group``'s x and y decompressed chunk spans (0: neither is compressed)."""
        return max(self.spans.get(group, (0, 0)))

    def cache_bytes(self, group):
        """Bytes reading ``group`` holds for compressed chunks larger than HDF5's cache (0: none): a chunk
        span of x and of y decompressed, and the compressed one being read (as large, for data that does not
        compress)."""
        spans = self.spans.get(group, (0, 0))
        return sum(spans) + max(spans) if max(spans) > CHUNK_CACHE else 0


@dataclasses.dataclass
class DatasetInfo:
    """What a dataset file declares, checked against the layout."""

    path: Path  # or the ArrayData given in Python
    name: str
    num_classes: int
    source: str
    sample_shape: tuple
    sizes: dict  # split -> number of samples
    #: values of ``y`` per sample: regression targets, or class labels (``L`` for labels ``(N, L)``, one per
    #: position)
    target_width: int = 1
    #: standardisation statistics where the file has them (float64 arrays of the sample shape):
    #: :class:`Shard` returns ``(x - mean) / std``
    mean: object = dataclasses.field(default=None, repr=False, compare=False)
    std: object = dataclasses.field(default=None, repr=False, compare=False)
    #: one name per class, control characters escaped, where the file names them
    class_names: tuple = None
    feature_names: tuple = None  # a CSV header's names of a sample's values as stored (unescaped), or None
    #: splits carved out of another (``--val-fraction``, ``--eval-samples``): name -> (the file's split, its
    #: rows: a :mod:`~mpidist.data.selection` computing them as they are read)
    carved: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: the files, in order (one for a single file): a split's rows are theirs, concatenated
    files: tuple = dataclasses.field(default=(), repr=False, compare=False)
    #: a split that ``--eval-samples`` limited: name -> the rows it has without the limit
    limited: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def rows_of(self, split):
        """``(the file's split, its rows (a :mod:`~mpidist.data.selection`), or None for all)`` that make up
        ``split``."""
        return self.carved.get(split, (split, None))

    @property
    def target_shape(self):
        """One sample's ``y`` as read: ``()`` for a class label, ``(L,)`` for one per position, ``(W,)`` for
        targets."""
        return () if self.num_classes > 0 and self.target_width == 1 else (self.target_width,)

    @property
    def outputs(self):
        """Model outputs: one per class, or the target width for regression."""
        return self.num_classes if self.num_classes > 0 else self.target_width


def carve_validation(info, fraction, seed):
    """``info`` with a ``val`` split of ``ceil(fraction x train)`` rows carved from ``train``, chosen by
    ``seed``.

    The rows are drawn block by block (:class:`~mpidist.data.selection.Carved`,
    keyed by ``(seed, VAL_SEED)``): the same split on every rank and in every
    resumed run with the same seed; ``train`` keeps the others.  Both keep
    file order, and both are computed row by row as they are read: nothing
    here grows with the split.
    """
    n = info.sizes["train"]
    count = math.ceil(fraction * n)
    if "val" in info.sizes:
        raise UsageError(
            f"--val-fraction {fraction}: dataset {info.name!r} ({info.path}) has a val/ split of "
            "its own, used for validation; drop --val-fraction"
        )
    if not 0 < count < n:
        raise UsageError(
            f"--val-fraction {fraction} of the {n} training samples leaves "
            f"{'no validation samples' if count == 0 else 'no training samples'}"
        )
    carved = {
        "train": ("train", Carved(n, count, seed, held_out=False)),
        "val": ("train", Carved(n, count, seed, held_out=True)),
    }
    sizes = dict(info.sizes, train=n - count, val=count)
    return dataclasses.replace(info, sizes=sizes, carved=carved)


def limit_evaluation(info, samples, splits=("test", "val")):
    """``info`` with each of ``splits`` longer than ``samples`` rows cut to ``samples`` evenly spread ones.

    Rows ``0, s, 2s, ...`` with ``s = rows // samples``: the same subset every
    time (it depends on nothing but the split's length), spread over the whole
    split (a file sorted by class keeps every class), and one evenly strided
    read per file.  A split carved by ``--val-fraction`` is cut among its own
    rows.  Computed row by row as they are read (:class:`~mpidist.data.selection.Strided`).
    """
    carved, sizes, limited = dict(info.carved), dict(info.sizes), dict(info.limited)
    for split in splits:
        rows = sizes.get(split, 0)
        if not samples or rows <= samples:
            continue
        group, picked = info.rows_of(split)
        carved[split] = (group, Strided(samples, rows // samples, picked))
        sizes[split], limited[split] = samples, limited.get(split, rows)
    return dataclasses.replace(info, sizes=sizes, carved=carved, limited=limited)
