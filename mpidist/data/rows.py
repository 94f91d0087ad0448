"""One split's rows across a dataset's files: row numbers in, checked samples out, one read call per file
span.

A split's rows are numbered ``0 .. count-1`` over the concatenation of its
files (and, for a split carved by ``--val-fraction``, over the rows chosen for
it).  Readers ask for increasing row numbers; :class:`SplitRows` maps them to
files and reads each file's part in as few HDF5 calls as its pattern allows: a
contiguous or evenly strided part in one, evenly spaced runs of rows (a
training shard's lanes) in one selection of them, scattered rows in 64 MiB
spans.
"""

import contextlib
import errno
import os

import h5py
import numpy as np

from ..runtime.reads import HDF5_ERRORS, read_failure, reading
from ..runtime.whereabouts import here
from .direct import DirectFile, byte_ranges, direct_rows, layout, readable
from .blocks import PIECE
from .samples import prepare
from .sources import CHUNK_CACHE, open_source


SPARSE = 8  # a block of the file is read whole where at least one of this many of its rows is wanted


class SplitRows:
    """The rows of ``split`` of dataset ``info``, read and prepared for a model taking
    ``input_shape``/``dtype``.

    ``direct``: read uncompressed rows around the page cache where the file
    system allows it (a stream's ``--stream-io direct``; see
    :mod:`mpidist.data.direct`).
    """

    def __init__(self, info, split, input_shape, dtype, direct=False):
        self.info, self.split, self.input_shape, self.dtype = info, split, tuple(input_shape), np.dtype(dtype)
        self.direct = direct
        self.group, self.picked = info.rows_of(split)  # a carved split: rows of another one
        self.files, starts, total = [], [], 0
        for member in info.files:
            rows = member.sizes.get(self.group, 0)
            if rows:
                self.files.append(member)
                starts.append(total)
                total += rows
        # each file's first row in the group, and the end
        self.starts = np.array(starts + [total], dtype=np.int64)
        # a file whose compressed chunks are larger than HDF5's chunk cache: opened with a cache of one
        self.cache = {
            member.path: member.span(self.group)
            for member in self.files
            if member.span(self.group) > CHUNK_CACHE
        }
        self.count = total if self.picked is None else len(self.picked)

    def __len__(self):
        return self.count

    def group_rows(self, numbers):
        """The group's (all files') row numbers of split rows ``numbers`` (an int array); a carved split's
        computed :data:`~mpidist.data.blocks.PIECE` at a time."""
        numbers = np.asarray(numbers, dtype=np.int64)
        if self.picked is None or len(numbers) <= PIECE:
            return numbers if self.picked is None else self.picked[numbers]
        rows = np.empty_like(numbers)
        for lo in range(0, len(numbers), PIECE):
            rows[lo : lo + PIECE] = self.picked[numbers[lo : lo + PIECE]]
        return rows

    def read(self, numbers, handles=None):
        """``(x, y)`` of split rows ``numbers`` (increasing), checked and converted.

        ``handles``: a dict of files kept open across calls (a stream's); None opens and closes them here.
        """
        rows = self.group_rows(numbers)
        pieces = []
        for index, member in enumerate(self.files):
            lo, hi = np.searchsorted(rows, self.starts[index : index + 2])
            if hi > lo:
                with contextlib.ExitStack() as opened:  # (one file open at a time, its chunk cache with it)
                    items = self._items(member.path, handles, opened)
                    pieces.append(self._piece(items, member.path, rows[lo:hi] - self.starts[index], handles))
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return self._piece(None, None, rows[:0])
        return np.concatenate([x for x, _ in pieces]), np.concatenate([y for _, y in pieces])

    def advise(self, lo, hi, handles):
        """Tell the kernel rows ``[lo, hi)`` will be read soon (``POSIX_FADV_WILLNEED``): it reads them
        meanwhile.

        h5py holds the GIL while it reads, so a read that waits on the disk
        stalls the training thread's Python too; the hint turns the later read
        into a copy from the page cache.  Files in memory (arrays) and
        systems without the call are left alone.
        """
        if not hasattr(os, "posix_fadvise") or hi <= lo:
            return
        first, last = (int(row) for row in self.group_rows(np.array([lo, hi - 1])))
        last += 1
        for index, member in enumerate(self.files):
            begin, end = max(first, self.starts[index]), min(last, self.starts[index + 1])
            if end <= begin or not isinstance(member.path, os.PathLike):
                continue
            try:
                for item in self._items(member.path, handles, None):
                    fd = self._fd(member.path, handles, item)
                    # (in another file, or read around the cache: no hint)
                    if fd is None or self._direct(item, member.path, handles) is not None:
                        continue
                    for offset, length in byte_ranges(
                        item, int(begin - self.starts[index]), int(end - self.starts[index])
                    ):
                        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except (*HDF5_ERRORS, KeyError):  # a hint only: the read that follows names what fails
                continue

    def _fd(self, path, handles, item):
        """An OS file descriptor of ``path`` kept in ``handles`` (a stream's) to read ``item``'s bytes at the
        offsets HDF5 gives, or None: arrays, no stream, or an ``item`` that lives in another file (reached
        through a link that --allow-external follows: its offsets are that file's)."""
        if handles is None or not isinstance(path, os.PathLike) or item.id.fileno != handles[path].id.fileno:
            return None
        if ("fd", path) not in handles:
            handles["fd", path] = os.open(path, os.O_RDONLY)
        return handles["fd", path]

    def _direct(self, item, path, handles, name=None):
        """The :class:`DirectFile` reading dataset ``item`` (``name``, where the caller knows it) of ``path``,
        kept in ``handles``; None where not direct.

        One per dataset: a read returns a view of its buffer, and a block's
        ``x`` and ``y`` are read before either is used.
        """
        if not self.direct or handles is None or not isinstance(path, os.PathLike):
            return None
        key = ("direct", path, name or item.name)
        if key not in handles and not readable(item):
            handles[key] = None
        if key not in handles:
            try:
                handles[key] = DirectFile(path)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                handles[key] = None  # the file system does not allow it: read through the cache
        return handles[key]

    def _items(self, path, handles, opened):
        """``(x, y)`` of this split's group in file ``path``: from ``handles`` (opened into it on first use),
        or opened for this call (``opened``)."""
        # (checked when the run began, the file is opened again for each read or epoch: it may have changed)
        with reading(f"{path}: {self.group}/x and {self.group}/y", errors=(*HDF5_ERRORS, KeyError)):
            cache = self.cache.get(path, 0)
            if handles is None:
                handle = opened.enter_context(open_source(path, cache))
                return handle[f"{self.group}/x"], handle[f"{self.group}/y"]
            if (path, self.group) not in handles:
                if path not in handles:
                    if cache:  # one such file open at a time: its cache holds a chunk as long as it is open
                        self._let_go(handles.pop(("cached",), None), handles)
                        handles[("cached",)] = path
                    handles[path] = open_source(path, cache)
                handles[path, self.group] = handles[path][f"{self.group}/x"], handles[path][f"{self.group}/y"]
            return handles[path, self.group]

    def _let_go(self, path, handles):
        """Close file ``path`` of ``handles`` (None: nothing to close), with its datasets and their caches."""
        if path is not None:
            for key in [
                key for key in handles if isinstance(key, tuple) and len(key) == 2 and key[0] == path
            ]:
                del handles[key]
            handles.pop(path).close()

    def _piece(self, items, path, local, handles=None):
        """Rows ``local`` of one file, read in one call where they are evenly spaced.

        ``handles``: a stream's open files, to read consecutive rows of uncompressed data with
        :func:`direct_rows`."""
        where = f"{path}: {self.group}"
        if items is None:  # no rows: empty arrays of the right shapes
            x = np.empty((0,) + tuple(self.info.sample_shape))
            y = np.empty((0,) if self.info.target_width == 1 else (0, self.info.target_width))
            return prepare(x, y, self.info, where, local, self.input_shape, self.dtype)
        with here().doing("io", f"reading {where}"):
            read = []
            step = int(local[1] - local[0]) if len(local) > 1 else 1
            even = (
                step > 0
                and local[-1] - local[0] == step * (len(local) - 1)
                and (np.diff(local) == step).all()
            )
            runs = None if even else regular_runs(local)
            for key, item in zip("xy", items):
                try:
                    if even:
                        read.append(
                            self._read_span(
                                item,
                                slice(int(local[0]), int(local[-1]) + 1, step),
                                path,
                                handles,
                                f"/{self.group}/{key}",
                            )
                        )
                    else:
                        read.append(read_runs(item, local, runs) if runs else read_rows(item, local))
                except HDF5_ERRORS as error:
                    raise read_failure(error, f"{where}/{key}", failing_rows(item, local)) from None
        return prepare(*read, self.info, where, local, self.input_shape, self.dtype)

    def _read_span(self, item, span, path, handles, name):
        """Rows ``span`` of ``item`` (``name`` in its file): straight from the file where :func:`direct_rows`
        can, else through h5py."""
        if span.step != 1:
            return item[span]
        fd = self._fd(path, handles, item)
        direct = self._direct(item, path, handles, name) if fd is not None else None
        known = None
        if fd is not None:  # (a stream's: what the reads ask of the dataset, kept with its open files)
            known = handles.get(("layout", path, name)) or handles.setdefault(
                ("layout", path, name), layout(item)
            )
        try:
            got = direct_rows(item, span.start, span.stop, fd, path, direct, known)
        # O_DIRECT opened but refused to read (an unusual block size): cached from now
        except OSError as error:
            if direct is None or error.errno != errno.EINVAL:
                raise
            direct.close()
            handles["direct", path, name] = None
            got = direct_rows(item, span.start, span.stop, fd, path)
        return item[span] if got is None else got


def regular_runs(numbers):
    """``(head, start, stride, count, length, tail)`` where increasing ``numbers`` are a run of ``head`` rows,
    ``count`` runs of ``length`` consecutive rows ``stride`` apart from row ``start``, and a run of ``tail``
    rows (a training shard's lanes in a file: rows ``q * B + l`` of lanes ``l`` in ``[first, first +
    count)``); None where they are not (or where that is not worth it: fewer than three runs)."""
    numbers = np.asarray(numbers, dtype=np.int64)
    cuts = np.flatnonzero(np.diff(numbers) != 1) + 1
    if len(cuts) < 2:
        return None
    firsts = numbers[np.concatenate([[0], cuts])]
    lengths = np.diff(np.concatenate([[0], cuts, [len(numbers)]]))
    middle, gaps = lengths[1:-1], np.diff(firsts[1:-1])
    if (middle != middle[0]).any() or (len(gaps) and (gaps != gaps[0]).any()):
        return None
    stride = int(gaps[0]) if len(gaps) else int(middle[0])
    return int(lengths[0]), int(firsts[1]), stride, len(middle), int(middle[0]), int(lengths[-1])


def read_runs(item, numbers, runs):
    """Rows ``numbers`` of the HDF5 dataset ``item``, :func:`regular_runs` ``runs`` of them: the regular runs
    in one HDF5 read of a strided selection of blocks, so only those rows' bytes are read."""
    head, start, stride, count, length, tail = runs
    out = np.empty((len(numbers),) + item.shape[1:], dtype=item.dtype)
    out[:head] = item[int(numbers[0]) : int(numbers[0]) + head]
    middle = out[head : head + count * length]
    if isinstance(item, np.ndarray) or not hasattr(item, "id"):  # (arrays: no selection to make)
        middle[...] = item[numbers[head : head + count * length]]
    else:
        extra = len(item.shape) - 1
        space = item.id.get_space()
        space.select_hyperslab(
            (start,) + (0,) * extra,
            (count,) + (1,) * extra,
            stride=(stride,) + (1,) * extra,
            block=(length,) + tuple(item.shape[1:]),
        )
        item.id.read(h5py.h5s.create_simple(middle.shape), space, middle)
    out[len(numbers) - tail :] = item[int(numbers[-tail]) : int(numbers[-1]) + 1]
    return out


def read_rows(item, numbers, block_bytes=64 << 20):
    """Rows ``numbers`` (increasing) of the HDF5 dataset ``item``, a block of the file (64 MiB) at a time: the
    block from the next row wanted, read whole where at least one of its :data:`SPARSE` rows is wanted, else
    only the rows wanted (a split carved from a large one: the reads follow the rows, not the file)."""
    out = np.empty((len(numbers),) + item.shape[1:], dtype=item.dtype)
    block = max(1, block_bytes // max(out[:1].nbytes, 1))
    done = 0
    while done < len(numbers):
        first = int(numbers[done])
        upto = int(np.searchsorted(numbers, first + block))
        span = int(numbers[upto - 1]) + 1 - first
        if (upto - done) * SPARSE >= span:
            out[done:upto] = item[first : first + span][numbers[done:upto] - first]
        else:  # (one selection of the rows wanted: HDF5 reads those, each chunk once)
            out[done:upto] = item[numbers[done:upto]]
        done = upto
    return out


def failing_rows(item, local, most=4096):
    """``"at samples A..B"``: the rows of ``local`` in the first chunk of HDF5 dataset ``item`` that cannot be
    read alone (a chunk its filter cannot decode), or all of ``local`` where none fails alone, ``item`` is not
    chunked, or it spans more than ``most`` chunks (tried one by one only once a read has failed)."""
    chunk = (getattr(item, "chunks", None) or (0,))[0]
    whole = f"at samples {int(local[0])}..{int(local[-1])}"
    if not chunk or (int(local[-1]) - int(local[0])) // chunk > most:
        return whole
    for lo in range(int(local[0]) // chunk * chunk, int(local[-1]) + 1, chunk):
        inside = local[(local >= lo) & (local < lo + chunk)]
        if len(inside):
            try:
                item[int(inside[0]) : int(inside[-1]) + 1]
            except HDF5_ERRORS:
                return f"at samples {int(inside[0])}..{int(inside[-1])}"
    return whole
