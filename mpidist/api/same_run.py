"""Every rank was given the same run: the same settings, and the same arrays where a script gives them.

Each rank of a script calls ``mpidist.train`` with what that rank computed.
Where one computed another ``epochs``, ``batch_size`` or optimizer, or
arrays of another length, the ranks planned different runs and waited for
each other at different collectives, until the stall monitor blamed a stall
(300 s by default); another seed or learning rate trained on without a word.
Before anything collective the ranks compare what they were given (a few
hundred bytes each: the settings, the arrays' shapes and types and a sample
of their bytes) and refuse, in one line on every rank, naming the first
thing that differs.
"""

import dataclasses
import zlib

import numpy as np

from ..data.arrays import ArrayData
from ..runtime.errors import UsageError
from ..runtime.text import printable
from ..store.rundir import WHERE

#: bytes of each array compared, at each of its start, middle and end
SAMPLE_BYTES = 1 << 16


#: settings that may differ between ranks: where files go (the chief alone writes the metrics; a script may
#: name a file of each rank's), not what the run does, and how the chief shows its progress
MAY_DIFFER = (*WHERE, "progress")


def described(config, data):
    """What this rank was given, as ``{"what": "value"}`` (words the message can show)."""
    said = {
        f"--{field.name.replace('_', '-')}": repr(getattr(config, field.name))
        for field in dataclasses.fields(config)
        if field.name not in MAY_DIFFER
    }
    if isinstance(data, ArrayData):
        with data.open() as handle:
            for split in sorted(handle):
                for key in ("x", "y"):
                    item = handle[split][key]
                    said[f"the {split} split's {key}"] = f"{item.shape} {item.dtype} {_sampled(item):08x}"
    return said


def _sampled(item):
    """A CRC-32 of ``item``'s bytes at its start, middle and end (:data:`SAMPLE_BYTES` each)."""
    rows = item.shape[0] if item.shape else 0
    row_bytes = max(1, item.dtype.itemsize * int(np.prod(item.shape[1:], dtype=np.int64)))
    take = max(1, SAMPLE_BYTES // row_bytes)
    crc = 0
    for start in sorted({0, max(0, rows // 2 - take // 2), max(0, rows - take)}):
        crc = zlib.crc32(np.ascontiguousarray(item[start : start + take]).tobytes(), crc)
    return crc


def refuse_differences(descriptions):
    """Refuse, the same way on every rank, where ``descriptions`` (every rank's :func:`described`, by rank)
    differ: the first thing that does, with its value on rank 0 and on the first rank that differs."""
    first = descriptions[0]
    for rank, other in enumerate(descriptions[1:], 1):
        for what in list(first) + [what for what in other if what not in first]:
            if first.get(what) != other.get(what):
                raise UsageError(
                    f"the ranks were given different runs: {what} is {printable(first.get(what), 80)} on "
                    f"rank 0 and {printable(other.get(what), 80)} on rank {rank}; every rank must call "
                    "train() with the same settings and data"
                )
