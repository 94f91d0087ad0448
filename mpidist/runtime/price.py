"""What a rank will hold: what it holds now and each thing it will allocate, against what it may hold.

A run is checked once, before it allocates anything the price names, against
:func:`~mpidist.runtime.memory.holdable`: every item a rank will hold at once,
not each against what is left, so that two that each fit (a model and its
data) cannot pass where together they do not.  The price is an upper bound:
a run that passes its check does not die allocating.  Where an allocation
fails all the same, :func:`out_of_memory` words it as one line.
"""

import dataclasses

import numpy as np

from . import comm as mpi
from .errors import RunError, UsageError
from .memory import holdable, human, in_use


@dataclasses.dataclass
class Price:
    """Bytes a rank holds now (``held``: what its limits count, ``VmData``) and the items it will allocate,
    ``(what, bytes)`` each."""

    held: int = dataclasses.field(default_factory=in_use)
    items: list = dataclasses.field(default_factory=list)

    def add(self, what, nbytes):
        """Add ``nbytes`` for ``what`` (in words: ``"training state"``); nothing for none."""
        if nbytes > 0:
            self.items.append((what, int(nbytes)))
        return self

    @property
    def more(self):
        """Bytes the items add to what the rank holds now."""
        return sum(nbytes for _, nbytes in self.items)

    @property
    def total(self):
        """Bytes the rank will hold at most: what it holds now and every item."""
        return self.held + self.more

    def words(self):
        """``"88.6 MiB held already, 35.5 MiB training state, ..."``."""
        return ", ".join(
            [f"{human(self.held)} held already"] + [f"{human(n)} {what}" for what, n in self.items]
        )

    def refusal(self, subject):
        """Why ``subject`` (``"training 26,122 parameters with adam"``) does not fit this rank, in words; None
        where it fits (or nothing says what it may hold)."""
        limit = holdable()
        if limit is None or self.more <= limit[0]:
            return None
        return (
            f"{subject} needs {human(self.total)} in all on this rank ({self.words()}), more than {limit[1]}"
        )

    def check(self, subject):
        """Raise :class:`UsageError` with :meth:`refusal` where ``subject`` does not fit."""
        refused = self.refusal(subject)
        if refused:
            raise UsageError(refused)


def said(prices):
    """The line that says ``prices`` (every rank's total, in rank order): ``"mpidist: memory: 260.1 MiB a rank
    at most (rank 0), ..."``."""
    largest = max(range(len(prices)), key=prices.__getitem__)
    mib = prices[largest] / (1 << 20)  # (in MiB to a tenth, whatever the size: a limit is set from it)
    return (
        f"mpidist: memory: {mib:,.1f} MiB a rank at most (rank {largest}), each rank's price checked against "
        "what it may hold before it allocated any of it"
    )


def gathered(comm, price):
    """Collective over ``comm``: every rank's :attr:`Price.total`, in rank order, on every rank."""
    totals = np.zeros(comm.Get_size(), dtype=np.int64)
    mpi.allgather(comm, np.array([price.total], dtype=np.int64), totals)
    return [int(total) for total in totals]


def out_of_memory(error, doing, priced=True):
    """The :class:`RunError` for a :class:`MemoryError` raised ``doing`` something (``"while in compute at
    step 4"``): one line.  ``priced``: the run had passed its price's check (so the price missed something,
    or another process took memory meanwhile); else the set-up itself could not hold what it read."""
    what = str(error).strip().splitlines()[-1] if str(error).strip() else "an allocation failed"
    if not priced:
        return RunError(
            f"out of memory {doing} ({what}): more than this rank may hold; give it more (a larger limit, "
            "fewer ranks a node)"
        )
    return RunError(
        f"out of memory {doing} ({what}): the run's start-up check priced what it holds, so another process "
        "took memory meanwhile, or the price missed something (please report it)"
    )
