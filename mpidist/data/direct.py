"""Reading a stream's blocks around h5py where it pays: uncompressed rows read with ``preadv``, around the
page cache.

h5py holds the GIL while it reads, so every block a stream reads in its
background thread also stops the training thread's Python for as long as
the read takes (a disk's latency, on a cold page cache).  So:

* :func:`direct_rows` reads consecutive rows of an uncompressed dataset
  (contiguous, or chunked by rows) straight from the file with ``os.preadv``,
  which releases the GIL.  HDF5 still says where the bytes are; anything else
  (compression, chunks across the sample axes, chunks never written) is read
  by h5py as before.
* With a :class:`DirectFile` (``--stream-io direct``) those reads bypass the
  page cache (``O_DIRECT``): the disk writes the bytes into an aligned buffer
  by DMA, where a cached read costs the CPU a page-cache fill and a copy,
  about half the reading thread's time, taken from training on a busy node.
  A stream reads each sample once an epoch, from a dataset too large to be
  held anyway, so the cache would only evict other pages.
* Otherwise :func:`byte_ranges` gives where a block's rows lie in the file,
  so the stream can ask the kernel to read them ahead
  (``POSIX_FADV_WILLNEED``).
"""

import errno
import mmap
import os

import numpy as np

from ..runtime.errors import UsageError


def byte_ranges(item, lo, hi):
    """``(offset, length)`` in its file of rows ``[lo, hi)`` of HDF5 dataset ``item``: its chunks, or its one
    extent."""
    dsid = item.id
    if item.chunks is None:
        offset = dsid.get_offset()
        if offset is None:  # never written: nothing on disk
            return []
        return [(offset + lo * _row_bytes(item), (hi - lo) * _row_bytes(item))]
    ranges, step = [], item.chunks[0]
    for start in range(lo - lo % step, hi, step):
        info = dsid.get_chunk_info_by_coord((start,) + (0,) * (item.ndim - 1))
        if info.byte_offset is not None:
            ranges.append((info.byte_offset, info.size))
    return ranges


def _row_bytes(item):
    return item.dtype.itemsize * int(np.prod(item.shape[1:], dtype=np.int64))


ALIGN = 4096  # what O_DIRECT asks of offsets, lengths and buffers: a page, the largest logical block in use


class DirectFile:
    """A file opened to be read around the page cache (``O_DIRECT``), with an aligned buffer it reuses.

    Raises OSError where the system or the file system does not allow it
    (``O_DIRECT`` unknown, or EINVAL on opening): read it cached then.
    """

    def __init__(self, path):
        if not hasattr(os, "O_DIRECT"):
            raise OSError(errno.EINVAL, "O_DIRECT is not available here", str(path))
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.buffer = None

    def read(self, offset, length):
        """``length`` bytes at ``offset``, as a view of the buffer: valid until the next read.

        The read covers whole pages around them; fewer bytes than asked
        (the file ends first) return the shorter view.
        """
        start = offset - offset % ALIGN
        stop = -(-(offset + length) // ALIGN) * ALIGN
        if self.buffer is None or len(self.buffer) < stop - start:
            # (a read of an eighth of a huge page or more gets a whole one: a 1 MiB read into it cost 0.045 ms
            # of CPU per MiB, into small pages 0.109)
            self.buffer = _aligned(max(stop - start, HUGE_PAGE if stop - start >= HUGE_PAGE // 8 else 0))
        got = os.preadv(self.fd, [memoryview(self.buffer)[: stop - start]], start)
        return memoryview(self.buffer)[offset - start : min(got, offset - start + length)]

    def close(self):
        os.close(self.fd)
        self.buffer = None


HUGE_PAGE = 2 << 20


def _aligned(size):
    """A zeroed byte array of ``size`` starting at a multiple of :data:`ALIGN`, in huge pages where it can be.

    An O_DIRECT read is split into requests of at most a few hundred
    physically contiguous segments: into 4 KiB pages a 4 MiB read is five
    requests and a thousand pages pinned, into 2 MiB pages one request and
    two (measured on a virtio disk with both cores busy: 3.4 GB/s and 0.01 ms
    of CPU per MiB, against 1.1 GB/s and 0.065 ms).  So a buffer of a huge
    page or more is anonymous private memory asked for with ``MADV_HUGEPAGE``
    (Linux's ``madvise`` mode gives huge pages only to regions that ask),
    aligned to :data:`HUGE_PAGE`; a smaller one, or one where the call does
    not exist, is a numpy array.  Views of the array keep it alive.
    """
    if size < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        raw, align = np.zeros(size + ALIGN, dtype=np.uint8), ALIGN
    else:
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small pages, still aligned
            pass
        raw, align = np.frombuffer(region, dtype=np.uint8), HUGE_PAGE
    skip = -raw.ctypes.data % align
    return raw[skip : skip + size]


def readable(item):
    """Whether :func:`direct_rows` reads HDF5 dataset ``item``: numbers, unfiltered, contiguous or chunked by
    rows."""
    if item.dtype.kind not in "biuf" or item.id.get_create_plist().get_nfilters():
        return False
    return item.chunks is None or tuple(item.chunks[1:]) == tuple(item.shape[1:])


def layout(item):
    """``(readable, bytes of a row, rows of a chunk or None, dimensions, shape, dtype)`` of HDF5 dataset
    ``item``: what :func:`direct_rows` asks of it each read, which a stream keeps (h5py's answers cost
    microseconds each)."""
    chunks = item.chunks
    return readable(item), _row_bytes(item), chunks[0] if chunks else None, item.ndim, item.shape, item.dtype


def direct_rows(item, lo, hi, fd, path="", direct=None, known=None):
    """Rows ``[lo, hi)`` of dataset ``item`` read from file descriptor ``fd`` with ``preadv``; None where h5py
    must.

    The rows of an uncompressed dataset stored whole (contiguous) or in
    chunks of whole samples lie in the file as C arrays, a chunk's rows one
    after the other, so each chunk's part is one span of bytes.  With
    ``direct`` (a :class:`DirectFile` of the same file) rows in one span come
    back as a view of its buffer, valid until its next read: use them first.
    ``known``: ``item``'s :func:`layout`, where the caller keeps it.
    """
    if fd is None or hi <= lo:
        return None
    can, row, step, ndim, shape, dtype = known or layout(item)
    if not can:
        return None
    spans = []  # (offset in the file, offset in the rows, bytes)
    if step is None:
        offset = item.id.get_offset()
        if offset is None:
            return None
        spans.append((offset + lo * row, 0, (hi - lo) * row))
    else:
        for start in range(lo - lo % step, hi, step):
            info = item.id.get_chunk_info_by_coord((start,) + (0,) * (ndim - 1))
            if info.byte_offset is None:  # a chunk never written reads as the fill value: h5py knows it
                return None
            first, last = max(lo, start), min(hi, start + step)
            span = (info.byte_offset + (first - start) * row, (first - lo) * row, (last - first) * row)
            if spans and spans[-1][0] + spans[-1][2] == span[0]:  # chunks one after the other: one read
                spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + span[2])
            else:
                spans.append(span)
    shape = (hi - lo,) + tuple(shape[1:])
    if direct is not None and len(spans) == 1:
        got = direct.read(spans[0][0], spans[0][2])
        _check_length(len(got), spans[0], item, path)
        return np.frombuffer(got, dtype=dtype).reshape(shape)
    out = np.empty(shape, dtype=dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    for span in spans:
        offset, at, length = span
        if direct is not None:
            got = direct.read(offset, length)
            view[at : at + len(got)] = got
            got = len(got)
        else:
            got = os.preadv(fd, [view[at : at + length]], offset)
        _check_length(got, span, item, path)
    return out


def _check_length(got, span, item, path):
    offset, _, length = span
    if got != length:
        raise UsageError(
            f"{path}: {item.name} ends before its data does (read {got} of {length} bytes at "
            f"{offset}): the file is truncated"
        )
