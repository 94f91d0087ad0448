"""The optimizer of the slice of the model a rank updates, with the weight decay of that slice."""


class OptimizerFactory:
    """Makes the optimizer of ``size`` parameters from ``offset`` on (the whole buffer, a ps shard, a stage,
    a ZeRO slice), from the run's ``size -> Optimizer`` and the whole model's decaying ranges.

    Args:
        make: ``size -> Optimizer`` (None: no optimizer, as in evaluation).
        decay_ranges: the whole model's ``(lo, hi)`` ranges weight decay applies to (of the whole model,
            whatever part of it this rank updates).
    """

    def __init__(self, make, decay_ranges):
        self.make_whole, self.decay_ranges = make, list(decay_ranges)

    def make(self, size, offset=0):
        """The optimizer of the ``size`` parameters from ``offset`` on (None: no factory); its weight decay
        applies to the model's decaying ranges within that slice."""
        if self.make_whole is None:
            return None
        optimizer = self.make_whole(size)
        optimizer.decay_ranges = [
            (max(lo, offset) - offset, min(hi, offset + size) - offset)
            for lo, hi in self.decay_ranges
            if lo < offset + size and hi > offset
        ]
        return optimizer
