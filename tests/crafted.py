"""Files crafted as a hostile user would: items that read another file's bytes, a checkpoint's parts recorded
anew after they were changed (issue 61, item 5).  Shared by the tests of datasets, single-file checkpoints,
sharded ones and the fault catalogue."""

import json

import h5py
import numpy as np

MARKER = 4242.0  # what every file outside holds: a value no check lets through


def external_storage(name):
    """A change that makes item ``name`` keep its values in the raw file ``raw`` (HDF5's external storage)."""

    def change(handle, raw, other):
        shape = handle[name].shape
        del handle[name]
        size = int(np.prod(shape)) * 8
        handle.create_dataset(name, shape=shape, dtype=np.float64, external=[(str(raw), 0, size)])

    return change


def recorded_again(index):
    """Each part's size and checksum recorded in the sharded index anew: a crafted checkpoint's are the
    crafter's."""
    from mpidist.store import sharded

    with h5py.File(index, "r+") as handle:
        listed = json.loads(handle.attrs[sharded.PARTS])
        for record in listed:
            part = index.parent / record["file"]
            record.update(bytes=part.stat().st_size, sha256=sharded.checksum(part))
        handle.attrs[sharded.PARTS] = json.dumps(listed)
