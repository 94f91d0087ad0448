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
        return self.make_pieces([(offset, offset + size)])

    def make_pieces(self, pieces):
        """The optimizer of ``pieces`` of the model (``(lo, hi)`` ranges, sorted, laid one after the other
        in the slice it updates: ``--shard parameters``' shards of each unit); None without a factory."""
        if self.make_whole is None:
            return None
        optimizer = self.make_whole(sum(hi - lo for lo, hi in pieces))
        optimizer.decay_ranges = within(pieces, self.decay_ranges)
        return optimizer


def within(pieces, ranges):
    """``ranges`` (``(lo, hi)`` of a flat buffer, sorted) as ranges of a buffer made of ``pieces`` of it laid
    one after the other: the parts of them it holds (weight decay's, the shared parameters of a tensor part).

    >>> within([(4, 8), (10, 12)], [(2, 6), (7, 11)])
    [(0, 2), (3, 4), (4, 5)]
    """
    found, at = [], 0
    for lo, hi in pieces:
        for a, b in ranges:
            a, b = max(a, lo), min(b, hi)
            if a < b:
                found.append((at + a - lo, at + b - lo))
        at += hi - lo
    return found
