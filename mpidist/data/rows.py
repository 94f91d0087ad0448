"""One split's rows across a dataset's files: row numbers in, checked samples out, one read call per file span.

A split's rows are numbered ``0 .. count-1`` over the concatenation of its
files (and, for a split carved by ``--val-fraction``, over the rows chosen for
it).  Readers ask for increasing row numbers; :class:`SplitRows` maps them to
files and reads each file's part in as few HDF5 calls as its pattern allows: a
contiguous or evenly strided part in one, scattered rows in 64 MiB spans.
"""

import contextlib

import numpy as np

from ..whereabouts import here
from .layout import open_source
from .samples import prepare


class SplitRows:
    """The rows of ``split`` of dataset ``info``, read and prepared for a model taking ``input_shape``/``dtype``."""

    def __init__(self, info, split, input_shape, dtype):
        self.info, self.split, self.input_shape, self.dtype = info, split, tuple(input_shape), np.dtype(dtype)
        self.group, self.picked = info.rows_of(split)   # a carved split: rows of another one
        self.files, starts, total = [], [], 0
        for member in info.files:
            rows = member.sizes.get(self.group, 0)
            if rows:
                self.files.append(member)
                starts.append(total)
                total += rows
        self.starts = np.array(starts + [total], dtype=np.int64)   # each file's first row in the group, and the end
        self.count = total if self.picked is None else len(self.picked)

    def __len__(self):
        return self.count

    def group_rows(self, numbers):
        """The group's (all files') row numbers of split rows ``numbers``."""
        return np.asarray(numbers, dtype=np.int64) if self.picked is None else self.picked[numbers]

    def read(self, numbers, handles=None):
        """``(x, y)`` of split rows ``numbers`` (increasing), checked and converted.

        ``handles``: a dict of files kept open across calls (a stream's); None opens and closes them here.
        """
        rows = self.group_rows(numbers)
        pieces = []
        with contextlib.ExitStack() as opened:
            for index, member in enumerate(self.files):
                lo, hi = np.searchsorted(rows, self.starts[index:index + 2])
                if hi > lo:
                    handle = _handle(member.path, handles, opened)
                    pieces.append(self._piece(handle, member.path, rows[lo:hi] - self.starts[index]))
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return self._piece(None, None, rows[:0])
        return np.concatenate([x for x, _ in pieces]), np.concatenate([y for _, y in pieces])

    def _piece(self, handle, path, local):
        """Rows ``local`` of one file, read in one call where they are evenly spaced."""
        where = f"{path}: {self.group}"
        if handle is None:   # no rows: empty arrays of the right shapes
            x = np.empty((0,) + tuple(self.info.sample_shape))
            y = np.empty((0,) if self.info.num_classes or self.info.target_width == 1 else (0, self.info.target_width))
            return prepare(x, y, self.info, where, local, self.input_shape, self.dtype)
        with here().doing("io", f"reading {where}"):
            x, y = handle[f"{self.group}/x"], handle[f"{self.group}/y"]
            step = int(local[1] - local[0]) if len(local) > 1 else 1
            if step > 0 and local[-1] - local[0] == step * (len(local) - 1) and (np.diff(local) == step).all():
                span = slice(int(local[0]), int(local[-1]) + 1, step)
                x, y = x[span], y[span]
            else:
                x, y = read_rows(x, local), read_rows(y, local)
        return prepare(x, y, self.info, where, local, self.input_shape, self.dtype)


def _handle(path, handles, opened):
    """An open file for ``path``: from ``handles`` (opened into it on first use), or opened for this call."""
    if handles is None:
        return opened.enter_context(open_source(path))
    if path not in handles:
        handles[path] = open_source(path)
    return handles[path]


def read_rows(item, numbers, block_bytes=64 << 20):
    """Rows ``numbers`` (increasing) of the HDF5 dataset ``item``, read a block of the file (64 MiB) at a time."""
    out = np.empty((len(numbers),) + item.shape[1:], dtype=item.dtype)
    block = max(1, block_bytes // max(out[:1].nbytes, 1))
    done = 0
    for lo in range(int(numbers[0]) if len(numbers) else 0, item.shape[0], block):
        upto = int(np.searchsorted(numbers, lo + block))
        if upto > done:
            out[done:upto] = item[lo:min(lo + block, item.shape[0])][numbers[done:upto] - lo]
            done = upto
        if done == len(numbers):
            break
    return out
