"""The gradient bucket size (``--bucket-mb``) that leaves the least exchange after backward.

``allreduce --exchange mpi`` cuts its buffer (the gradients, then the loss)
into buckets from the top (:func:`mpidist.parallel.exchange.top_down_buckets`)
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

from ..parallel.exchange import top_down_buckets

MIB = 1 << 20
#: bucket sizes tried, in MiB: 1/4 to 1024 by factors of 2
CANDIDATES = tuple(2.0 ** k for k in range(-2, 11))


def buffer_bytes(cal):
    """Bytes of the buffer ``allreduce`` sums: the gradients, then the loss."""
    return (cal.params + 1) * cal.itemsize


def exposed(cal, layout, bucket_bytes):
    """Seconds of the exchange left after backward, with buckets of at most ``bucket_bytes``."""
    groups = layout.ranks // layout.tensor
    samples = layout.batch / groups
    link, slower, item = cal.link_for(layout), cal.crowding_for(layout), cal.itemsize
    # when backward has finished each layer (from the last, the loss's gradient first)
    done_at, clock = [0.0] * len(cal.layers), (cal.loss[0] + cal.loss[1] * samples) * slower
    for index in range(len(cal.layers) - 1, -1, -1):
        clock += (cal.layers[index].backward[0] + cal.layers[index].backward[1] * samples) * slower
        done_at[index] = clock
    ends = list(itertools.accumulate(layer.params for layer in cal.layers))   # (each layer's end in the buffer)
    link_free = 0.0
    for lo, hi in top_down_buckets(ends[-1] + 1, item, int(bucket_bytes)):   # (+1: the loss, summed with them)
        holder = bisect.bisect_right(ends, lo) % len(ends)   # (the layer holding element lo; the loss's: the first)
        link_free = max(link_free, done_at[holder]) + link.allreduce((hi - lo) * item, groups)
    return max(0.0, link_free - clock) + (groups - 1) / groups * buffer_bytes(cal) * cal.sum_per_byte


def hideable(cal, layout, bucket_bytes):
    """``(seconds buckets of at most bucket_bytes could hide, seconds left by one bucket of everything)``."""
    whole = exposed(cal, layout, buffer_bytes(cal))
    return max(0.0, whole - exposed(cal, layout, bucket_bytes)), whole


def best_bucket(cal, layout):
    """``(MiB, seconds exposed)`` of the best of :data:`CANDIDATES` (the largest of equals: fewer calls)."""
    whole = buffer_bytes(cal)
    # (up to the first size that holds the whole buffer: any larger is the same one bucket)
    sizes = [size for size in CANDIDATES if size * MIB < whole]
    sizes += [next((size for size in CANDIDATES if size * MIB >= whole), CANDIDATES[-1])]
    tried = [(exposed(cal, layout, size * MIB), size) for size in sizes]
    seconds, size = min(tried, key=lambda pair: (round(pair[0], 9), -pair[1]))
    return size, seconds
