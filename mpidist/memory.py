"""How much memory a rank may take: the guard every allocation sized by a file goes through.

A dataset declares its row counts and class count, a checkpoint its array
sizes; numbers like these decide how much a rank allocates, so they are
checked against the memory the node has free before anything is allocated
(a dataset declaring 10^12 classes would otherwise ask for hundreds of TiB,
and a smaller absurd number would push the node into swap or the OOM killer).
"""

import os

from .errors import UsageError


def available_bytes():
    """Memory the node can still give (``MemAvailable``), or None where that cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as handle:
            for line in handle:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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
    return f"{value:.1f} EiB"   # pragma: no cover


def check_fits(nbytes, what):
    """Raise :class:`UsageError` if ``nbytes`` exceed this rank's share of the node's free memory.

    ``what`` says what needs them, with the value that decided their size
    (``"dataset d.h5: train/x of 10^9 rows"``).
    """
    free = available_bytes()
    if free is None:
        return
    share = free // ranks_per_node()
    if nbytes > share:
        raise UsageError(f"{what} needs {human(nbytes)}, more than this rank's share of the memory free on the "
                         f"node ({human(share)} of {human(free)} for {ranks_per_node()} rank(s))")
