"""How a flat buffer is cut into contiguous shards: one per parameter server (:mod:`mpidist.parallel.ps`),
per worker's optimizer slice (``--shard optimizer``), per rank of a node's window and per ring chunk
(:mod:`mpidist.parallel.data`).  Arithmetic only; the cut is the same wherever it is asked for."""

from ..runtime.aligned import ALIGNMENT


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


#: Bytes of a cache line (what host arrays start on): shared-memory parts and ring chunks start on one, so two
#: ranks never write one line.
LINE = ALIGNMENT


def chunk_bounds(lo, hi, itemsize, parts):
    """``parts + 1`` boundaries cutting ``[lo, hi)`` into near-equal chunks, in cache-line steps from ``lo``.

    Rounded down, so the last chunk (which holds the buffer's end: the loss) is never empty.

    >>> chunk_bounds(0, 100, 8, 2)
    [0, 48, 100]
    """
    step = max(1, LINE // itemsize)
    count = hi - lo
    return [lo + min(count, int(count * i / parts / step) * step) for i in range(parts)] + [hi]


def line_bytes(nbytes):
    """``nbytes`` rounded up to whole cache lines."""
    return -(-nbytes // LINE) * LINE


def imbalance(bounds):
    """Largest shard over the mean shard, minus one (0.0 is perfect balance)."""
    sizes = [hi - lo for lo, hi in bounds]
    mean = sum(sizes) / len(sizes)
    return max(sizes) / mean - 1.0 if mean else 0.0
