"""A stand-in for the device's IPC operations over POSIX shared memory, so an IpcLink runs on CPUs.

Each slot is a file in ``/dev/shm`` mapped with ``mmap``; its handle is the
file's name, padded to the 64 bytes of a CUDA IPC handle.  It counts what it
does, so tests can say how many slots were made and opened.
"""

import itertools
import mmap
import os

import numpy as np

PREFIX = "/dev/shm/mpidist-ipc-test-"
_NAMES = itertools.count()


class Mapped:
    """A mapped file: its bytes as a numpy view."""

    def __init__(self, path, size=0):
        descriptor = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size else 0), 0o600)
        try:
            if size:
                os.ftruncate(descriptor, size)
            self.map = mmap.mmap(descriptor, 0)
        finally:
            os.close(descriptor)
        self.path, self.bytes = path, np.frombuffer(self.map, np.uint8)

    def close(self):
        self.bytes = None  # (the view first: a map with a view exported cannot close)
        self.map.close()


class HostMemory:
    """The six operations of :class:`mpidist.runtime.cuda_ipc.CudaMemory` on host arrays."""

    def __init__(self):
        self.made = self.opened = self.closed = self.freed = 0

    def alloc(self, nbytes):
        path = f"{PREFIX}{os.getpid()}-{next(_NAMES)}"
        self.made += 1
        return Mapped(path, nbytes), path.encode().ljust(64, b"\0")

    def free(self, slot):
        slot.close()
        os.unlink(slot.path)
        self.freed += 1

    def open(self, handle):
        self.opened += 1
        return Mapped(handle.rstrip(b"\0").decode())

    def close(self, mapped):
        mapped.close()
        self.closed += 1

    def put(self, slot, array):
        slot.bytes[: array.nbytes] = array.reshape(-1).view(np.uint8)

    def take(self, buffer, mapped, nbytes):
        buffer.reshape(-1).view(np.uint8)[...] = mapped.bytes[:nbytes]

    def wait(self):
        pass


def leftovers():
    """This process's stand-in files still in /dev/shm."""
    mine = f"{os.path.basename(PREFIX)}{os.getpid()}-"
    return [name for name in os.listdir("/dev/shm") if name.startswith(mine)]
