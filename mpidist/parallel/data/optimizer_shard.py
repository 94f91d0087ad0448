"""``--shard optimizer`` (ZeRO stage 1): each worker keeps the optimizer state of one slice of the model.

Every worker still sums the whole gradient (the data-parallel exchange, its
buckets overlapped with backward), but updates only its slice ``[lo, hi)``
of the parameters, with optimizer state the size of that slice; an
``Allgatherv`` in place then hands every worker the others' slices.  The
optimizer state per worker is divided by the number of workers (Adam's two
moments: 8 bytes per parameter in float32, over ``W``).  Slices are
contiguous and balanced (:func:`~mpidist.parallel.shards.shard_bounds`), so a
checkpoint gathers them into the whole-model state every strategy and any
rank count resumes from.
"""

import numpy as np

from ...runtime import comm as mpi
from ...runtime.xp import to_host
from ..shards import shard_bounds


class OptimizerShard:
    """This worker's slice of the model for the optimizer, and the collectives that join the slices.

    Args:
        comm: the workers' communicator.
        count: parameters in the model's flat buffer.
    """

    def __init__(self, comm, count):
        self.comm = comm
        bounds = shard_bounds(count, comm.Get_size())
        self.lo, self.hi = bounds[comm.Get_rank()]
        self.counts = [hi - lo for lo, hi in bounds]
        self.displs = [lo for lo, _ in bounds]

    @property
    def size(self):
        return self.hi - self.lo

    def share(self, params):
        """Collective: every worker's updated slice into everyone's ``params`` (in place)."""
        mpi.allgatherv_inplace(self.comm, params, self.counts, self.displs)

    def gather(self, arrays, root=0):
        """Collective: ``{name: whole array}`` of the slices in ``arrays`` on ``root`` (host memory), else
        None."""
        whole = {}
        for name in sorted(arrays):
            mine = np.ascontiguousarray(to_host(arrays[name]))
            target = np.empty(sum(self.counts), dtype=mine.dtype) if self.comm.Get_rank() == root else None
            mpi.gatherv(self.comm, mine, target, self.counts, self.displs, root)
            whole[name] = target
        return whole if self.comm.Get_rank() == root else None

    def slice_of(self, arrays):
        """This worker's slice of whole-model ``arrays`` (a checkpoint's optimizer state)."""
        return {name: array[self.lo : self.hi] for name, array in arrays.items()}
