"""``local``: one process, no communication -- the reference every strategy must match."""

from ...runtime.errors import UsageError
from ..registry import register
from .exchange import NoExchange
from .replicated import DataParallel


@register
class LocalStrategy(DataParallel):
    """Plain single-process training."""

    name = "local"

    @classmethod
    def auto_rank(cls, settings, world_size):
        return 2 if world_size == 1 else None  # one rank: nothing to exchange

    @classmethod
    def check(cls, settings, world_size):
        if world_size > 1:
            raise UsageError(
                f"--strategy local runs on one rank, got {world_size} ranks "
                "(use --strategy allreduce, or mpiexec -n 1)"
            )

    @property
    def worker_comm(self):
        return None

    @property
    def worker_index(self):
        return 0

    def make_exchange(self):
        return NoExchange(self.buffer)
