"""What two ranks of ``plan --calibrate`` measure together: a link, how much they crowd each other, overlap.

Every function here is collective over the world and measures on a pair (:func:`_on_pair`): rank 0 and the
next rank on its node, or on another node, the other ranks waiting.  Pairs sum buffers of 8 B to 32 MiB (an
``Allreduce`` of the two), within a node and, where there are several, between two nodes; a line through
the times gives each link's latency and time per byte as the collectives see it (their sums and copies
included: :func:`measured_link`).  The same pairs train side by side, in blocks, to measure how much they
slow each other and how far apart their steps end (:func:`crowding`), and run ``allreduce --exchange mpi``
with its buckets reduced during backward and after it, to measure how much of the exchange backward hides
(:func:`overlap_times`, weighed by :func:`overlap_share`).  Its own module because these measurements need
a second rank and MPI, where :mod:`~mpidist.plan.measure`'s figures of the model are rank 0's alone.
"""

import time

import numpy as np
from mpi4py import MPI

from .. import nn
from ..bench.timing import release, sleep_until_released
from ..loop.setup import Inputs, build_model_for
from ..runtime import comm as mpi
from .buckets import hideable
from .layout import Layout
from .links import Link, fit
from .pass_times import REPEATS
from .step import slowest_of

SIZES = [8 << (2 * k) for k in range(12)]  # 8 B .. 32 MiB by factors of 4

BLOCKS = 4  # crowding's blocks of each kind, interleaved


def crowding(world, node_of_rank, same_node, trainer, seconds):
    """``(crowding, spread)`` on rank 0: how much slower its step runs while the next rank on its node
    (``same_node``; or on another node) trains too than while that rank sleeps (ranks that share a node's
    memory and caches slow each other), and the spread of the two's step times as a synchronous step meets
    it (what waiting for the slower adds).  Measured in :data:`BLOCKS` blocks of each, in turn: rank 0 alone,
    the two together, the two waiting for each other after each step.  Blocks, not single steps: a host
    slows two cores kept busy more than two that take turns (one block alone and one together, minutes
    apart, gave 1.0 to 1.24 for the same pair; single steps in turn, 1.04-1.07 where runs met 1.15).
    ``(1.0, None)`` where there is no such rank.  Every rank calls; two of them train."""

    def measure(pair):
        first = pair.Get_rank() == 0
        start = time.perf_counter()
        trainer.step()
        steps = max(REPEATS, int(seconds / BLOCKS / 3 / max(time.perf_counter() - start, 1e-6)))
        count = np.array([steps], dtype=np.int64)
        mpi.bcast(pair, count, root=0)  # (rank 0's count: the pair takes as many steps)
        alone, together, waited = [], [], []
        for _ in range(BLOCKS):
            if first:  # alone: its partner asleep (not spinning in a barrier, which would take a core)
                _timed(trainer.step, count[0], alone)
                release(pair)
            else:
                sleep_until_released(pair)
            pair.Barrier()
            _timed(trainer.step, count[0], together)
            pair.Barrier()
            _timed(trainer.step, count[0], waited, pair)  # (as a synchronous step: each waits for the slower)
        if not first:
            return None
        # the wait for the slower of two is 1/sqrt(pi) standard deviations of a step: the spread as it acts
        spread = (np.median(waited) - np.median(together)) / np.median(together) / slowest_of(2)
        return max(1.0, float(np.median(together) / np.median(alone))), max(0.0, float(spread))

    made = _on_pair(world, node_of_rank, same_node, measure)
    return (1.0, None) if made is NO_PAIR else made


def _timed(step, count, into, pair=None):
    """``count`` calls of ``step``, each one's seconds appended to ``into``; with ``pair``, each between two
    barriers (timed to the second: the wait for the slower rank)."""
    for _ in range(int(count)):
        if pair is not None:
            pair.Barrier()
        start = time.perf_counter()
        step()
        if pair is not None:
            pair.Barrier()
        into.append(time.perf_counter() - start)


NO_PAIR = object()  # what :func:`_on_pair` gives where there is no second rank to measure with


def _on_pair(world, node_of_rank, same_node, measure):
    """Collective: ``measure(pair)`` on rank 0 and the next rank on its node (``same_node``) or on another
    node, over a communicator of the two, the other ranks waiting; its result on rank 0 (None on the others),
    or :data:`NO_PAIR` on every rank where there is no such rank."""
    partner = next(
        (r for r in range(1, world.Get_size()) if (node_of_rank[r] == node_of_rank[0]) == same_node), None
    )
    if partner is None:
        return NO_PAIR
    pair = world.Split(0 if world.Get_rank() in (0, partner) else MPI.UNDEFINED, key=world.Get_rank())
    made = None
    if pair != MPI.COMM_NULL:
        made = measure(pair)
        pair.Free()
    world.Barrier()
    return made if world.Get_rank() == 0 else None


def overlap_times(world, node_of_rank, config, trainer, seconds):
    """Collective: on rank 0 and the next rank on another node (else on its node), the times of a local step
    and of ``allreduce --exchange mpi`` steps with buckets of a quarter of the gradients, reduced as backward
    fills them and after it, interleaved; ``(times, bucket bytes, nodes of the pair)`` on rank 0 (None
    elsewhere, or without a second rank)."""
    model = trainer.model
    bucket = max(1 << 12, (model.num_params + 1) * np.dtype(model.dtype).itemsize // 4)

    def measure(pair):
        from ..bench.timing import synced_alternating
        from ..parallel import AllreduceStrategy
        from ..parallel.data.exchange import Exchange
        from ..runtime.cluster import build_cluster

        cluster = build_cluster(pair)
        inputs, info = Inputs.of(config), trainer.info
        loss = nn.loss_for(info.num_classes, np)
        owners = {
            name: AllreduceStrategy(
                build_model_for(config, inputs, info, np),
                loss,
                trainer.make,
                cluster,
                seed=config.seed,
                exchange="mpi",
                bucket_bytes=bucket,
            )
            for name in ("overlapped", "after backward")
        }
        for owner in owners.values():
            owner.initialize()
        late = owners["after backward"]
        late.exchange = Exchange(late.worker_comm, late.buffer, late.bucket_bytes, overlap=False)
        counter = iter(range(1 << 30))
        steps = {"alone": trainer.step}
        steps.update(
            {
                name: lambda owner=owner: owner.train_step(trainer.x, trainer.y, 0.5, next(counter))
                for name, owner in owners.items()
            }
        )
        times = synced_alternating(pair, steps, 2 * seconds, every=True)
        for owner in owners.values():
            owner.free()
        cluster.free()
        return times

    # (across nodes where there are two: the link that counts)
    for same_node, nodes in (
        (False, 2),
        (True, 1),
    ):
        times = _on_pair(world, node_of_rank, same_node, measure)
        if times is not NO_PAIR:
            return (times, bucket, nodes) if world.Get_rank() == 0 else None
    return None


def overlap_share(cal, measured):
    """The share of what buckets could hide (the bucket model's) that the measured steps hid: the median of
    each turn's ``after backward - overlapped`` over the exchange (``after backward - alone``), against the
    model's ``(one bucket - these buckets) / one bucket``.  0 where nothing was measured, where the buckets
    could hide next to nothing, or where what was hidden is within the turns' noise: a machine that overlaps
    nothing must not be credited with its noise."""
    if measured is None:
        return 0.0
    times, bucket, nodes = measured
    late, early = np.asarray(times["after backward"]), np.asarray(times["overlapped"])
    exchange = float(np.median(late) - np.median(times["alone"]))
    gains = late - early
    gained = float(np.median(gains))
    # beyond noise: three standard errors of the median, and more turns gaining than losing by three standard
    # deviations of a fair coin's count (this machine's steps stretch at random, by more than the gain)
    noise = 3 * 1.2533 * float(np.std(gains)) / np.sqrt(len(gains))
    wins = int(np.sum(gains > 0)) - len(gains) / 2
    layout = Layout("allreduce", nodes, 2 // nodes, 2 * cal.batch_per_rank, exchange="mpi")
    if exchange <= 0 or gained <= noise or wins <= 1.5 * np.sqrt(len(gains)) or cal.link_for(layout) is None:
        return 0.0
    hidden, whole = hideable(cal, layout, bucket)
    could = hidden / whole if whole > 0 else 0.0
    return float(min(1.0, gained / exchange / could)) if could > 0.02 else 0.0


def measured_link(world, node_of_rank, same_node):
    """The :class:`Link` between rank 0 and the next rank on its node (``same_node``) or on another node, as
    the collectives see it: an ``Allreduce`` of ``n`` bytes over the two, a ring's two steps of ``n / 2``,
    takes ``2 latency + n per_byte`` (sums and copies included); None where there is no such rank.  Every
    rank calls; two of them measure."""

    def measure(pair):
        seconds = []
        for size in SIZES:
            buffer = np.ones(size // 4, dtype=np.float32)
            trips = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                mpi.allreduce_sum(pair, buffer)
                trips.append(time.perf_counter() - start)
            seconds.append(float(np.median(trips[1:])))
        return seconds

    seconds = _on_pair(world, node_of_rank, same_node, measure)
    if seconds is NO_PAIR or world.Get_rank() != 0:
        return None
    whole = fit([4 * (size // 4) for size in SIZES], seconds)
    return Link(whole.latency / 2, whole.per_byte)
