"""``python -m mpidist bench``: what mpidist's training costs, against references that say what it should.

For each model (``--batch-per-rank`` samples per rank, MNIST-shaped synthetic
data for ``mlp-wide`` and ``cnn``, the bundled digits' shape otherwise), the
rows of :mod:`mpidist.bench.rows`: mpidist's one process against a
hand-written numpy loop (the floor for framework overhead) and torch where it
is installed; ``allreduce`` against every rank computing with no exchange
(the limit for data parallelism) and against the hand-written loop with one
``Allreduce``; ``ps-sync`` and ``ps-async``; each exchange against the bare MPI
calls that move the same bytes.  Then the pipeline's bubble
(:mod:`mpidist.bench.pipeline`) and, on an even number of ranks, a
transformer block at ``--tensor`` 1 and 2 (:mod:`mpidist.bench.tensor`);
and what a worker holds and sends under each ``allreduce`` layout, beside
the ZeRO paper's count (:mod:`mpidist.bench.sharding`).  ``--tables``
measures some of these four tables only (:data:`TABLES`).

Every figure is a median: of single steps alternating between the rows
compared, then of three interleaved rounds.  Compare ratios from one run
only, with no more ranks than cores.
"""

import contextlib
import os
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info

from ..nn import compiled
from ..runtime.agreement import agreed
from ..runtime.cluster import build_cluster
from ..runtime.errors import RunError
from ..runtime.threads import limit_blas_threads
from . import estimate, reference
from . import rows as rows_of
from .one_process import one_process_rows

# (check_output: the CLI's and tests')
from .output import check_output, format_table, write_results  # noqa: F401
from .pipeline import PIPELINE_COLUMNS, pipeline_rows
from .tensor import TENSOR_COLUMNS, tensor_rows
from .sharding import SHARD_COLUMNS, shard_rows
from .streaming import COLUMNS as STREAMING_COLUMNS
from .streaming import streaming_rows
from .checkpoints import COLUMNS as CHECKPOINT_COLUMNS
from .checkpoints import checkpoint_rows
from .tracing import COLUMNS as TRACING_COLUMNS
from .tracing import tracing_rows
from .layers import COLUMNS as LAYER_COLUMNS
from .layers import layer_rows
from .timing import release, sleep_until_released


def bench_model(world, cluster, name, batch, seconds, rounds=3, optimizer="sgd"):
    """Rows for one model (complete on rank 0; every rank must call).

    The rows are measured in ``rounds`` interleaved rounds (and alternate step
    by step within each) and each figure is the median over rounds, so drift
    on a shared machine affects every row alike instead of landing in one ratio.
    """
    share = seconds / rounds
    measured = []
    for _ in range(rounds):
        rows = one_process_rows(world, name, batch, share, optimizer) + rows_of.parallel_rows(
            world, cluster, name, batch, share, optimizer
        )
        if world.Get_size() > 1:
            rows += [
                rows_of.ps_sync_row(world, name, batch, share, optimizer),
                rows_of.ps_async_row(world, name, batch, share, optimizer),
            ]
        measured.append(rows)
    merged = []
    for index, first in enumerate(measured[0]):
        row = dict(first)
        for key, value in first.items():
            if isinstance(value, float):
                row[key] = float(np.median([rows[index][key] for rows in measured]))
        merged.append(row)
    return add_ratios(merged)


def add_ratios(rows):
    """Each row's samples/s against the references of its group (rows of one model).

    ``vs local``: against mpidist's one process; ``vs hand-written``: local
    against the hand-written loop, allreduce against the hand-written loop with
    one Allreduce; ``vs torch``: local against torch; ``of limit``: every
    multi-rank row against every rank computing with no exchange; ``of sync``:
    each allreduce row against the same with a barrier after each step.
    """
    by_name = {row["strategy"]: row for row in rows}
    speed = {name: row["samples_per_s"] for name, row in by_name.items() if row.get("samples_per_s")}
    for row in rows:
        name = row["strategy"]
        if "local" in speed and name != "local":
            row["samples_vs_local"] = row["samples_per_s"] / speed["local"]
        floor = {"local": "hand-written", "allreduce": "hand-written+Allreduce"}.get(name)
        if floor in speed:
            row["vs_handwritten"] = row["samples_per_s"] / speed[floor]
        if name.startswith("local") and name.replace("local", "torch") in speed:  # (at as many threads)
            row["vs_torch"] = row["samples_per_s"] / speed[name.replace("local", "torch")]
        if row["ranks"] > 1 and "no exchange" in speed and name != "no exchange":
            row["of_limit"] = row["samples_per_s"] / speed["no exchange"]
        if row["ranks"] > 1 and "no exchange, barrier" in speed and name.startswith("allreduce"):
            row["of_sync_limit"] = row["samples_per_s"] / speed["no exchange, barrier"]
    return rows


COLUMNS = [
    ("model", "model", "{}"),
    ("strategy", "row", "{}"),
    ("ranks", "ranks", "{}"),
    ("workers", "workers", "{}"),
    ("steps_per_s", "steps/s per worker", "{:.1f}"),
    ("samples_per_s", "samples/s", "{:,.0f}"),
    ("samples_vs_local", "vs local", "{:.2f}x"),
    ("vs_handwritten", "vs hand-written", "{:.3f}"),
    ("vs_torch", "vs torch", "{:.2f}"),
    ("of_limit", "of limit", "{:.3f}"),
    ("of_sync_limit", "of sync", "{:.3f}"),
    ("exchange_bytes", "bytes/step", "{:,}"),
    ("internode_bytes_per_step", "inter-node B/step", "{:,.0f}"),
    ("exchange_ms", "exchange ms", "{:.3f}"),
    ("bare_ms", "bare MPI ms", "{:.3f}"),
    ("exchange_over_bare", "exchange/bare", "{:.3f}"),
]


def machine():
    """The cores this process may use, the BLAS numpy calls (from threadpoolctl) and the compiled kernels
    (:mod:`mpidist.nn.compiled`), for the header."""
    blas = [
        f"{pool.get('internal_api')} {pool.get('version')} ({pool.get('num_threads')} thread(s))"
        for pool in threadpool_info()
        if pool.get("user_api") == "blas"
    ]
    return {
        "cores": len(os.sched_getaffinity(0)),
        "blas": ", ".join(blas) or "unknown",
        "kernels": compiled.version(),
        "torch": reference.available(),
    }


#: bench's tables, in the order it measures and prints them (``--tables`` picks some)
TABLES = ("strategies", "sharding", "pipeline", "tensor")


#: the strategies table's columns printed by default (the rest stay in the JSON file, and ``--wide`` shows
#: them): within 120 columns
NARROW = ("strategy", "ranks", "samples_per_s", "samples_vs_local", "vs_handwritten", "vs_torch", "of_limit")


def run_bench(world, models, seconds, batch, output, optimizer="sgd", tables=TABLES, wide=False):
    """Run the benchmarks of ``tables`` (every one by default); rank 0 prints each table as it is measured
    (a model's rows once its rounds are done) and writes ``output`` (a table not measured is an empty list
    there).  ``wide``: every column of the strategies table, not the :data:`NARROW` ones.

    ``output`` is checked on rank 0 before anything runs: every rank exits
    with code 2 if the results could not be written there.
    """
    with agreed(world):
        if world.Get_rank() == 0:
            check_output(output)
    cluster = build_cluster(world)
    size, chief = world.Get_size(), world.Get_rank() == 0
    meta = _meta(world, optimizer)
    say = _printer(chief)
    say(_header(meta, batch))
    plan = estimate.Plan(
        tuple(t for t in TABLES if t in tables), tuple(models), size, meta["cores"] > limit_blas_threads()
    )
    say(estimate.said(plan, seconds))
    columns = COLUMNS if wide else [column for column in COLUMNS if column[0] in NARROW]
    measured = {"rows": [], "sharding": [], "pipeline": [], "tensor": []}
    if "strategies" in tables:
        with timed(say, "strategies"):
            _strategies(world, cluster, models, (batch, seconds, optimizer), columns, measured["rows"], say)
        if not wide:
            say("(--wide shows every column: bytes a step, the exchange's time against bare MPI's)")
    if "sharding" in tables:
        say(
            "\nsharding: bytes a worker holds a parameter (the largest rank's; Adam, float32) beside the "
            "ZeRO paper's count, and bytes it sends a step (as a ring)"
        )
        with timed(say, "sharding"):
            for name in models:
                rows = shard_rows(world, cluster, name, batch)
                measured["sharding"] += rows
                say(format_table(rows, SHARD_COLUMNS) if chief else None)
    if "pipeline" in tables and size > 1:
        title = (
            f"\npipeline: {size} stages of equal work (8 x Dense(512)+ReLU), "
            "32 samples per micro-batch; bubble = idle / pipeline time, mean over stages"
        )
        measured["pipeline"] = _table(
            say, chief, title, lambda: pipeline_rows(world, seconds), PIPELINE_COLUMNS
        )
    if "tensor" in tables and size % 2 == 0:
        title = (
            f"\ntensor: the same global batch ({size} x 32 sequences) at --tensor 1 and 2, Adam; "
            "bytes a rank holds, and the activations its tensor group sums per step"
        )
        measured["tensor"] = _table(say, chief, title, lambda: tensor_rows(world, seconds), TENSOR_COLUMNS)
    if not chief:
        return None
    _save(output, {"meta": meta, **measured})
    return measured["rows"]


def _meta(world, optimizer):
    """What the results were measured on (every rank computes it; rank 0's is written)."""
    return {
        "mpi": MPI.Get_library_version().strip().splitlines()[0],
        "ranks": world.Get_size(),
        "blas_threads_per_rank": limit_blas_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **machine(),
        "optimizer": optimizer,
    }


def _header(meta, batch):
    """The lines before the first table: what runs, and which references are left out and why."""
    lines = [
        f"mpidist bench: {meta['ranks']} rank(s) on {meta['cores']} core(s), {batch} samples per rank per "
        f"step, {meta['optimizer']}, BLAS: {meta['blas']}; compiled kernels: {meta['kernels']}; {meta['mpi']}"
    ]
    if meta["optimizer"] != "sgd":
        lines.append(
            "mpidist bench: the hand-written loop and torch use SGD with momentum alone, so their rows are "
            f"left out with --optimizer {meta['optimizer']}"
        )
    elif not meta["torch"]:
        lines.append(
            "mpidist bench: torch is not installed, so its reference rows are left out (pip install torch "
            "adds them)"
        )
    return "\n".join(lines)


def _printer(chief):
    """``say(text)``: rank 0 prints ``text`` at once (stdout is a pipe under mpiexec: flushed), others
    nothing; None prints nothing."""

    def say(text):
        if chief and text is not None:
            print(text, flush=True)

    return say


@contextlib.contextmanager
def timed(say, name):
    """Around the measuring of table ``name``: its time said after it."""
    began = time.perf_counter()
    yield
    say(f"({name}: {time.perf_counter() - began:.0f} s)")


def _table(say, chief, title, measure, columns):
    """A table measured whole (``measure()``, collective), said under ``title`` (its name first) with its
    time; its rows."""
    say(title)
    with timed(say, title.split(":")[0].strip()):
        rows = measure()
        say(format_table(rows, columns) if chief else None)
    return rows


def _strategies(world, cluster, models, run, columns, rows, say):
    """The strategies table: each model's rows measured (``run``: batch, seconds, optimizer), added to
    ``rows`` and printed as soon as its rounds are done."""
    batch, seconds, optimizer = run
    for index, name in enumerate(models):
        say(f"\nstrategies: {name} ({index + 1} of {len(models)}), 3 interleaved rounds")
        measured = bench_model(world, cluster, name, batch, seconds, optimizer=optimizer)
        rows += measured
        say(format_table(measured, columns) if world.Get_rank() == 0 else None)


def run_streaming_bench(world, dataset, model, batch, steps, output, settle=None):
    """``bench --streaming``: rank 0 prints the comparison of :mod:`mpidist.bench.streaming` and writes
    ``output``."""
    return _run_comparison(
        world,
        "streaming",
        streaming_rows,
        STREAMING_COLUMNS,
        5,
        dataset,
        model,
        batch,
        steps,
        output,
        settle=settle,
    )


def run_tracing_bench(world, dataset, model, batch, steps, output):
    """``bench --tracing``: rank 0 prints the comparison of :mod:`mpidist.bench.tracing` and writes
    ``output``."""
    return _run_comparison(
        world, "tracing", tracing_rows, TRACING_COLUMNS, 7, dataset, model, batch, steps, output
    )


def run_checkpoint_bench(world, dataset, model, batch, steps, output):
    """``bench --checkpoints``: rank 0 prints the comparison of :mod:`mpidist.bench.checkpoints`, writes
    ``output``."""
    return _run_comparison(
        world, "checkpoints", checkpoint_rows, CHECKPOINT_COLUMNS, 7, dataset, model, batch, steps, output
    )


def run_layers_bench(world, models, seconds, batch, output):
    """``bench --layers``: rank 0 times each model's layers in mpidist and torch
    (:mod:`mpidist.bench.layers`) while the other ranks sleep, prints the table and writes ``output``."""
    with agreed(world):
        if world.Get_rank() == 0:
            check_output(output)
    if world.Get_rank() != 0:
        sleep_until_released(world)
        return None
    table = [row for name in models for row in layer_rows(name, batch, seconds)]
    release(world)
    meta = {"batch": batch, **machine()}
    print(
        f"mpidist bench --layers: {batch} samples per step, one process, {limit_blas_threads()} BLAS "
        f"thread(s), compiled kernels: {meta['kernels']}; each layer's forward and backward in a "
        f"training step, medians of {seconds:g} s of "
        "steps alternating between mpidist and torch"
        + ("" if reference.available() else " (torch is not installed: pip install torch adds its columns)")
    )
    print(format_table(table, LAYER_COLUMNS))
    _save(output, {"meta": meta, "layers": table})
    return table


def _run_comparison(world, name, measure, columns, rounds, dataset, model, batch, steps, output, **options):
    with agreed(world):
        if world.Get_rank() == 0:
            check_output(output)
    rows = measure(world, dataset, model, batch, steps, rounds=rounds, **options)
    if world.Get_rank() != 0:
        return None
    print(
        f"mpidist bench --{name}: {model} on {dataset}, {world.Get_size()} rank(s), {batch} samples per rank "
        f"per step; median of {rounds} interleaved rounds"
    )
    print(format_table(rows, columns))
    _save(
        output,
        {"meta": {"ranks": world.Get_size(), "model": model, "data": str(dataset), **machine()}, name: rows},
    )
    return rows


def _save(output, document):
    """Write ``document`` to ``output`` (rank 0, after the table is printed), or refuse with a RunError
    naming the path: the table above is then all there is of the results."""
    try:
        write_results(output, document)
    except OSError as err:
        raise RunError(
            f"--output {output}: the results (above) could not be written: {err.strerror or err}"
        ) from None
    print(f"mpidist bench: results in {output}")
