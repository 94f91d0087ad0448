"""The small model, the batch slices and the slow worker the strategies' tests share (a module, not a test:
never collected)."""

import time

import numpy as np

from mpidist.data import local_batch_size
from mpidist.nn import Conv2D, Dense, Flatten, MaxPool2D, ReLU, Sequential


def small_convnet(dtype):
    layers = [Conv2D(3, 3), ReLU(), MaxPool2D(2), Flatten(), Dense(8), ReLU(), Dense(4, init="glorot")]
    return Sequential(layers, (1, 6, 6), xp=np, dtype=dtype)


def worker_slice(global_batch, workers, worker):
    sizes = [local_batch_size(global_batch, workers, w) for w in range(workers)]
    lo = sum(sizes[:worker])
    return slice(lo, lo + sizes[worker])


class LastToStart:
    """A worker slower than the whole run, whatever the machine's speed: it starts once the other workers
    have ended, or after :attr:`DEADLOCK_S` (the end of a deadlock: steps that waited for it).

    A sleep before each of its steps made it slow for a time, which a busy machine could match (the others'
    steps slowed to the sleep's length); an order holds on any machine.  Every rank of ``world`` makes it
    and frees it (a communicator of its own carries the others' word).

    Args:
        world: the communicator the run's ranks share.
        slow: the slow worker's rank in it.
        others: the other workers' ranks.
    """

    DEADLOCK_S = 30  # (a busy machine's few small steps come nowhere near)
    TAG = 99

    def __init__(self, world, slow, others):
        self.comm, self.slow, self.others, self.told = world.Dup(), slow, list(others), []

    def wait(self):
        """On the slow worker, before its first step: whether every other worker said it ended in time."""
        deadline, heard = time.monotonic() + self.DEADLOCK_S, set()
        while len(heard) < len(self.others) and time.monotonic() < deadline:
            heard.update(rank for rank in self.others if self.comm.iprobe(source=rank, tag=self.TAG))
            time.sleep(0.01)
        for rank in heard:
            self.comm.recv(source=rank, tag=self.TAG)
        return len(heard) == len(self.others)

    def ended(self):
        """On another worker, after its last step."""
        self.told.append(self.comm.isend(None, dest=self.slow, tag=self.TAG))

    def free(self):
        """Collective, once every rank is past its part (the strategy's finish)."""
        for request in self.told:
            request.wait()
        self.comm.Free()
