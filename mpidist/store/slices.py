"""One rank's slices of a checkpoint, read as hyperslabs of its flat arrays: never the whole model.

A rank that resumes a split model (a pipeline stage, a tensor part) needs
its placement's regions of the checkpoint's ``params`` and optimizer arrays
and nothing else.  Each region is a rectangle of one parameter, which is one
strided selection of the flat array (:func:`~mpidist.store.sharded.flat_selection`);
HDF5 reads just those elements, from the file itself (format 1) or, through
the index's virtual datasets, from the parts that hold them (format 2), into
the rank's buffer order.  Values are converted to the run's dtype as they
are read.

The placement is any object with ``regions`` (``entry``, ``start``,
``stop``, ``lo``, ``size``), ``size`` and ``whole.entries`` (the whole
model's ``(layer, name, offset, shape, ...)``): :class:`mpidist.nn.placement.Placement`.
"""

import h5py
import numpy as np

from .sharded import flat_selection


def read(dataset, placement, dtype, out=None):
    """``placement``'s elements of ``dataset`` (an open 1-D h5py dataset of the whole model), in its buffer
    order, as ``dtype``, or into ``out`` (a contiguous host array of ``placement.size``, in its own dtype)."""
    out = np.empty(placement.size, dtype=dtype) if out is None else out
    for region in placement.regions:
        if region.size == 0:
            continue
        _, _, offset, shape, *_ = placement.whole.entries[region.entry]
        space = dataset.id.get_space()
        space.select_none()
        flat_selection(
            space, int(offset), tuple(int(n) for n in shape), list(region.start), list(region.stop)
        )
        memory = h5py.h5s.create_simple((region.size,))
        dataset.id.read(memory, space, out[region.lo : region.lo + region.size])
    return out
