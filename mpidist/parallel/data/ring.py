"""A ring over the nodes: reduce-scatter and allgather of one part of a flat buffer, with its bytes counted.

Between nodes, each part of the node's summed gradient is exchanged by the
ranks that own it, one per node (:mod:`mpidist.parallel.data.node_model`).  Their
ring cuts the part into one chunk per node.  Reduce-scatter: in ``N - 1``
rounds each rank sends one chunk to the next rank and adds the chunk it
receives from the previous one, so that rank ``r`` ends with the whole sum of
chunk ``r``.  Allgather: in ``N - 1`` more rounds the summed chunks go round
the ring.  Each rank sends ``2 (N - 1) / N`` of the part, the bound no
allreduce can beat, and every chunk's sum is made once and copied, so every
node gets the same bits.  The ring counts what it sends, which is what
``internode_bytes_per_step`` reports: a measured figure, not a formula.
"""

import numpy as np

from ...runtime import comm as mpi
from ..shards import chunk_bounds


class Ring:
    """Reduce-scatter and allgather of ``array[lo:hi]`` over ``comm`` (one rank per node).

    Args:
        comm: the ranks that own this part, one on each node, in ring order.
        lo, hi: the part of the flat buffer they exchange.
        dtype: its element type.
    """

    def __init__(self, comm, lo, hi, dtype):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.bounds = chunk_bounds(lo, hi, np.dtype(dtype).itemsize, self.size)
        self.scratch = np.empty(
            max(self.bounds[i + 1] - self.bounds[i] for i in range(self.size)), dtype=dtype
        )
        self.sent = 0  # bytes sent over the run

    @property
    def chunk(self):
        """``(lo, hi)`` of the chunk this rank holds summed after :meth:`reduce_scatter`."""
        return self.bounds[self.rank], self.bounds[self.rank + 1]

    def _span(self, index):
        return slice(self.bounds[index % self.size], self.bounds[index % self.size + 1])

    def _neighbours(self):
        return (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def reduce_scatter(self, array):
        """Sum ``array[lo:hi]`` over the ring: afterwards this rank's :attr:`chunk` holds the whole sum."""
        after, before = self._neighbours()
        for round_ in range(self.size - 1):
            out, into = self._span(self.rank - round_ - 1), self._span(self.rank - round_ - 2)
            received = self.scratch[: into.stop - into.start]
            mpi.sendrecv(self.comm, array[out], after, received, before)
            self.sent += array[out].nbytes
            array[into] += received

    def allgather(self, array):
        """Every rank's :attr:`chunk` of ``array`` into everyone's ``array[lo:hi]``."""
        after, before = self._neighbours()
        for round_ in range(self.size - 1):
            out, into = self._span(self.rank - round_), self._span(self.rank - round_ - 1)
            mpi.sendrecv(self.comm, array[out], after, array[into], before)
            self.sent += array[out].nbytes
