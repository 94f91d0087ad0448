"""``python -m mpidist bench``: throughput and exchange-overhead figures.

For each model (batch ``--batch-per-rank`` samples per rank, MNIST-shaped
synthetic data for ``mlp-wide``, the bundled digits shape otherwise):

* ``local``: steps/s of one process on rank 0 while the other ranks sleep
  (they wait in a polling loop that sleeps, so they leave the cores free);
* ``allreduce``: steps/s and samples/s of all ranks training together;
* exchange: time of mpidist's gradient exchange (bucketed in-place
  ``Allreduce`` of the flat buffer) against one bare ``comm.Allreduce`` of the
  same number of bytes, interleaved in the same run, as a ratio.

Timings are medians of repeated windows; compare ratios from one run only.
"""

import json
import time

import numpy as np
from mpi4py import MPI

from . import nn
from .cluster import build_cluster
from .parallel import AllreduceStrategy, LocalStrategy

SHAPES = {"mlp-wide": ((28, 28), 10)}   # the 784-512-512-10 MLP of the README's figures
DEFAULT_SHAPE = ((8, 8), 10)             # the bundled digits


def _sleep_until_released(world, root=0):
    """Wait for ``root`` without spinning: an Ibarrier polled with short sleeps."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def _release(world):
    world.Ibarrier().Wait()


def _timed_steps(step, seconds, min_steps=5):
    """Median seconds per step over windows of about ``seconds / 5``."""
    step()  # warm-up: allocations, caches
    windows, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(windows) < min_steps:
        t0 = time.perf_counter()
        step()
        windows.append(time.perf_counter() - t0)
    return float(np.median(windows)), len(windows)


def _synced_timed(world, fn, seconds):
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
    world.Bcast(count, root=0)
    times = []
    for _ in range(int(count[0])):
        world.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _sgd(size):
    return nn.make_optimizer("sgd", size, 0.01)


def _problem(name, batch, seed):
    sample_shape, classes = SHAPES.get(name, DEFAULT_SHAPE)
    rng = np.random.default_rng(seed)
    model = nn.build_model(name, sample_shape, classes, np, np.float32)
    x = rng.random((batch,) + model.input_shape, dtype=np.float32)
    y = rng.integers(0, classes, batch)
    return model, x, y


def bench_model(world, cluster, name, batch, seconds):
    """Figures for one model (rank 0 gets them; every rank must call)."""
    rank, size = world.Get_rank(), world.Get_size()
    row = {"model": name, "ranks": size, "batch_per_rank": batch}

    if rank == 0:
        model, x, y = _problem(name, batch, 0)
        local = LocalStrategy(model, nn.loss_for(10, np), _sgd, seed=0)
        local.initialize()
        counter = iter(range(1 << 30))
        per_step, _ = _timed_steps(lambda: local.train_step(x, y, 1.0, next(counter)), seconds)
        row.update(params=model.num_params, local_steps_per_s=1 / per_step, local_samples_per_s=batch / per_step)
        _release(world)
    else:
        _sleep_until_released(world)

    model, x, y = _problem(name, batch, rank)
    strategy = AllreduceStrategy(model, nn.loss_for(10, np), _sgd, cluster, seed=0)
    strategy.initialize()
    counter = iter(range(1 << 30))
    per_step = _synced_timed(world, lambda: strategy.train_step(x, y, 1.0 / size, next(counter)), seconds)
    row.update(allreduce_steps_per_s=1 / per_step, allreduce_samples_per_s=size * batch / per_step)

    bare = np.zeros_like(strategy.buffer)
    row["exchange_bytes"] = int(bare.nbytes)
    if size > 1:  # on one rank both are no-ops: a ratio of microseconds would mislead
        exchange, plain = [], []
        for _ in range(3):  # interleave so drift affects both alike
            exchange.append(_synced_timed(world, lambda: strategy.exchange(strategy.buffer), seconds / 3))
            plain.append(_synced_timed(world, lambda: world.Allreduce(MPI.IN_PLACE, bare), seconds / 3))
        row.update(exchange_ms=1e3 * float(np.median(exchange)), bare_allreduce_ms=1e3 * float(np.median(plain)))
        row["exchange_over_bare"] = row["exchange_ms"] / row["bare_allreduce_ms"]
    if rank == 0:
        row["speedup_vs_local"] = row["allreduce_samples_per_s"] / row["local_samples_per_s"]
    return row


COLUMNS = [("model", "model", "{}"), ("params", "params", "{:,}"), ("ranks", "ranks", "{}"),
           ("local_steps_per_s", "local steps/s", "{:.1f}"), ("allreduce_steps_per_s", "allreduce steps/s", "{:.1f}"),
           ("allreduce_samples_per_s", "allreduce samples/s", "{:,.0f}"), ("speedup_vs_local", "samples/s vs local",
           "{:.2f}x"), ("exchange_ms", "exchange ms", "{:.3f}"), ("bare_allreduce_ms", "bare Allreduce ms", "{:.3f}"),
           ("exchange_over_bare", "exchange/bare", "{:.3f}")]


def format_table(rows):
    header = [title for _, title, _ in COLUMNS]
    body = [[fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header] + body)


def run_bench(world, models, seconds, batch, output):
    """Run every benchmark; rank 0 prints the table and writes ``output``."""
    cluster = build_cluster(world)
    rows = [bench_model(world, cluster, name, batch, seconds) for name in models]
    if world.Get_rank() != 0:
        return None
    import os
    meta = {"mpi": MPI.Get_library_version().strip().splitlines()[0], "ranks": world.Get_size(),
            "blas_threads_per_rank": os.environ.get("OMP_NUM_THREADS"), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"mpidist bench: {world.Get_size()} rank(s), {batch} samples per rank per step, "
          f"BLAS threads per rank {meta['blas_threads_per_rank']}, {meta['mpi']}")
    print(format_table(rows))
    with open(output, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=2)
    print(f"mpidist bench: results in {output}")
    return rows
