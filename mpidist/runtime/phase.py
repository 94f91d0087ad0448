"""A long phase that a stop signal on any rank cuts short on every rank: an evaluation.

A step boundary is where a run acts on a signal (:mod:`mpidist.runtime.preempt`);
an evaluation of a large split has none for as long as it reads, and a
scheduler's kill-wait (Slurm: 30 s by default) can end the job before the
checkpoint the signal asked for.  Here the ranks of a phase agree item by
item (batch by batch) on going on, the way :class:`~mpidist.runtime.preempt.StepAgreement`
agrees step by step: before each item a rank posts its flags (a signal seen,
whether it has an item to work on) in a non-blocking ``Iallreduce(MAX)`` and
collects the one it posted before, which the others have long posted.  Every
rank so takes the same decision at the same boundary, whatever number of
items it has: a rank with none left keeps posting "no item" until the others
are done too.  Ranks that exchange data item by item (a pipeline's stages,
which hold the same batches) stop at the same item, so no send is left
without its receive; a signal ends the phase two items after it came.
"""

import numpy as np
from mpi4py import MPI

from . import comm as mpi

_END = object()


class PhaseAgreement:
    """The items of a long phase, until the ranks of ``comm`` agree to stop (``None``: this rank alone
    decides).

    Collective over ``comm``, a communicator of the phases' own (its
    exchanges are never matched against others'), made once by the caller
    for every phase of a loop (:class:`PhaseComm`).  After the phase,
    :attr:`cut` is None, or the agreed flags of the signal that cut it short:
    ``{"signal", "rank"}`` (``rank``: 1 + the rank that saw it).

    Args:
        comm: the ranks that go through the phase together, or None.
        signals: the process's :class:`~mpidist.runtime.preempt.StopSignals`.
    """

    FIELDS = ("signal", "rank", "busy")

    def __init__(self, comm, signals):
        self.comm = comm
        self.signals = signals
        self.cut = None
        self._flags = np.zeros(len(self.FIELDS), dtype=np.int64)
        self._pending = None

    def items(self, iterable):
        """``iterable``'s items while no rank has seen a stop signal; with none left, the boundaries others
        need."""
        if self.comm is None:
            yield from self._alone(iterable)
            return
        iterator = iter(iterable)
        item = next(iterator, _END)
        while True:
            agreed = self._boundary(busy=item is not _END)
            if agreed is not None and (agreed["signal"] or not agreed["busy"]):  # (a signal, or all done)
                self._pending.wait()  # (every rank posted it: they all leave at this boundary)
                self._pending = None
                if agreed["signal"]:
                    self.cut = {"signal": agreed["signal"], "rank": agreed["rank"]}
                return
            if item is not _END:
                yield item
                item = next(iterator, _END)

    def _alone(self, iterable):
        for item in iterable:
            if self.signals.received:
                self.cut = {"signal": self.signals.received, "rank": 0}
                return
            yield item

    def _boundary(self, busy):
        """Post this rank's flags; the flags every rank posted at the boundary before (None at the first)."""
        agreed = None
        if self._pending is not None:
            self._pending.wait()
            agreed = dict(zip(self.FIELDS, (int(v) for v in self._flags)))
        received = self.signals.received
        self._flags[...] = (received, self.comm.Get_rank() + 1 if received else 0, int(busy))
        self._pending = mpi.iallreduce(self.comm, self._flags, MPI.MAX)
        return agreed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # a phase left by an error has an exchange pending, which the others may never join: it is let go
        # without waiting (the communicator is revoked, or the job ends)
        self._pending = None


class PhaseComm:
    """The communicator the phases of a loop agree on: a duplicate of ``world``, made at the first phase.

    One per world, not one per phase: with a duplicate made and freed at each
    evaluation, every rank of a run under Open MPI's ULFM crashed (SIGSEGV)
    in that ``MPI_Comm_dup`` at the start of an evaluation, in 1 of about 20
    runs of the elastic tests (faulthandler's traces: every rank in it), and
    ``mpirun`` exited 0.  Collective over ``world`` the first time; a new
    world (the survivors of a lost rank) gets a new one, the broken world's
    being left to it (freeing is collective over the dead too).
    """

    def __init__(self):
        self.world = self.comm = None

    def over(self, world, made=None):
        """The communicator for ``world`` (made now, and passed to ``made``, where there is none for it
        yet)."""
        if self.world is not world:
            self.world, self.comm = world, world.Dup()
            if made is not None:
                made(self.comm)
        return self.comm

    def free(self):
        """Collective: free the communicator of the current world (once)."""
        if self.comm is not None:
            self.comm.Free()
        self.world = self.comm = None
