"""One-sided MPI: windows that own their memory, locked shared for their whole life.

With :mod:`mpidist.runtime.comm` this is the only code that hands array buffers to
MPI.  Every window is made by ``MPI_Win_allocate``: MPI places the memory
itself, so between ranks on one node RMA becomes shared-memory access that
needs no help from the target (measured here with MPICH: a 2.7 MB ``Get`` took
0.3 ms whether the target computed, slept or polled; the same window made with
``Win.Create`` over a numpy array took 92 ms unless the target spun in MPI).

Only shared locks are ever taken (``Lock_all`` once, ``Unlock_all`` at
``free``): a process that dies holding an exclusive lock deadlocks every
other.  Reads, writes and updates all use the accumulate family
(``Get_accumulate`` with ``NO_OP`` to read, ``REPLACE`` to write, ``SUM`` to
add), which MPI makes atomic per element against each other, so concurrent
readers and writers never see a torn element and no update is lost.

Open MPI's shared-memory windows take a spin lock at the target for each
such operation: a process killed while holding one holds up, for good,
whoever next operates at that target.  A window may be given a guard (a
context manager, :class:`~mpidist.runtime.ulfm.StuckGuard`) that each
operation runs inside, so that a process held up so can be got out.
"""

import contextlib

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype


class Window:
    """``count`` elements of ``dtype`` on this rank (0 for ranks that only access others).

    Collective over ``comm`` to create and to :meth:`free`; use as a context
    manager so it is freed exactly once.  ``guard``: a context manager each
    operation runs inside (see above).
    """

    def __init__(self, comm, count, dtype, guard=None):
        self.guard = guard if guard is not None else contextlib.nullcontext()
        self.dtype = np.dtype(dtype)
        self.type = from_numpy_dtype(self.dtype)
        self.count = int(count)
        self.win = MPI.Win.Allocate(
            self.count * self.dtype.itemsize, disp_unit=self.dtype.itemsize, comm=comm
        )
        self.local = (
            np.frombuffer(self.win.tomemory(), dtype=self.dtype, count=self.count)
            if self.count
            else np.zeros(0, dtype=self.dtype)
        )
        self.local[...] = 0
        comm.Barrier()  # zeroed everywhere before anyone reads
        self.win.Lock_all()
        self._nothing = np.zeros(0, dtype=self.dtype)

    def _target(self, offset, count):
        return (int(offset), int(count), self.type)

    def read(self, out, target, offset=0):
        """Atomically (per element) copy ``target``'s elements ``[offset, offset + out.size)`` into
        ``out``."""
        with self.guard:
            self.win.Get_accumulate(
                [self._nothing, 0, self.type],
                [out, self.type],
                target,
                target=self._target(offset, out.size),
                op=MPI.NO_OP,
            )

    def add(self, values, target, offset=0):
        """Atomically add ``values`` into ``target``'s elements from ``offset``."""
        with self.guard:
            self.win.Accumulate(
                [values, self.type], target, target=self._target(offset, values.size), op=MPI.SUM
            )

    def replace(self, values, target, offset=0):
        """Atomically overwrite ``target``'s elements from ``offset`` with ``values``."""
        with self.guard:
            self.win.Accumulate(
                [values, self.type], target, target=self._target(offset, values.size), op=MPI.REPLACE
            )

    def fetch_add(self, values, out, target, offset=0):
        """Atomically add ``values`` and get the previous contents out."""
        with self.guard:
            self.win.Get_accumulate(
                [values, self.type],
                [out, self.type],
                target,
                target=self._target(offset, values.size),
                op=MPI.SUM,
            )

    def swap(self, values, out, target, offset=0):
        """Atomically put ``values`` in and get the previous contents out (e.g. take and zero an inbox)."""
        with self.guard:
            self.win.Get_accumulate(
                [values, self.type],
                [out, self.type],
                target,
                target=self._target(offset, values.size),
                op=MPI.REPLACE,
            )

    def flush(self, target=None):
        """Complete this rank's operations (to ``target``, or to all) at the target."""
        with self.guard:
            if target is None:
                self.win.Flush_all()
            else:
                self.win.Flush(target)

    def free(self):
        """Collective: release the window (idempotent)."""
        if self.win is not None:
            self.win.Unlock_all()
            self.local = None
            self.win.Free()
            self.win = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
