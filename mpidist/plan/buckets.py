"""The gradient bucket size (``--bucket-mb``) that leaves the least exchange after backward.

``allreduce --exchange mpi`` cuts the gradients into buckets from the top
(:func:`mpidist.parallel.exchange.top_down_buckets`) and starts each one's
``Iallreduce`` as soon as backward has finished every layer under it.  Here
backward runs layer by layer from the last, each bucket is ready when the
layer holding its lowest parameter is done, and the link reduces one bucket
at a time: what is left when backward ends is the exchange a step waits for.
Small buckets start early but pay a latency each; one large bucket starts
only after the first layer.

The step prediction itself (:mod:`mpidist.plan.step`) hides none of the
exchange: this model assumes the link moves bytes while the cores compute
(a network card's transfers, MPI's progress driven between layers), which
ranks that do the transfers on the cores they compute on do not get.
"""

from .step import link_between

MIB = 1 << 20
#: bucket sizes tried, in MiB: 1/4 to 1024 by factors of 2
CANDIDATES = tuple(2.0 ** k for k in range(-2, 11))


def exposed(cal, layout, bucket_bytes):
    """Seconds of the exchange left after backward, with buckets of at most ``bucket_bytes``."""
    groups = layout.ranks // layout.tensor
    samples = layout.batch / groups
    link = link_between(cal, layout)
    item = cal.itemsize
    # when backward has finished each layer (from the last, the loss's gradient first)
    done_at, clock = [0.0] * len(cal.layers), cal.loss[0] + cal.loss[1] * samples
    for index in range(len(cal.layers) - 1, -1, -1):
        clock += cal.layers[index].backward[0] + cal.layers[index].backward[1] * samples
        done_at[index] = clock
    starts = [0]
    for layer in cal.layers:
        starts.append(starts[-1] + layer.params)
    total, per_bucket = starts[-1], max(1, int(bucket_bytes) // item)
    link_free = 0.0
    for hi in range(total, 0, -per_bucket):
        lo = max(hi - per_bucket, 0)
        holder = next(index for index in range(len(cal.layers)) if starts[index + 1] > lo)
        nbytes = (hi - lo) * item
        link_free = max(link_free, done_at[holder]) + link.allreduce(nbytes, groups) \
            + (groups - 1) / groups * nbytes * cal.sum_per_byte
    return max(0.0, link_free - clock)


def best_bucket(cal, layout):
    """``(MiB, seconds exposed)`` of the best of :data:`CANDIDATES` (the largest of equals: fewer calls)."""
    whole = cal.params * cal.itemsize
    tried = [(exposed(cal, layout, size * MIB), size) for size in CANDIDATES if size * MIB < 2 * whole or size == 0.25]
    seconds, size = min(tried, key=lambda pair: (round(pair[0], 9), -pair[1]))
    return size, seconds
