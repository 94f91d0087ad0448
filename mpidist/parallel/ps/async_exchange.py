"""The MPI windows of ``ps-async`` (:mod:`mpidist.parallel.ps.asynchronous`): every ps's shard, gradient
inbox and ``[version, arrivals, steps]``, and on the first ps the workers' clocks, a stop request and the ps
ranks' control words, each read and written one-sidedly."""

import numpy as np

from ...runtime.rma import Window
from .async_rounds import NEVER


class AsyncExchange:
    """The windows of ps-async, collective to create and to free (``guard``: each operation's, see
    :class:`~mpidist.runtime.rma.Window`)."""

    def __init__(self, world, ps_ranks, bounds, num_workers, dtype, guard=None):
        rank = world.Get_rank()
        self.ps_ranks, self.bounds, self.num_workers = ps_ranks, bounds, num_workers
        lo, hi = bounds[ps_ranks.index(rank)] if rank in ps_ranks else (0, 0)
        is_ps = rank in ps_ranks
        self.params = Window(world, hi - lo, dtype, guard)  # the ps's parameter shard
        self.inbox = Window(world, hi - lo, dtype, guard)  # summed gradients not yet applied
        # [version, arrivals, the sum of the arrivals' steps] (the learning rate is the gradients' step's)
        self.meta = Window(world, 3 if is_ps else 0, np.int64, guard)
        # [clocks..., stop signal, 1 + rank that asked, snapshots asked, serving over]:
        # one read gives a worker the clocks and any stop request
        self.clock = Window(world, 4 + num_workers if rank == ps_ranks[0] else 0, np.int64, guard)
        self.stop = (0, 0)  # (signal, 1 + rank) as last read
        self._control = 2 + num_workers  # offset of [snapshots asked, serving over]
        self._one = np.ones(1, dtype=np.int64)
        self._arrival = np.array([0, 1, 0], dtype=np.int64)

    # -- worker side ------------------------------------------------------
    def pull(self, values, known=None):
        """Bring ``values`` (flat, host) up to date with every shard; returns the versions read.

        Versions are read first, and a shard whose version equals ``known``'s
        entry (what ``values`` already holds) is not read again.  A ps
        publishes a shard before bumping its version, so the shard read is at
        least as new as the version returned.
        """
        versions = np.zeros(len(self.ps_ranks), dtype=np.int64)
        for index, ps in enumerate(self.ps_ranks):
            self.meta.read(versions[index : index + 1], ps)
        self.meta.flush()
        for index, (ps, (lo, hi)) in enumerate(zip(self.ps_ranks, self.bounds)):
            if known is None or versions[index] != known[index]:
                self.params.read(values[lo:hi], ps)
        self.params.flush()
        return versions

    def push(self, grads, step=0):
        """Add ``grads`` (flat, host; computed at ``step``) into every inbox and count the arrival.

        Returns each ps's version now.  One ``Get_accumulate(SUM)`` of ``[0, 1,
        step]`` on ``[version, arrivals, step sum]`` counts the arrival, adds its
        step and reads the version in a single atomic step.
        """
        for ps, (lo, hi) in zip(self.ps_ranks, self.bounds):
            self.inbox.add(grads[lo:hi], ps)
        self.inbox.flush()  # the gradient is in place before its arrival is counted
        self._arrival[2] = step
        before = np.zeros((len(self.ps_ranks), 3), dtype=np.int64)
        for index, ps in enumerate(self.ps_ranks):
            self.meta.fetch_add(self._arrival, before[index], ps)
        self.meta.flush()
        return before[:, 0].copy()

    def clocks(self):
        """Steps completed by each worker (NEVER once finished); updates ``stop`` on the way."""
        clocks = np.zeros(self.num_workers + 2, dtype=np.int64)
        self.clock.read(clocks, self.ps_ranks[0])
        self.clock.flush()
        self.stop = (int(clocks[-2]), int(clocks[-1]))
        return clocks[:-2]

    def request_stop(self, signal_number, rank):
        """Any rank: ask every worker to stop at its next step boundary."""
        self.clock.replace(
            np.array([signal_number, rank + 1], dtype=np.int64), self.ps_ranks[0], offset=self.num_workers
        )
        self.clock.flush()
        self.stop = (signal_number, rank + 1)

    def tick(self, worker):
        """Count one finished step.  Not flushed here: it completes with the next clock
        access, and a tick seen late only makes this worker look slower (the safe side)."""
        self.clock.add(self._one, self.ps_ranks[0], offset=worker)

    def retire(self, worker):
        """Worker ``worker`` is done (it signs off, or the first ps drops it, dead): it holds nobody back.

        Setting the clock is idempotent, so a worker that dies while signing
        off is counted once whoever gets there first.
        """
        self.clock.replace(np.array([NEVER], dtype=np.int64), self.ps_ranks[0], offset=worker)
        self.clock.flush()

    # -- ps side ----------------------------------------------------------
    def take(self, out, rank):
        """Move this ps's inbox into ``out`` (leaving zeros); returns ``(arrivals counted, sum of their
        steps)``."""
        if getattr(self, "_zeros", None) is None or self._zeros.shape != out.shape:
            self._zeros = np.zeros_like(out)  # kept: a fresh 2.7 MB buffer per take is pure memory traffic
        self.inbox.swap(self._zeros, out, rank)
        self.inbox.flush(rank)
        counts = np.zeros(2, dtype=np.int64)
        self.meta.swap(np.zeros(2, dtype=np.int64), counts, rank, offset=1)
        self.meta.flush(rank)
        return int(counts[0]), int(counts[1])

    def pending(self, rank):
        """Arrivals counted at this ps and not yet taken (an 8-byte read: cheap to poll)."""
        arrivals = np.zeros(1, dtype=np.int64)
        self.meta.read(arrivals, rank, offset=1)
        self.meta.flush(rank)
        return int(arrivals[0])

    def publish(self, shard, rank):
        """Make ``shard`` this ps's readable parameters and bump its version."""
        self.params.replace(shard, rank)
        self.params.flush(rank)
        self.meta.add(self._one, rank, offset=0)
        self.meta.flush(rank)

    def workers_done(self):
        """Workers that signed off (or were dropped): their clocks say NEVER."""
        return int(np.count_nonzero(self.clocks() == NEVER))

    def control(self):
        """``(snapshots the first ps has asked for, whether it has stopped serving)``."""
        words = np.zeros(2, dtype=np.int64)
        self.clock.read(words, self.ps_ranks[0], offset=self._control)
        self.clock.flush()
        return int(words[0]), bool(words[1])

    def set_control(self, snapshots, over):
        """First ps: announce a snapshot (its number) or the end of serving to the other ps ranks."""
        self.clock.replace(
            np.array([snapshots, int(over)], dtype=np.int64), self.ps_ranks[0], offset=self._control
        )
        self.clock.flush()

    def free(self):
        for window in (self.clock, self.meta, self.inbox, self.params):
            window.free()
