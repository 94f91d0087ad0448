"""The gradient bucket size (``--bucket-mb``) that leaves the least exchange after backward.

``allreduce --exchange mpi`` cuts its buffer (the gradients, then the loss)
into buckets from the top (:func:`mpidist.parallel.data.exchange.top_down_buckets`)
and starts each one's ``Iallreduce`` as soon as backward has gone from the
last layer down to the one holding the bucket's lowest element.  Here
backward runs layer by layer on the calibrated (and crowded) times, and the
link moves one bucket at a time: what it has left to move when backward
ends, and the sums of every bucket (arithmetic on the cores that also run
backward), are the exchange a step waits for.  Small buckets start early
but pay a latency each; one large bucket starts only after the first layer.

This is the exchange left were the link to move bytes while the cores
compute (a network card's transfers, MPI's progress driven between layers);
ranks that move them on the cores they compute on get less of it, or none.
The step prediction (:mod:`mpidist.plan.step`) hides the calibrated share
of it (``Calibration.overlap``, measured by running the exchange overlapped
and not).
"""

import bisect
import itertools


MIB = 1 << 20
#: bucket sizes tried, in MiB: 1/4 to 1024 by factors of 2
CANDIDATES = tuple(2.0**k for k in range(-2, 11))
# sizes that cut the buffer into more are not tried: each bucket is a step of the model
MOST_BUCKETS = 1 << 16


def buffer_bytes(cal):
    """Bytes of the buffer ``allreduce`` sums: the gradients, then the loss."""
    return (cal.params + 1) * cal.itemsize


def exposed(cal, layout, bucket_bytes):
    """Seconds of the exchange left after backward, with buckets of at most ``bucket_bytes``."""
    groups = layout.replicas
    samples = layout.batch / groups
    link, slower, item = cal.link_for(layout), cal.crowding_for(layout), cal.itemsize
    # when backward has finished each layer (from the last, the loss's gradient first)
    done_at, clock = [0.0] * len(cal.layers), (cal.loss[0] + cal.loss[1] * samples) * slower
    for index in range(len(cal.layers) - 1, -1, -1):
        clock += (cal.layers[index].backward[0] + cal.layers[index].backward[1] * samples) * slower
        done_at[index] = clock
    # (each layer's end in the buffer)
    ends = list(itertools.accumulate(layer.params for layer in cal.layers))
    link_free = 0.0
    for holder, sizes in _bucket_runs(ends, max(1, int(bucket_bytes) // item)):
        link_free = max(link_free, done_at[holder])
        # (a run's buckets wait for nothing but each other: count of one size at once)
        for (
            size,
            count,
        ) in sizes:
            link_free += count * link.allreduce(size * item, groups)
    return max(0.0, link_free - clock) + (groups - 1) / groups * buffer_bytes(cal) * cal.sum_per_byte


def _bucket_runs(ends, per):
    """:func:`~mpidist.parallel.data.exchange.top_down_buckets` of ``ends[-1] + 1`` elements (the gradients,
    then the loss) in runs of consecutive buckets whose lowest element one layer holds: ``(layer, [(elements,
    buckets)])`` in the order backward completes them, a run per layer at most, however many buckets (the
    loss's element, where a bucket is it alone, counts as the first layer's)."""
    count = ends[-1] + 1
    total = -(-count // per)  # buckets; the last (lowest) is the short one
    last = count - (total - 1) * per
    at = 0
    while at < total:
        lo = max(count - (at + 1) * per, 0)
        holder = bisect.bisect_right(ends, lo) % len(ends)
        start = 0 if holder == 0 else ends[holder - 1]
        # the buckets from `at` whose lowest element is still this layer's (a bucket of the loss alone:
        # itself)
        upto = at if lo == ends[-1] else (total - 1 if start == 0 else max(at, (count - start) // per - 1))
        full = min(upto, total - 2) - at + 1
        sizes = [(per, full)] if full > 0 else []
        if upto == total - 1:
            sizes.append((last, 1))
        yield holder, sizes
        at = upto + 1


def hideable(cal, layout, bucket_bytes):
    """``(seconds buckets of at most bucket_bytes could hide, seconds left by one bucket of everything)``."""
    whole = exposed(cal, layout, buffer_bytes(cal))
    return max(0.0, whole - exposed(cal, layout, bucket_bytes)), whole


def best_bucket(cal, layout):
    """``(MiB, seconds exposed)`` of the best of :data:`CANDIDATES` (the largest of equals: fewer calls)."""
    whole = buffer_bytes(cal)
    # (up to the first size that holds the whole buffer: any larger is the same one bucket)
    # (and none that cuts it into more than MOST_BUCKETS: the advice costs a bounded time on any model)
    sizes = [size for size in CANDIDATES if size * MIB < whole and whole / (size * MIB) <= MOST_BUCKETS]
    sizes += [next((size for size in CANDIDATES if size * MIB >= whole), CANDIDATES[-1])]
    tried = [(exposed(cal, layout, size * MIB), size) for size in sizes]
    seconds, size = min(tried, key=lambda pair: (round(pair[0], 9), -pair[1]))
    return size, seconds
