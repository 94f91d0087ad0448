"""HDF5 datasets whose bytes the system writes, not h5py: checkpoints written behind training.

Two costs of writing a checkpoint are not the disk's, and both fall on training:

* h5py holds Python's global lock for the whole of a write (measured here: a
  thread writing an 8 MB checkpoint with h5py made the training thread's
  Python 2.2 times slower).  So the file's structure (groups, attributes, one
  contiguous dataset per array, its space allocated at once and never
  filled) is made with h5py, which is quick, and the arrays' bytes go to
  their datasets' offsets by ``os.pwrite``, which lets go of the lock.
* Through the page cache, a new file's 8 MB and its ``fsync`` cost the CPU
  21 ms of kernel time (copy, page-cache fill, writeback), three times the
  write itself; written around the cache (``O_DIRECT``: the disk takes the
  bytes from the arrays by DMA) they cost 0.5 ms.  So each dataset starts on
  a page (the file's alignment is set for it), and an array whose memory
  starts on a page too (:func:`aligned_empty`: the staging arrays of a write
  behind) goes by ``O_DIRECT`` in whole pages, its last part through the cache.
  Where the file system refuses ``O_DIRECT`` (tmpfs), everything goes through the cache.

The file is an ordinary HDF5 file: any reader reads it.
"""

import errno
import os

import h5py
import numpy as np

from ..runtime import aligned
from . import new_hdf5

PAGE = 4096  # what O_DIRECT asks of offsets, lengths and memory: a page, the largest logical block in use
# datasets at least this large start on a page (small ones are packed as h5py packs them)
ALIGNED_FROM = 1 << 16


def open_aligned(path):
    """A new HDF5 file at ``path`` whose large datasets start on a page."""
    return new_hdf5.created(path, alignment_threshold=ALIGNED_FROM, alignment_interval=PAGE)


def aligned_empty(shape, dtype):
    """An uninitialised array whose memory starts on a page (so it can be written around the cache)."""
    return aligned.empty(np, shape, dtype, alignment=PAGE)


def allocate(group, name, array, places):
    """An empty contiguous dataset in ``group`` for ``array``, its space allocated; ``(offset, array)`` into
    ``places``."""
    array = np.ascontiguousarray(array)
    properties = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    properties.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    properties.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # (the bytes come next: no zeros written first)
    dataset = h5py.h5d.create(
        group.id,
        name.encode(),
        h5py.h5t.py_create(array.dtype),
        h5py.h5s.create_simple(array.shape),
        dcpl=properties,
    )
    offset = dataset.get_offset()
    if array.nbytes:
        places.append((offset, array))


def fill(path, places):
    """Write each ``(offset, array)`` of ``places`` into the closed file ``path``; a failure is the system's
    ``OSError``."""
    fd = os.open(path, os.O_WRONLY)
    direct = _direct(path) if any(_pages(offset, array) for offset, array in places) else None
    try:
        for offset, array in places:
            view = memoryview(array).cast("B")
            done = _pages(offset, array) if direct is not None else 0
            if done:
                try:
                    _write(direct, view[:done], offset)
                except OSError as error:  # (opened, but refused: an unusual block size) through the cache
                    if error.errno != errno.EINVAL:
                        raise
                    done = 0
            _write(fd, view[done:], offset + done)
    finally:
        os.close(fd)
        if direct is not None:
            os.close(direct)


def _pages(offset, array):
    """Bytes of ``array`` (to go at ``offset``) that can be written around the cache: its whole pages, or
    0."""
    if offset % PAGE or array.ctypes.data % PAGE:
        return 0
    return array.nbytes - array.nbytes % PAGE


def _direct(path):
    """A descriptor of ``path`` that writes around the page cache, or None where the file system refuses."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return None


def _write(fd, view, offset):
    done = 0
    while done < len(view):  # (a write may take part of the bytes)
        done += os.pwrite(fd, view[done:], offset + done)
