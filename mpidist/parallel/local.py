"""``local``: one process, no communication -- the reference every strategy must match."""

from .base import DataParallel


class LocalStrategy(DataParallel):
    """Plain single-process training."""

    name = "local"

    @property
    def worker_comm(self):
        return None

    @property
    def worker_index(self):
        return 0

    def exchange(self, buffer):
        """One worker: its weighted gradient already is the sum."""
