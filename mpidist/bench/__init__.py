"""``python -m mpidist bench``: throughput and exchange-overhead figures.

For each model (batch ``--batch-per-rank`` samples per rank, MNIST-shaped
synthetic data for ``mlp-wide``, the bundled digits shape otherwise), one row
per strategy:

* ``local``: one process on rank 0 while the other ranks sleep (they wait in a
  polling loop that sleeps, so they leave the cores free);
* ``allreduce`` on all ranks; ``ps-sync`` and ``ps-async`` with one ps and
  the other ranks as workers (from 2 ranks);
* steps/s per worker and samples/s in all, each also against ``local``;
* exchange: mpidist's exchange per step against the bare MPI calls that move
  the same bytes, interleaved in the same run: one ``Allreduce`` (allreduce);
  ``Reduce_scatter`` + ``Allgatherv`` (ps-sync); an atomic read
  (``Get_accumulate``) + ``Accumulate`` of the whole buffer on one window
  (ps-async: what its pull and push cost without versions, counts and clocks).

Every figure is a median: of repeated timing windows, then of three
interleaved rounds over the strategies.  Compare ratios from one run only.
"""

import json
import os
import secrets
import stat
import time

import numpy as np
from mpi4py import MPI

from . import comm as mpi
from . import nn
from .cluster import build_cluster
from .errors import RunError, UsageError, agreed
from .parallel import AllreduceStrategy, LocalStrategy, PipelineStrategy, PsAsyncStrategy, PsSyncStrategy
from .parallel.pipeline import split_sizes
from .rma import Window

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


def _local_row(world, name, batch, seconds):
    """One process (rank 0) while the others sleep."""
    row = {"model": name, "strategy": "local", "ranks": 1, "workers": 1, "batch_per_rank": batch}
    if world.Get_rank() == 0:
        model, x, y = _problem(name, batch, 0)
        local = LocalStrategy(model, nn.loss_for(10, np), _sgd, seed=0)
        local.initialize()
        counter = iter(range(1 << 30))
        per_step, _ = _timed_steps(lambda: local.train_step(x, y, 1.0, next(counter)), seconds)
        row.update(params=model.num_params, steps_per_s=1 / per_step, samples_per_s=batch / per_step)
        _release(world)
    else:
        _sleep_until_released(world)
    return row


def _allreduce_row(world, cluster, name, batch, seconds):
    size = world.Get_size()
    model, x, y = _problem(name, batch, world.Get_rank())
    strategy = AllreduceStrategy(model, nn.loss_for(10, np), _sgd, cluster, seed=0)
    strategy.initialize()
    counter = iter(range(1 << 30))
    per_step = _synced_timed(world, lambda: strategy.train_step(x, y, 1.0 / size, next(counter)), seconds)
    row = {"model": name, "strategy": "allreduce", "ranks": size, "workers": size, "batch_per_rank": batch,
           "params": model.num_params, "steps_per_s": 1 / per_step, "samples_per_s": size * batch / per_step}
    if size > 1:  # on one rank both are no-ops: a ratio of microseconds would mislead
        bare = np.zeros_like(strategy.buffer)
        _compare(world, row, lambda: strategy.exchange(strategy.buffer),
                 lambda: world.Allreduce(MPI.IN_PLACE, bare), seconds, bare.nbytes)
    return row


def _compare(world, row, exchange, bare, seconds, nbytes):
    """Median time of mpidist's exchange and of the bare MPI calls, interleaved."""
    ours, plain = [], []
    for _ in range(3):  # interleave so drift affects both alike
        ours.append(_synced_timed(world, exchange, seconds / 3))
        plain.append(_synced_timed(world, bare, seconds / 3))
    row.update(exchange_bytes=int(nbytes), exchange_ms=1e3 * float(np.median(ours)),
               bare_ms=1e3 * float(np.median(plain)))
    row["exchange_over_bare"] = row["exchange_ms"] / row["bare_ms"]


def _ps_sync_row(world, name, batch, seconds):
    cluster = build_cluster(world, num_ps=1)
    workers = cluster.num_workers
    model, x, y = _problem(name, batch, world.Get_rank())
    strategy = PsSyncStrategy(model, nn.loss_for(10, np), _sgd, cluster, seed=0)
    strategy.initialize()
    if not strategy.is_worker:
        x = y = None
    counter = iter(range(1 << 30))
    per_step = _synced_timed(world, lambda: strategy.train_step(x, y, 1.0 / workers, next(counter)), seconds)
    row = {"model": name, "strategy": "ps-sync", "ranks": world.Get_size(), "workers": workers,
           "batch_per_rank": batch, "params": model.num_params, "steps_per_s": 1 / per_step,
           "samples_per_s": workers * batch / per_step}
    send, recv = strategy.exchange.copy(), np.zeros_like(strategy.inbox)
    values, counts, displs = strategy.values.copy(), strategy.counts, strategy.displs

    def ours():
        mpi.reduce_scatter_sum(world, strategy.exchange, strategy.inbox, counts)
        mpi.allgatherv_inplace(world, strategy.values, counts, displs)

    def bare():
        world.Reduce_scatter(send, recv, recvcounts=list(counts))
        world.Allgatherv(MPI.IN_PLACE, [values, list(counts), list(displs), MPI.FLOAT])

    _compare(world, row, ours, bare, seconds, send.nbytes)
    cluster.free()
    return row


def _ps_async_row(world, name, batch, seconds):
    """Workers train for ``seconds`` while the ps serves; then exchange against raw window ops."""
    cluster = build_cluster(world, num_ps=1)
    model, x, y = _problem(name, batch, world.Get_rank())
    strategy = PsAsyncStrategy(model, nn.loss_for(10, np), _sgd, cluster, seed=0)
    strategy.initialize()
    ps = strategy.ps_ranks[0]
    raw = Window(world, model.num_params if cluster.rank == ps else 0, np.float32)
    timings = np.zeros(3)   # steps/s, exchange ms, bare ms (workers)
    if strategy.serves:
        strategy.serve()
    else:
        step, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or step < 5:
            strategy.train_step(x, y, 1.0 / cluster.num_workers, step)
            step += 1
        timings[0] = step / (time.perf_counter() - start)
        grads, values = strategy.host_grads, strategy.host_params

        def ours():
            strategy.exchange.pull(values)
            strategy.exchange.push(grads)

        def bare():  # the same atomic operations, called raw: what mpidist adds is the rest
            raw.read(values, ps)
            raw.flush(ps)
            raw.add(grads, ps)
            raw.flush(ps)

        for index, fn in ((1, ours), (2, bare)):
            per_call, _ = _timed_steps(fn, seconds / 2)
            timings[index] = 1e3 * per_call
    strategy.finish()
    totals = mpi.sum_float64(world, timings)
    workers = cluster.num_workers
    raw.free()
    strategy.close()
    cluster.free()
    row = {"model": name, "strategy": "ps-async", "ranks": world.Get_size(), "workers": workers,
           "batch_per_rank": batch, "params": model.num_params, "steps_per_s": totals[0] / workers,
           "samples_per_s": totals[0] * batch, "exchange_bytes": int(2 * model.num_params * 4),
           "exchange_ms": totals[1] / workers, "bare_ms": totals[2] / workers}
    row["exchange_over_bare"] = row["exchange_ms"] / row["bare_ms"]
    return row


def bench_model(world, cluster, name, batch, seconds, rounds=3):
    """Rows for one model (complete on rank 0; every rank must call).

    The strategies are measured in ``rounds`` interleaved rounds and each
    figure is the median over rounds, so drift on a shared machine affects
    every strategy alike instead of landing in one ratio.
    """
    share = seconds / rounds
    measured = []
    for _ in range(rounds):
        rows = [_local_row(world, name, batch, share), _allreduce_row(world, cluster, name, batch, share)]
        if world.Get_size() > 1:
            rows += [_ps_sync_row(world, name, batch, share), _ps_async_row(world, name, batch, share)]
        measured.append(rows)
    merged = []
    for index, first in enumerate(measured[0]):
        row = dict(first)
        for key, value in first.items():
            if isinstance(value, float):
                row[key] = float(np.median([rows[index][key] for rows in measured]))
        merged.append(row)
    local = merged[0].get("samples_per_s")
    for row in merged:
        if local:
            row["samples_vs_local"] = row["samples_per_s"] / local
            row["steps_vs_local"] = row["steps_per_s"] / merged[0]["steps_per_s"]
    return merged


COLUMNS = [("model", "model", "{}"), ("strategy", "strategy", "{}"), ("ranks", "ranks", "{}"),
           ("workers", "workers", "{}"), ("steps_per_s", "steps/s per worker", "{:.1f}"),
           ("steps_vs_local", "vs local", "{:.2f}x"), ("samples_per_s", "samples/s", "{:,.0f}"),
           ("samples_vs_local", "vs local", "{:.2f}x"), ("exchange_ms", "exchange ms", "{:.3f}"),
           ("bare_ms", "bare MPI ms", "{:.3f}"), ("exchange_over_bare", "exchange/bare", "{:.3f}")]


def format_table(rows, columns=None):
    columns = columns or COLUMNS
    header = [title for _, title, _ in columns]
    body = [[fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in columns] for row in rows]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header] + body)


def _uniform_pipeline(stages, xp=np):
    """Eight equal Dense(512)+ReLU pairs and a small head, split evenly: stages do equal work."""
    layers = []
    for _ in range(8):
        layers += [nn.Dense(512), nn.ReLU()]
    layers.append(nn.Dense(10, init="glorot"))
    model = nn.Sequential(layers, (512,), xp=xp, dtype=np.float32)
    pairs = split_sizes(8, stages)
    balance = [2 * n for n in pairs]
    balance[-1] += 1
    return model, balance


def pipeline_rows(world, seconds, micro_batch=32, counts=(2, 4, 8, 16)):
    """Measured bubble (idle over pipeline time, mean over stages) against (P-1)/(M+P-1).

    All ranks form one pipeline (``P`` = ranks, no replicas).
    """
    from .parallel.schedule import bubble
    stages, rows = world.Get_size(), []
    cluster = build_cluster(world)
    for name in ("gpipe", "1f1b"):
        for micro_batches in counts:
            model, balance = _uniform_pipeline(stages)
            batch = micro_batch * micro_batches
            strategy = PipelineStrategy(model, nn.loss_for(10, np), _sgd, cluster, seed=0, stages=stages,
                                        micro_batches=micro_batches, schedule_name=name, balance=balance,
                                        global_batch=batch)
            strategy.initialize()
            rng = np.random.default_rng(0)
            x, y = rng.random((batch, 512), dtype=np.float32), rng.integers(0, 10, batch)
            counter = iter(range(1 << 30))
            strategy.train_step(x, y, 1.0, next(counter))          # warm-up, not counted
            strategy.figures.update(steps=0, pipeline_s=0.0, idle_s=0.0)
            per_step = _synced_timed(world, lambda: strategy.train_step(x, y, 1.0, next(counter)), seconds / 4)
            stats = world.gather(strategy.stats(), root=0)
            strategy.close()
            if world.Get_rank() == 0:
                rows.append({"schedule": name, "stages": stages, "micro_batches": micro_batches,
                             "bubble_measured": float(np.mean([s["bubble"] for s in stats])),
                             "bubble_theory": bubble(stages, micro_batches),
                             "peak_activations": max(s["peak_activations"] for s in stats),
                             "samples_per_s": batch / per_step})
    cluster.free()
    return rows


PIPELINE_COLUMNS = [("schedule", "schedule", "{}"), ("stages", "P", "{}"), ("micro_batches", "M", "{}"),
                    ("bubble_measured", "bubble measured", "{:.1%}"), ("bubble_theory", "(P-1)/(M+P-1)", "{:.1%}"),
                    ("peak_activations", "peak activations", "{}"), ("samples_per_s", "samples/s", "{:,.0f}")]


def _why_not_writable(err):
    """An OSError met while probing where the results go, in words (the message names the path already)."""
    if isinstance(err, FileNotFoundError):
        return "its directory does not exist"
    if isinstance(err, NotADirectoryError):
        return "a part of its path is a file, not a directory"
    if isinstance(err, PermissionError):
        return "permission denied"
    return err.strerror or str(err)


def _create_beside(target):
    """``(file descriptor, path)`` of a new hidden file in ``target``'s directory, created with the usual mode."""
    directory = os.path.dirname(target) or "."
    path = os.path.join(directory, f".mpidist-bench-{os.getpid()}-{secrets.token_hex(4)}.tmp")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path


def _existing_file(target):
    """Raise ``OSError`` or ``ValueError`` unless ``target`` is absent or a regular file that can be appended to.

    Opens to append (never truncates) and closes: the file is left as it was.
    """
    try:
        info = os.stat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        raise ValueError("it is a directory; name a file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("it is not a regular file (a pipe, a socket or a device)")
    try:
        with open(target, "a"):
            pass
    except PermissionError:
        raise ValueError("the file is not writable (permission denied)") from None


def _directory_takes_files(target):
    """Raise ``OSError`` unless a file can be created (and removed) beside ``target``, as the final rename needs."""
    fd, probe = _create_beside(target)
    os.close(fd)
    os.unlink(probe)


def check_output(output):
    """Raise :class:`UsageError` naming ``output`` and the reason if the results could not be written there.

    Called before any benchmark runs, so a bad ``--output`` does not cost the
    run.  Changes nothing: an existing file is opened to append and closed,
    and a probe file is created beside it and removed (the results are
    written aside and renamed over it: its directory must take new files).
    """
    target = os.path.realpath(output)         # a link is followed: its target gets the results
    try:
        _existing_file(target)
        _directory_takes_files(target)
    except ValueError as err:
        raise UsageError(f"--output {output}: cannot be written: {err}") from None
    except OSError as err:
        raise UsageError(f"--output {output}: cannot be written: {_why_not_writable(err)}") from None


def write_results(output, document):
    """Write ``document`` as JSON to ``output`` atomically: aside, then renamed over it.

    An existing results file is replaced whole or left as it was, never half
    written; the new file takes the mode of the one it replaces.
    """
    target = os.path.realpath(output)
    fd, aside = _create_beside(target)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, indent=2)
            handle.flush()
            os.fsync(handle.fileno())
        if os.path.exists(target):
            os.chmod(aside, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(aside, target)
    except BaseException:
        if os.path.exists(aside):
            os.unlink(aside)
        raise


def run_bench(world, models, seconds, batch, output):
    """Run every benchmark; rank 0 prints the table and writes ``output``.

    ``output`` is checked on rank 0 before anything runs: every rank exits
    with code 2 if the results could not be written there.
    """
    with agreed(world):
        if world.Get_rank() == 0:
            check_output(output)
    cluster = build_cluster(world)
    rows = [row for name in models for row in bench_model(world, cluster, name, batch, seconds)]
    pipeline = pipeline_rows(world, seconds) if world.Get_size() > 1 else []
    if world.Get_rank() != 0:
        return None
    meta = {"mpi": MPI.Get_library_version().strip().splitlines()[0], "ranks": world.Get_size(),
            "blas_threads_per_rank": os.environ.get("OMP_NUM_THREADS"), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"mpidist bench: {world.Get_size()} rank(s), {batch} samples per rank per step, "
          f"BLAS threads per rank {meta['blas_threads_per_rank']}, {meta['mpi']}")
    print(format_table(rows))
    if pipeline:
        print(f"\npipeline: {world.Get_size()} stages of equal work (8 x Dense(512)+ReLU), "
              "32 samples per micro-batch; bubble = idle / pipeline time, mean over stages")
        print(format_table(pipeline, PIPELINE_COLUMNS))
    try:
        write_results(output, {"meta": meta, "rows": rows, "pipeline": pipeline})
    except OSError as err:
        raise RunError(f"--output {output}: the results (above) could not be written: "
                       f"{err.strerror or err}") from None
    print(f"mpidist bench: results in {output}")
    return rows
