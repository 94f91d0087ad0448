"""HDF5 datasets whose bytes the system writes, not h5py: a checkpoint written behind training.

h5py holds Python's global lock for the whole of a write (measured here: a
thread writing an 8 MB checkpoint with h5py made the training thread's
Python 2.2 times slower, and itself 30 times slower).  So the file's
structure (groups, attributes, one contiguous dataset per array, its space
allocated at once and never filled) is made with h5py, which is quick, and
the arrays' bytes go to their datasets' offsets by ``os.pwrite``, which lets
go of the lock.  The file is an ordinary HDF5 file: any reader reads it.
"""

import os

import h5py
import numpy as np


def allocate(group, name, array, places):
    """An empty contiguous dataset in ``group`` for ``array``, its space allocated; ``(offset, array)`` to ``places``."""
    array = np.ascontiguousarray(array)
    properties = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    properties.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    properties.set_fill_time(h5py.h5d.FILL_TIME_NEVER)   # (the bytes come next: no zeros written first)
    dataset = h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(array.dtype),
                              h5py.h5s.create_simple(array.shape), dcpl=properties)
    offset = dataset.get_offset()
    if array.nbytes:
        places.append((offset, array))


def fill(path, places):
    """Write each ``(offset, array)`` of ``places`` into the closed file ``path`` (an ``OSError`` as the system says)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, array in places:
            view = memoryview(array).cast("B")
            done = 0
            while done < len(view):   # (a write may take part of the bytes)
                done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)
