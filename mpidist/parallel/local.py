"""``local``: one process, no communication -- the reference every strategy must match."""

from .base import DataParallel


class LocalStrategy(DataParallel):
    """Plain single-process training."""

    name = "local"

    def initialize(self, params=None):
        if params is None:
            self.model.init_params(self.seed)
        else:
            self.model.params[...] = self.model.xp.asarray(params)

    def exchange(self, buffer):
        """One worker: its weighted gradient already is the sum."""
