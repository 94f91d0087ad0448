"""How much memory a rank may take: the guard every allocation sized by a file goes through.

A dataset declares its row counts and class count, a checkpoint its array
sizes; numbers like these decide how much a rank allocates, so they are
checked against the memory the node has free before anything is allocated
(a dataset declaring 10^12 classes would otherwise ask for hundreds of TiB,
and a smaller absurd number would push the node into swap or the OOM killer).
"""

import math
import os
import re
import sys
import time

from .errors import UsageError


def kib_field(path, name):
    """The ``name:`` line of a ``/proc`` file counted in kB, as bytes, or None where it cannot be read."""
    try:
        with open(path, "rb") as handle:
            for line in handle:
                if line.startswith(name + b":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def high_water():
    """This process's peak resident bytes since :func:`reset_high_water` (Linux's ``VmHWM``), or None."""
    return kib_field("/proc/self/status", b"VmHWM")


def reset_high_water():
    """Start this process's peak over from the present (``clear_refs`` 5, Linux 4.0 on); False where it
    cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def available_bytes():
    """Memory the node can still give (``MemAvailable``), or None where that cannot be read."""
    found = kib_field("/proc/meminfo", b"MemAvailable")
    if found is not None:
        return found
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def ranks_per_node():
    """How many ranks share this node, as the launcher says (1 if it does not)."""
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(os.environ[name].split("(")[0]))
        except (KeyError, ValueError):
            continue
    return 1


def human(nbytes):
    """``1.5 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} EiB"  # pragma: no cover


def check_fits(nbytes, what):
    """Raise :class:`UsageError` if ``nbytes`` exceed what this rank may hold (:func:`holdable`).

    ``what`` says what needs them, with the value that decided their size
    (``"dataset d.h5: train/x of 10^9 rows"``).
    """
    limit = holdable()
    if limit is not None and nbytes > limit[0]:
        raise UsageError(f"{what} needs {human(nbytes)}, more than {limit[1]}")


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_bytes(text, flag="--memory-budget"):
    """``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"1000000"`` as bytes (binary units); :class:`UsageError`
    otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgtp]?)(?:i?b)?\s*", str(text), re.IGNORECASE)
    value = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else math.nan
    if not (math.isfinite(value) and 1 <= value < 1 << 62):
        raise UsageError(f"{flag} {text!r}: give a size such as 512M, 4G or 1.5GiB (binary units), or auto")
    return int(value)


def holdable():
    """``(bytes this rank may hold, why)``: its share of the node's free memory, or a limit set on it; None if
    unknown.

    Limits: ``ulimit -v``/``-d`` on the process, a cgroup's ``memory.max``
    (Slurm's ``--mem``) shared by the node's ranks.
    """
    ranks = ranks_per_node()
    free = available_bytes()
    found = (
        []
        if free is None
        else [
            (
                free // ranks,
                f"this rank's share of the memory free on the node "
                f"({human(free // ranks)} of {human(free)} for {ranks} rank(s))",
            )
        ]
    )
    try:
        import resource

        # (what the process has mapped already counts against its limit: the interpreter, its libraries'
        # buffers, the data read so far)
        for which, name, used in (
            (resource.RLIMIT_AS, "ulimit -v", b"VmSize"),
            (resource.RLIMIT_DATA, "ulimit -d", b"VmData"),
        ):
            soft = resource.getrlimit(which)[0]
            if soft != resource.RLIM_INFINITY:
                used = kib_field("/proc/self/status", used) or 0
                found.append(
                    (
                        max(0, soft - used),
                        f"this process's limit ({name}: {human(soft)}, {human(used)} of it in use)",
                    )
                )
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as handle:
            text = handle.read().strip()
        if text.isdigit():
            found.append(
                (
                    int(text) // ranks,
                    f"this rank's share of the job's memory limit (cgroup memory.max "
                    f"{human(int(text))} for {ranks} rank(s))",
                )
            )
    except OSError:
        pass
    return min(found) if found else None


#: glibc's ``mallopt`` parameters: allocations from this size on are mapped on their own, and freed memory at
#: the top of the heap beyond it is given back (see :func:`settle`)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _SETTLED_THRESHOLD = -1, -3, 128 << 10
_settled = {}  # what settle() found, once it ran: {"thread": bytes a thread of mpidist's costs}


def settle():
    """Make this process's memory what a price can bound, before the price is taken; once per process.

    * glibc raises its mmap threshold, by default, to the size of each large block freed (up to 32 MiB):
      from then on, arrays below it come from the heap, which keeps what they held once they are freed
      (measured: a 32 MB temporary left 31 MiB behind).  A process's memory then depends on its history,
      not on what it holds.  A fixed threshold turns that off: every array from 128 KiB on is mapped on its
      own and given back when freed.  (Training steps allocate nothing once warm: a step's arrays are the
      workspace's, so the cost is an evaluation's or a data batch's page faults.)
    * BLAS libraries allocate their buffers on a thread's first large product (OpenBLAS: 32 MiB), and
      OpenBLAS ends the process where that fails, with no word of mpidist's: one product now puts them in
      what the process holds already.
    * A thread's stack is its own mapping (8 MiB by default): measured here, for the threads a run starts
      later (:func:`thread_bytes`).
    """
    if _settled:
        return
    import ctypes
    import ctypes.util
    import threading

    import numpy as np

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if hasattr(libc, "mallopt"):  # (glibc; other C libraries keep their own policy)
            libc.mallopt(_M_MMAP_THRESHOLD, _SETTLED_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, _SETTLED_THRESHOLD)
    except OSError:  # pragma: no cover - no C library to ask
        pass
    square = np.ones((512, 512), dtype=np.float32)
    np.dot(square, square)
    started, stop = threading.Event(), threading.Event()
    before = kib_field("/proc/self/status", b"VmData") or 0

    def probe():
        started.set()
        stop.wait()

    thread = threading.Thread(target=probe, daemon=True, name="mpidist-memory-probe")
    thread.start()
    started.wait()
    grown = (kib_field("/proc/self/status", b"VmData") or 0) - before
    stop.set()
    thread.join()
    _exited(thread.native_id)
    _settled["thread"] = max(grown, 0)


def _exited(tid, patience=1.0):
    """Wait (``patience`` seconds at most) until thread ``tid`` of this process has left the system.

    Python's ``join`` returns when the thread's function has, before the C library has put its stack in
    its cache of stacks for the next thread: a thread started in between got a stack of its own, 8 MiB
    more held for good, and a price taken after it was that much higher in 1 run of 20 (``predict --tensor
    2`` refused under a limit 3% above the price its unlimited run had stated).  Once the thread is gone
    from ``/proc/self/task`` its stack is back in the cache, and the next thread takes it.
    """
    task = f"/proc/self/task/{tid}"
    deadline = time.monotonic() + patience
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)


def thread_bytes():
    """What one more thread costs this process (its stack, as :func:`settle` measured it; 8 MiB before)."""
    return _settled.get("thread", 8 << 20)


def in_use():
    """Bytes this process holds now as its limits count them (``VmData``: what ``ulimit -d`` bounds), or 0."""
    return kib_field("/proc/self/status", b"VmData") or 0


def default_budget():
    """Bytes one rank's data may take unless told: half of what it may hold (:func:`holdable`; 4 GiB if
    unknown).

    Half, as the model, its gradients, the optimizer and MPI's buffers need the rest.
    """
    limit = holdable()
    return (4 << 30) if limit is None else max(1 << 20, limit[0] // 2)


def peak_memory():
    """Bytes this process has held resident at most so far (``getrusage``; 0 where unknown)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (macOS counts bytes, Linux KiB)
