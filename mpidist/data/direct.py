"""Reading a stream's blocks around h5py where it pays: readahead hints, and uncompressed rows read with ``preadv``.

h5py holds the GIL while it reads, so every block a stream reads in its
background thread also stops the training thread's Python for as long as
the read takes (a disk's latency, on a cold page cache).  Two things avoid it:

* :func:`byte_ranges` gives where a block's rows lie in the file, so the
  stream can ask the kernel to read them ahead (``POSIX_FADV_WILLNEED``);
* :func:`direct_rows` reads consecutive rows of an uncompressed dataset
  (contiguous, or chunked by rows) straight from the file with ``os.preadv``,
  which releases the GIL.  HDF5 still says where the bytes are; anything else
  (compression, chunks across the sample axes, chunks never written) is read
  by h5py as before.
"""

import os

import numpy as np

from ..errors import UsageError


def byte_ranges(item, lo, hi):
    """``(offset, length)`` in its file of rows ``[lo, hi)`` of HDF5 dataset ``item``: its chunks, or its one extent."""
    dsid = item.id
    if item.chunks is None:
        offset = dsid.get_offset()
        if offset is None:          # never written: nothing on disk
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


def direct_rows(item, lo, hi, fd, path=""):
    """Rows ``[lo, hi)`` of dataset ``item`` read from file descriptor ``fd`` with ``preadv``; None where h5py must.

    The rows of an uncompressed dataset stored whole (contiguous) or in
    chunks of whole samples lie in the file as C arrays, a chunk's rows one
    after the other, so each chunk's part is one span of bytes.
    """
    if fd is None or hi <= lo or item.dtype.kind not in "biuf" or item.id.get_create_plist().get_nfilters():
        return None
    if item.chunks is not None and tuple(item.chunks[1:]) != tuple(item.shape[1:]):
        return None
    row = _row_bytes(item)
    spans = []     # (offset in the file, offset in the rows, bytes)
    if item.chunks is None:
        offset = item.id.get_offset()
        if offset is None:
            return None
        spans.append((offset + lo * row, 0, (hi - lo) * row))
    else:
        step = item.chunks[0]
        for start in range(lo - lo % step, hi, step):
            info = item.id.get_chunk_info_by_coord((start,) + (0,) * (item.ndim - 1))
            if info.byte_offset is None:    # a chunk never written reads as the fill value: h5py knows it
                return None
            first, last = max(lo, start), min(hi, start + step)
            span = (info.byte_offset + (first - start) * row, (first - lo) * row, (last - first) * row)
            if spans and spans[-1][0] + spans[-1][2] == span[0]:     # chunks one after the other: one read
                spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + span[2])
            else:
                spans.append(span)
    out = np.empty((hi - lo,) + tuple(item.shape[1:]), dtype=item.dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    for offset, at, length in spans:
        got = os.preadv(fd, [view[at:at + length]], offset)
        if got != length:
            raise UsageError(f"{path}: {item.name} ends before its data does (read {got} of {length} bytes at "
                             f"{offset}): the file is truncated")
    return out
