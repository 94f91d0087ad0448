"""MPICH's shared-memory files of this process, unlinked before it ends without ``MPI_Finalize``.

MPICH keeps a file in ``/dev/shm`` for each shared-memory segment (its
intranode channel, every shared window) and removes it in
``MPI_Finalize``.  A process that ends through ``MPI_Abort`` or
``os._exit`` (an error on one rank of many, a signal, a stall) left them
behind: 1-2 MiB each, held in memory (tmpfs) until the machine reboots.
Before such an end this process unlinks the ones it maps itself; every
mapping, its own and other ranks', stays valid (only the name goes), and
the job is ending anyway.  Only MPICH's names, and only files this process
maps: nothing of another job's.
"""

import contextlib
import os

#: where MPICH puts its segments, and how it names them
SHM, PREFIX = b"/dev/shm/", b"mpich_shm_"


def mapped_segments(maps="/proc/self/maps"):
    """The MPICH segment files this process maps that still have a name (none where ``maps`` is missing).

    Read as bytes: another mapped file's name need not be UTF-8 (a user's data file)."""
    found = set()
    with contextlib.suppress(OSError), open(maps, "rb") as lines:
        for line in lines:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else b""
            removed = path.endswith(b" (deleted)")
            if path.startswith(SHM + PREFIX) and b"/" not in path[len(SHM) :] and not removed:
                found.add(os.fsdecode(path))
    return sorted(found)


def forget_segments():
    """Unlink every MPICH segment file this process maps (see the module's docstring).  Never raises: it
    runs just before the process ends, which nothing may keep from happening."""
    with contextlib.suppress(Exception):
        for path in mapped_segments():
            with contextlib.suppress(OSError):
                os.unlink(path)
