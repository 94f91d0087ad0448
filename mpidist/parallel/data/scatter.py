"""In-graph replication (``--replication in-graph``): the chief reads whole global batches, MPI cuts them
up."""

import numpy as np

from ...data import local_batch_size
from ...runtime import comm as mpi


class ScatteredBatches:
    """In-graph replication: the chief's global batches, cut and sent to each worker.

    Every worker iterates this; the chief (worker 0 of ``comm``) reads, the
    others only receive (one ``Scatterv`` for samples, one for targets).
    """

    def __init__(self, comm, source, global_batch, sample_shape, y_shape, x_dtype, y_dtype, steps):
        self.comm, self.source, self.steps = comm, source, steps
        workers, worker = comm.Get_size(), comm.Get_rank()
        sizes = [local_batch_size(global_batch, workers, w) for w in range(workers)]
        starts = np.cumsum([0] + sizes[:-1])
        x_each, y_each = int(np.prod(sample_shape)), int(np.prod(y_shape))
        self.x_counts, self.x_displs = [s * x_each for s in sizes], [int(o) * x_each for o in starts]
        self.y_counts, self.y_displs = [s * y_each for s in sizes], [int(o) * y_each for o in starts]
        self.x = np.empty((sizes[worker],) + tuple(sample_shape), dtype=x_dtype)
        self.y = np.empty((sizes[worker],) + tuple(y_shape), dtype=y_dtype)

    def __iter__(self):
        for _ in range(self.steps):
            gx = gy = None
            if self.source is not None:
                gx, gy = next(self.source)
                gx, gy = np.ascontiguousarray(gx, self.x.dtype), np.ascontiguousarray(gy, self.y.dtype)
            mpi.scatterv(self.comm, gx, self.x, self.x_counts, self.x_displs, root=0)
            mpi.scatterv(self.comm, gy, self.y, self.y_counts, self.y_displs, root=0)
            yield self.x, self.y

    def close(self):
        if self.source is not None:
            self.source.close()
