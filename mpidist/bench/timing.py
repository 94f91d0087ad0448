"""Timing that is fair on a shared machine: medians, and calls every rank makes together."""

import contextlib
import shutil
import tempfile
import time

import numpy as np

from ..runtime import comm as mpi
from ..runtime import leftovers


def sleep_until_released(world, root=0):
    """Wait for ``root`` without spinning: an Ibarrier polled with short sleeps."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def release(world):
    world.Ibarrier().Wait()


def timed_steps(step, seconds, min_steps=5):
    """Median seconds per step over windows of about ``seconds / 5``."""
    step()  # warm-up: allocations, caches
    windows, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(windows) < min_steps:
        t0 = time.perf_counter()
        step()
        windows.append(time.perf_counter() - t0)
    return float(np.median(windows)), len(windows)


def in_windows(steps, seconds, rounds=4):
    """Median seconds per call of each of ``steps`` (name -> function), each called alone for a window of
    calls at a time, in turns, ``rounds`` times.

    For candidates that run thread pools of different runtimes (OpenBLAS's,
    torch's OpenMP): their threads spin a while after their work, and in
    single-call turns each took the cores from the other's (torch on 2 threads
    ran 3x slower than on 1).  A window is long enough that the spinning
    after the turn before costs nothing measurable.
    """
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(timed_steps(step, seconds / (rounds * len(steps)))[0])
    return {name: float(np.median(taken)) for name, taken in times.items()}


def synced_timed(world, fn, seconds):
    """Median per-call seconds of a collective ``fn``, called the same number of times on every rank.

    Rank 0 picks the count from a short calibration and broadcasts it: ranks
    that each stopped on their own clock could disagree by one call and leave
    a collective unmatched.
    """
    world.Barrier()
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    per_call = (time.perf_counter() - t0) / 3
    count = np.array([max(5, int(seconds / max(per_call, 1e-6)))], dtype=np.int64)
    mpi.bcast(world, count, root=0)
    times = []
    for _ in range(int(count[0])):
        world.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def balanced_orders(names):
    """The orders of one cycle of turns, in which each name follows each other one equally often.

    Whoever runs right after a candidate that sweeps the caches starts cold,
    so the order must not favour anyone.  Rotating one order does not do
    that: each name then follows the same neighbour in every round (with
    ``local, hand-written, torch``, ``local`` ran after torch in two rounds
    of three and ``hand-written`` never did).  This is Williams' design for
    crossover trials: the first order interleaves from both ends (``0, 1,
    n-1, 2, n-2, ...``), the others shift it, and for an odd count their
    reverses are added; within the rounds of a cycle every ordered pair of
    names is adjacent the same number of times.
    """
    count = len(names)
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    orders = [[names[(index + shift) % count] for index in first] for shift in range(count)]
    return orders + [order[::-1] for order in orders] if count % 2 else orders


def alternating(steps, seconds, min_calls=5):
    """Median seconds per call of each of ``steps`` (name -> function), called in turn, one call each.

    Alternating single calls gives every candidate the same machine: a burst
    of load elsewhere, a frequency change or a cache state lands on all of
    them alike, so their ratio holds where separate windows would drift.  The
    order changes every round (:func:`balanced_orders`), so that within the
    rounds of each cycle of orders each candidate follows each other one as
    often (a run that stops mid-cycle, at its deadline, is off by less than
    one cycle).
    """
    for step in steps.values():
        step()  # warm-up: first-touch allocations, caches
    orders = balanced_orders(list(steps))
    times = {name: [] for name in steps}
    deadline, turn = time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline or turn < min_calls:  # (a round calls each step once)
        for name in orders[turn % len(orders)]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
        turn += 1
    return {name: float(np.median(values)) for name, values in times.items()}


def synced_alternating(world, steps, seconds, min_calls=5, every=False):
    """:func:`alternating` for collectives: every rank calls each step the same number of times, together, in
    turn.

    A barrier before each timed call starts the ranks together (the barrier
    is outside the timing); rank 0 picks the count from a short calibration
    and broadcasts it, since ranks that stopped on their own clocks could
    leave a collective unmatched.  Returns each step's median seconds (with
    ``every``: each call's seconds, turn by turn, to pair the steps of a turn).
    """
    world.Barrier()
    start = time.perf_counter()
    for step in steps.values():
        step()
    per_round = time.perf_counter() - start
    count = np.array([max(min_calls, int(seconds / max(per_round, 1e-6)))], dtype=np.int64)
    mpi.bcast(world, count, root=0)
    orders = balanced_orders(list(steps))
    times = {name: [] for name in steps}
    for turn in range(int(count[0])):  # the same orders on every rank: the count is agreed
        for name in orders[turn % len(orders)]:
            world.Barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    if every:
        return times
    return {name: float(np.median(values)) for name, values in times.items()}


def interleaved_runs(world, modes, run, rounds, prepare=None):
    """Collective: ``run(mode, round)`` (a training :class:`~mpidist.api.Result`) for each mode in turn,
    ``rounds`` times.

    ``prepare(mode)`` runs on every rank before the ranks start together.
    On rank 0: ``{mode: [(samples/s, steps) of each round]}``; elsewhere None.
    """
    measured = {mode: [] for mode in modes}
    for index in range(rounds):
        for mode in modes:
            if prepare is not None:
                prepare(mode)
            world.Barrier()
            result = run(mode, index)
            if world.Get_rank() == 0:
                measured[mode].append((result.figures["samples_per_s"], result.figures["steps"]))
    return measured if world.Get_rank() == 0 else None


def compared_rows(measured, key, ranks, ratio):
    """One row per mode of :func:`interleaved_runs` (``key``: the mode), the second against the first.

    ``ratio``: the ratio of the medians; ``<ratio>_paired``: the median of each
    round's own ratio (drifts of a shared machine cancel within a round).
    """
    rows = [
        {
            key: mode,
            "ranks": ranks,
            "steps": runs[0][1],
            "samples_per_s": float(np.median([r for r, _ in runs])),
            "rounds": [rate for rate, _ in runs],
        }
        for mode, runs in measured.items()
    ]
    base, other = measured.values()
    rows[1][ratio] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    rows[1][f"{ratio}_paired"] = float(np.median([b / a for (a, _), (b, _) in zip(base, other)]))
    return rows


def compared_in_scratch(world, prefix, modes, run, rounds, key, ratio):
    """Collective: :func:`interleaved_runs` of ``run(mode, round, scratch)`` compared as :func:`compared_rows`
    says.

    ``scratch`` is a directory rank 0 makes (named ``prefix...``) for what the runs write, removed at the end.
    Rows on rank 0, else None.
    """
    scratch = mpi.bcast_text(world, tempfile.mkdtemp(prefix=prefix) if world.Get_rank() == 0 else "")
    try:
        # (rank 0 made it: its removal, where a signal ends the command, is rank 0's)
        with leftovers.pending(scratch, tree=True) if world.Get_rank() == 0 else contextlib.nullcontext():
            measured = interleaved_runs(world, modes, lambda mode, index: run(mode, index, scratch), rounds)
    finally:
        world.Barrier()
        if world.Get_rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    return None if measured is None else compared_rows(measured, key, world.Get_size(), ratio)
