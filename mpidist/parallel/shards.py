"""How a flat buffer is cut into contiguous shards, one per parameter server."""


def shard_bounds(count, parts):
    """``parts`` contiguous ``(lo, hi)`` ranges covering ``[0, count)``, sizes differing by at most one.

    The buffer has one dtype, so balancing elements balances bytes.

    >>> shard_bounds(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    if parts < 1:
        raise ValueError(f"need at least one shard, got {parts}")
    base, extra = divmod(count, parts)
    bounds, lo = [], 0
    for index in range(parts):
        hi = lo + base + (1 if index < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def imbalance(bounds):
    """Largest shard over the mean shard, minus one (0.0 is perfect balance)."""
    sizes = [hi - lo for lo, hi in bounds]
    mean = sum(sizes) / len(sizes)
    return max(sizes) / mean - 1.0 if mean else 0.0
