"""The command line end to end, under mpiexec: training, resuming, subcommands.

Each run has a timeout: a run that outlives it is reported as a hang.  Bad
input and faults are in tests/test_faults.py.
"""

import ast
import collections
import contextlib
import functools
import importlib.util
import io
import json
import re

import h5py
import numpy as np
import pytest

from mpidist.runtime.errors import UsageError

from conftest import ROOT, checkpoint_at, checkpoint_steps, events, mpidist, start_mpidist

STATED_ACCURACY = 0.90  # README: the default run reaches at least this test accuracy


def test_default_run_at_4_ranks_reaches_the_stated_accuracy_and_writes_metrics(tmp_path):
    done, seconds = mpidist(4, "--metrics", str(tmp_path / "m.jsonl"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("mpidist: done") == 1  # the chief alone reports
    assert "allreduce on 4 worker(s)" in done.stdout and "test accuracy" in done.stdout
    log = events(tmp_path / "m.jsonl")
    kinds = [e["event"] for e in log]
    assert kinds[0] == "start" and kinds[-1] == "done" and "step" in kinds and "eval" in kinds
    step = next(e for e in log if e["event"] == "step")
    assert {"step", "epoch", "loss", "samples_per_s", "time"} <= set(step)
    evaluation = next(e for e in log if e["event"] == "eval")
    assert {"epoch", "test_loss", "test_accuracy"} <= set(evaluation)
    assert log[-1]["test_accuracy"] >= STATED_ACCURACY
    assert log[-1]["steps"] == 20 * 22 and log[-1]["workers"] == 4
    assert seconds < 60
    # the README says what this run reaches, and reads its checkpoint by a parameter's name as it shows
    readme = (ROOT / "README.rst").read_text()
    assert f"a test asserts it; {100 * log[-1]['test_accuracy']:.2f}% with the" in readme
    block = readme.split("Its checkpoint names each parameter")[1].split("::\n\n", 1)[1].split("\n\n")[0]
    snippet = "\n".join(line[4:] for line in block.splitlines())
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        exec(snippet, {})  # (in this test's directory: the run's runs/mlp-digits-allreduce-*/)
    names = ast.literal_eval(shown.getvalue().strip())
    assert names[:4] == ["0001.Dense.W", "0001.Dense.b", "0003.Dense.W", "0003.Dense.b"]


@pytest.mark.parametrize("ranks,ps", [(4, 1), (6, 1), (6, 2)])
def test_ps_sync_trains_the_default_to_the_stated_accuracy(tmp_path, ranks, ps):
    done, _ = mpidist(
        ranks,
        "train",
        "--strategy",
        "ps-sync",
        "--ps",
        str(ps),
        "--metrics",
        str(tmp_path / "m.jsonl"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # the role table: each ps has its index among the ps and its shard under "holds", aligned with the header
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("rank  host"))
    columns = {name: header.index(name) for name in ("index", "device", "holds")}
    servers = [line for line in lines if line[: columns["index"]].split()[-1:] == ["ps"]]
    assert len(servers) == ps and servers[0][columns["holds"] :].startswith("shard [0, "), (header, servers)
    assert [line[columns["index"] : columns["device"]].strip() for line in servers] == [
        str(i) for i in range(ps)
    ]
    final = events(tmp_path / "m.jsonl")[-1]
    assert final["test_accuracy"] >= STATED_ACCURACY and final["ps"] == ps and final["workers"] == ranks - ps
    servers = [r for r in final["roles"] if r["role"] == "ps"]
    assert len(servers) == ps and all(s["updates"] == final["steps"] and s["bytes_in"] > 0 for s in servers)


@pytest.mark.parametrize("ranks,ps", [(4, 2), (6, 2)])
def test_ps_async_reaches_within_2_points_of_ps_sync(tmp_path, ranks, ps):
    """ps-sync is deterministic for a seed; ps-async is not, so its typical run (median of three) is
    compared."""

    def train(strategy, run):
        metrics = tmp_path / f"{strategy}-{run}.jsonl"
        done, _ = mpidist(
            ranks,
            "train",
            "--strategy",
            strategy,
            "--ps",
            str(ps),
            "--metrics",
            str(metrics),
            "--progress",
            "none",
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return events(metrics)[-1]

    sync = train("ps-sync", 0)["test_accuracy"]
    runs = [train("ps-async", run) for run in range(3)]
    accuracies = sorted(final["test_accuracy"] for final in runs)
    assert accuracies[1] >= sync - 0.02, (accuracies, sync)
    assert accuracies[0] >= STATED_ACCURACY and sync >= STATED_ACCURACY
    workers = [r for r in runs[0]["roles"] if r["role"] == "worker"]
    assert len(workers) == ranks - ps and all(w["steps"] == runs[0]["steps"] for w in workers)
    assert all({"staleness_mean", "staleness_max", "updates_missed_max", "wait_s"} <= set(w) for w in workers)
    assert max(w["staleness_max"] for w in workers) <= 2  # the default bound


def test_backup_workers_keep_the_step_rate_when_one_worker_is_slow(tmp_path):
    # The slow worker sleeps a second before each of its steps: steps that waited for it would take 40 s,
    # where the others take one or two (several on a busy machine). The bound, half the slow worker's
    # time, is the point; it was 1 s against the others' 0.5-1 s, and a busy machine took 1.03 s. (The
    # sleep lengthens the run by a second at most: the slow worker is told to stop at its next note.)
    delay, steps = 1.0, 40
    done, _ = mpidist(
        4,
        "train",
        "--strategy",
        "ps-sync",
        "--ps",
        "1",
        "--aggregate",
        "2",
        "--steps",
        str(steps),
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--progress",
        "none",
        env={"MPIDIST_TEST_DELAY": f"2:{delay}"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    final = events(tmp_path / "m.jsonl")[-1]
    assert final["steps"] == steps and final["train_time"] < 0.5 * steps * delay
    server = next(r for r in final["roles"] if r["role"] == "ps")
    assert server["accepted"] == 2 * steps and server["dropped"] >= 1


def test_in_graph_replication_on_any_rank_count_equals_one_process(tmp_path):
    common = ["train", "--metrics", "", "--dtype", "float64", "--steps", "25", "--progress", "none"]
    runs = {
        "local": (1, ["--strategy", "local"]),
        "allreduce-2": (2, ["--strategy", "allreduce", "--replication", "in-graph"]),
        "ps-sync-4": (4, ["--strategy", "ps-sync", "--ps", "1", "--replication", "in-graph"]),
    }
    params = {}
    for name, (ranks, flags) in runs.items():
        done, _ = mpidist(ranks, *common, *flags, "--checkpoint-dir", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        with h5py.File(checkpoint_at(tmp_path / name, 25)) as handle:
            params[name] = handle["params"][...]
    for name in ("allreduce-2", "ps-sync-4"):
        np.testing.assert_allclose(params[name], params["local"], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "ranks,flags",
    [
        (2, ["--stages", "2", "--micro-batches", "8", "--schedule", "1f1b"]),
        (2, ["--stages", "2", "--micro-batches", "8", "--schedule", "gpipe"]),
        (4, ["--stages", "2", "--micro-batches", "8"]),  # hybrid: 2 replicas of 2 stages
        (4, ["--stages", "4", "--micro-batches", "8"]),
    ],
)
def test_pipeline_trains_the_default_to_the_stated_accuracy(tmp_path, ranks, flags):
    done, _ = mpidist(
        ranks,
        "train",
        "--strategy",
        "pipeline",
        *flags,
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--progress",
        "none",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    final = events(tmp_path / "m.jsonl")[-1]
    assert final["test_accuracy"] >= STATED_ACCURACY
    stages = int(flags[1])
    roles = final["roles"]
    assert sorted({r["stage"] for r in roles}) == list(range(stages))
    peak_bound = 8 if "gpipe" in flags else stages
    assert all(r["peak_activations"] <= peak_bound for r in roles)


def test_metrics_are_appended_not_overwritten(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"event": "mine"}\n')
    done, _ = mpidist(2, "--steps", "3", "--metrics", str(metrics))
    assert done.returncode == 0, done.stderr
    assert events(metrics)[0] == {"event": "mine"} and events(metrics)[-1]["event"] == "done"


def test_help_is_printed_once_and_exits_0():
    done, _ = mpidist(2, "train", "--help")
    assert done.returncode == 0
    assert done.stdout.count("usage: python -m mpidist train") == 1
    for flag in (
        "--model",
        "--data",
        "--strategy",
        "--epochs",
        "--steps",
        "--batch-size",
        "--lr",
        "--optimizer",
        "--seed",
        "--metrics",
        "--checkpoint-dir",
        "--resume",
        "--config",
    ):
        assert flag in done.stdout


def test_resumed_training_ends_where_an_uninterrupted_run_ends(tmp_path):
    common = ["--metrics", "", "--epochs", "3"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    done, _ = mpidist(2, *common, "--steps", "30", "--checkpoint-dir", str(whole))
    assert done.returncode == 0, done.stderr
    done, _ = mpidist(2, *common, "--steps", "13", "--checkpoint-dir", str(half))
    assert done.returncode == 0, done.stderr
    done, _ = mpidist(2, *common, "--steps", "30", "--checkpoint-dir", str(half), "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "ckpt-00000013-" in done.stdout
    with h5py.File(checkpoint_at(whole, 30)) as a, h5py.File(checkpoint_at(half, 30)) as b:
        np.testing.assert_array_equal(a["params"][...], b["params"][...])
        np.testing.assert_array_equal(a["optimizer/m"][...], b["optimizer/m"][...])
        assert a.attrs["step"] == b.attrs["step"] == 30
    assert not [p for p in half.iterdir() if p.name.startswith(".ckpt")]  # nothing left aside


@pytest.mark.parametrize(
    "first,then,reference",
    [
        (
            (4, ["--strategy", "allreduce"]),
            (6, ["--strategy", "ps-sync", "--ps", "2"]),
            (4, ["--strategy", "allreduce"]),
        ),
        (
            (2, ["--strategy", "pipeline", "--stages", "2"]),
            (1, ["--strategy", "local"]),
            (1, ["--strategy", "local"]),
        ),
    ],
)
def test_a_checkpoint_resumes_under_another_strategy_and_rank_count_exactly(tmp_path, first, then, reference):
    """Checkpoints hold the whole model: ps shards and pipeline stages are gathered and re-cut on resume."""
    common = ["train", "--metrics", "", "--progress", "none", "--dtype", "float64", "--epochs", "3"]
    done, _ = mpidist(
        first[0], *common, *first[1], "--steps", "17", "--checkpoint-dir", str(tmp_path / "run")
    )
    assert done.returncode == 0, done.stderr
    done, _ = mpidist(
        then[0],
        *common,
        *then[1],
        "--steps",
        "40",
        "--checkpoint-dir",
        str(tmp_path / "run"),
        "--resume",
        "auto",
    )
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "ckpt-00000017-" in done.stdout
    done, _ = mpidist(
        reference[0], *common, *reference[1], "--steps", "40", "--checkpoint-dir", str(tmp_path / "ref")
    )
    assert done.returncode == 0, done.stderr
    with (
        h5py.File(checkpoint_at(tmp_path / "run", 40)) as got,
        h5py.File(checkpoint_at(tmp_path / "ref", 40)) as ref,
    ):
        np.testing.assert_allclose(got["params"][...], ref["params"][...], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got["optimizer/v"][...], ref["optimizer/v"][...], rtol=1e-9, atol=1e-15)


def test_old_checkpoints_are_pruned_and_a_corrupt_newest_one_is_passed_over(tmp_path):
    common = ["train", "--metrics", "", "--progress", "none", "--checkpoint-dir", str(tmp_path)]
    done, _ = mpidist(
        2, *common, "--steps", "20", "--checkpoint-every", "5", "--checkpoint-wait", "--keep", "2"
    )
    assert done.returncode == 0, done.stderr
    assert checkpoint_steps(tmp_path) == [15, 20]
    newest = checkpoint_at(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[:300])
    done, _ = mpidist(2, *common, "--steps", "25", "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"warning: skipped unreadable checkpoint {newest.name}") == 1
    assert "resumed from" in done.stdout and f"{checkpoint_at(tmp_path, 15).name} at step 15" in done.stdout


def test_eval_reports_a_checkpoints_accuracy_over_the_ranks(tmp_path):
    done, _ = mpidist(2, "--metrics", "", "--epochs", "5", "--checkpoint-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    done, _ = mpidist(2, "eval", str(checkpoint_at(tmp_path, 110)))
    assert done.returncode == 0, done.stderr
    accuracy = float(done.stdout.split("test accuracy ")[1].split("%")[0])
    assert accuracy >= 100 * STATED_ACCURACY and "over 359 samples" in done.stdout


def test_ingest_then_train_a_regression(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    np.savez(tmp_path / "lin.npz", x=x, y=x @ np.array([1.0, -2.0, 0.5]))
    done, _ = mpidist(1, "ingest", str(tmp_path / "lin.npz"), str(tmp_path / "lin.h5"))
    assert done.returncode == 0 and "wrote" in done.stdout
    done, _ = mpidist(
        2,
        "--data",
        str(tmp_path / "lin.h5"),
        "--model",
        "linear",
        "--lr",
        "0.05",
        "--epochs",
        "30",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    )
    assert done.returncode == 0, done.stderr
    final = events(tmp_path / "m.jsonl")[-1]
    assert final["test_loss"] < 1e-3 and final["test_mse"] < 1e-3 and final["test_r2"] > 0.999
    # a regression has no accuracy: not in the metrics, the summary or eval
    assert "accuracy" not in (tmp_path / "m.jsonl").read_text() and "accuracy" not in done.stdout
    assert "test R^2" in done.stdout
    done, _ = mpidist(2, "eval", str(sorted((tmp_path / "ck").glob("ckpt-*.h5"))[-1]))
    assert done.returncode == 0, done.stderr
    assert "test MSE" in done.stdout and "accuracy" not in done.stdout
    assert float(done.stdout.split("R^2 ")[1].split()[0]) > 0.999


def test_info_reports_the_mpi_library_and_layout():
    done, _ = mpidist(2, "info")
    assert done.returncode == 0, done.stderr
    # (the row of --elastic: the CI's MPI has no ULFM)
    for text in (
        "MPI library",
        "thread level",
        "CUDA-aware MPI",
        "ranks",
        "2 on 1 node(s)",
        "bundled datasets",
        "no: this is MPICH Version: ",
    ):
        assert text in done.stdout
    # (the CI machine has no GPU: the routes say so)
    assert "GPU routes        no GPU: host arrays go through MPI as they are" in done.stdout
    assert done.stdout.count("MPI library") == 1
    library = next(line for line in done.stdout.splitlines() if line.startswith("MPI library"))
    assert "  " not in library.split("MPI library", 1)[1].strip()  # (the library's own padding: one space)


def _torch_installed():
    return importlib.util.find_spec("torch") is not None


def _one_process_references(cores):
    """The rows beside ``local`` that depend on this machine: torch's, where installed, and every core's,
    where a rank's share (of 2 ranks) is fewer."""
    torch = _torch_installed()
    rows = {"torch"} if torch else set()
    if cores > max(1, cores // 2):
        rows |= {f"local, {cores} threads"} | ({f"torch, {cores} threads"} if torch else set())
    return rows


def test_bench_models_take_arguments_and_are_checked_before_anything_runs():
    from mpidist.runtime.errors import UsageError
    from mpidist.tools.cli import bench_models

    assert bench_models("mlp, transformer:2,64,4,cnn:8,16, mlp-wide") == [
        "mlp",
        "transformer:2,64,4",
        "cnn:8,16",
        "mlp-wide",
    ]
    for bad, named in (("mlp,resnet", "'resnet'"), ("transformer:2,64", "transformer:2,64"), (",", ",")):
        with pytest.raises(UsageError, match="--models") as raised:
            bench_models(bad)
        assert named in str(raised.value)


def test_bench_tables_are_checked_and_come_in_bench_s_order():
    from mpidist.bench import TABLES
    from mpidist.runtime.errors import UsageError
    from mpidist.tools.cli import bench_tables

    assert bench_tables(None) == list(TABLES) == ["strategies", "sharding", "pipeline", "tensor"]
    assert bench_tables(" tensor,strategies,") == ["strategies", "tensor"]
    for bad, named in (("strategies,bubbles", "no table 'bubbles'"), (",", "give one table or more")):
        with pytest.raises(UsageError, match="--tables") as raised:
            bench_tables(bad)
        assert named in str(raised.value) and "choose from strategies,sharding,pipeline,tensor" in str(
            raised.value
        )
    done, _ = mpidist(1, "bench", "--layers", "--tables", "pipeline")
    assert done.returncode == 2, done.stderr
    assert "--tables picks the tables of the default benchmark, not of --layers" in done.stderr


@pytest.mark.parametrize("count", range(1, 9))
def test_bench_s_turns_let_each_candidate_follow_each_other_one_as_often(count):
    """Whoever runs right after a cache-sweeping candidate starts cold: within a cycle of bench's orders every
    ordered pair is adjacent equally often (one order rotated let ``local`` follow torch in two rounds of
    three and ``hand-written`` in none), and ``alternating`` calls the steps in those orders."""
    from mpidist.bench.timing import alternating, balanced_orders

    names = [f"step {index}" for index in range(count)]
    orders = balanced_orders(names)
    assert all(sorted(order) == names for order in orders)
    adjacent = collections.Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert set(adjacent) == {(a, b) for a in names for b in names if a != b}
    assert len(set(adjacent.values())) <= 1, adjacent
    calls = []
    medians = alternating({name: functools.partial(calls.append, name) for name in names}, 0, len(orders))
    assert set(medians) == set(names)
    assert calls[count:] == [name for order in orders for name in order]  # (after one warm-up call each)


def test_bench_layers_times_each_layer_beside_torch(tmp_path):
    """One row per top-level layer, then the rest of the step and the step; torch's columns where it is."""
    out = tmp_path / "layers.json"
    done, _ = mpidist(
        2,
        "bench",
        "--layers",
        "--models",
        "mlp,transformer:1,8,2",
        "--seconds",
        "0.3",
        "--batch-per-rank",
        "16",
        "--output",
        str(out),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    table = json.loads(out.read_text())["layers"]
    kinds = {
        "mlp": ["Flatten()", "Dense(128)", "ReLU()", "Dense(128)", "ReLU()", "Dense(10)"],
        "transformer:1,8,2": [
            "TokenConv(8, kernel=5)",
            "PositionalEmbedding(40)",
            "TransformerBlock(2, mlp_ratio=4)",
            "LayerNorm(eps=1e-05)",
            "SequencePool('mean')",
            "Dense(10)",
        ],
    }
    for model, layers in kinds.items():
        rows = [row for row in table if row["model"] == model]
        assert [row["what"] for row in rows] == layers + ["loss, update, the rest", "training step"]
        for row in rows[:-2]:
            assert row["mpidist_forward_ms"] > 0 and row["mpidist_backward_ms"] >= 0
            assert row["mpidist_ms"] == pytest.approx(row["mpidist_forward_ms"] + row["mpidist_backward_ms"])
        # the first layer learns nothing below it: no input gradient, and a Flatten has no parameters
        assert rows[1]["mpidist_backward_ms"] > 0 and (model != "mlp" or rows[0]["mpidist_backward_ms"] == 0)
        assert rows[-1]["mpidist_ms"] > max(row["mpidist_ms"] for row in rows[:-1])
        for row in rows:
            assert ("torch_ms" in row) == _torch_installed()
            if "torch_ms" in row:
                assert row["vs_torch"] == row["torch_ms"] / row["mpidist_ms"]
    assert "mpidist fwd ms" in done.stdout and "training step" in done.stdout


def test_bench_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    done, _ = mpidist(2, "bench", "--seconds", "0.2", "--models", "mlp", "--output", str(out), timeout=120)
    assert done.returncode == 0, done.stderr
    # the default table fits 120 columns; every column stays in the JSON file, and --wide prints them
    table = done.stdout.split("strategies: mlp (1 of 1)")[1].split("(strategies: ")[0].splitlines()
    assert len(table) > 10 and max(map(len, table)) <= 120, done.stdout
    assert "exchange/bare" not in done.stdout and "(--wide shows every column" in done.stdout
    document = json.loads(out.read_text())
    # (the test extra installs numba: the header says which kernels ran)
    assert document["meta"]["kernels"].startswith("numba ") and "; compiled kernels: numba " in done.stdout
    rows = {row["strategy"]: row for row in document["rows"]}
    assert set(rows) == {
        "local",
        "hand-written",
        "no exchange",
        "no exchange, barrier",
        "allreduce",
        "allreduce, shared-memory",
        "allreduce, mpi",
        "allreduce, mpi, 0.25 MiB",
        "allreduce, mpi, 0.25 MiB, no overlap",
        "allreduce, bf16",
        "allreduce, shard parameters",
        "allreduce, shard parameters, mpi",
        "allreduce, shard parameters, 0.25 MiB",
        "allreduce, shard parameters, 0.25 MiB, kept",
        "hand-written+Allreduce",
        "ps-sync",
        "ps-async",
    } | _one_process_references(document["meta"]["cores"])
    for strategy, row in rows.items():
        assert row["steps_per_s"] > 0 and row["samples_per_s"] > 0
        if strategy != "local":
            assert row["samples_vs_local"] > 0
        if strategy in ("allreduce", "allreduce, shared-memory", "allreduce, mpi", "ps-sync", "ps-async"):
            assert row["exchange_ms"] > 0 and row["bare_ms"] > 0 and row["exchange_over_bare"] > 0
    assert rows["allreduce"]["workers"] == 2 and rows["ps-sync"]["workers"] == 1
    # the ratios the table exists for: against the floor, and against the limit
    assert (
        rows["local"]["vs_handwritten"]
        == rows["local"]["samples_per_s"] / rows["hand-written"]["samples_per_s"]
    )
    assert (
        rows["allreduce"]["of_limit"]
        == rows["allreduce"]["samples_per_s"] / rows["no exchange"]["samples_per_s"]
    )
    assert (
        rows["allreduce"]["of_sync_limit"]
        == rows["allreduce"]["samples_per_s"] / rows["no exchange, barrier"]["samples_per_s"]
    )
    assert rows["allreduce"]["internode_bytes_per_step"] == 0  # (one node: the rings send nothing)
    assert rows["allreduce, bf16"]["exchange_bytes"] == (rows["allreduce"]["exchange_bytes"] - 4) // 2 + 4
    assert document["meta"]["cores"] >= 1 and document["meta"]["blas"]
    assert "core(s)" in done.stdout and "BLAS:" in done.stdout
    # what a worker holds a parameter under each layout: mlp (26,122 parameters) in float32 with Adam at
    # W = 2, one unit at 64 MiB (its parameters and gradients gathered); bytes sent as a ring sends them
    sharding = {row["layout"]: row for row in document["sharding"]}
    assert set(sharding) == {"replicated", "shard optimizer", "shard parameters"}
    assert sharding["replicated"]["held_per_param"] == pytest.approx(16.0, abs=1e-3)  # (+4 B: the loss slot)
    assert sharding["shard optimizer"]["optimizer_state_per_param"] == pytest.approx(4.0, abs=1e-3)
    fully = sharding["shard parameters"]
    assert [fully[f"{kind}_per_param"] for kind in ("params", "grads", "optimizer_state")] == [2.0, 2.0, 4.0]
    assert fully["gathered_units_per_param"] == 8.0 and fully["zero_per_param"] == 8.0
    # a gather and a reduce-scatter of the model, each sending the other worker's half once: an allreduce's
    assert fully["sent_per_step"] == 2 * 26_122 // 2 * 4 == sharding["replicated"]["sent_per_step"]
    # a transformer block (D = 128, MLP 512, 10 classes) of 199,562 parameters; 2,058 of them stay whole at T
    # = 2 (the norms, the biases added after a row-parallel sum, the head), the rest split in halves
    tensor = {row["tensor"]: row for row in document["tensor"]}
    assert tensor[1]["params_bytes"] == 199_562 * 4 and tensor[2]["params_bytes"] == (98_752 + 2_058) * 4, (
        tensor
    )
    assert tensor[2]["optimizer_state_bytes"] == 2 * tensor[2]["params_bytes"]  # Adam: two moments
    # two sums in forward and two in backward, each of the 64 sequences' 32 x 128 activations in float32
    assert (
        tensor[1]["summed_bytes_per_step"] == 0
        and tensor[2]["summed_bytes_per_step"] == 4 * 64 * 32 * 128 * 4
    )
    assert (
        tensor[1]["vs_t1"] == 1.0 and tensor[2]["samples_per_s"] > 0 and "tensor-summed B/step" in done.stdout
    )
    # the pipeline of the 2 ranks under each schedule and micro-batch count, beside its theory (P - 1) / (M +
    # P - 1); GPipe holds every micro-batch's activations at its peak, 1F1B at most P
    pipeline = [(row["schedule"], row["stages"], row["micro_batches"]) for row in document["pipeline"]]
    assert pipeline == [(schedule, 2, m) for schedule in ("gpipe", "1f1b") for m in (2, 4, 8, 16)]
    for row in document["pipeline"]:
        m = row["micro_batches"]
        assert row["bubble_theory"] == pytest.approx(1 / (m + 1))
        assert row["peak_activations"] == (m if row["schedule"] == "gpipe" else 2)
        assert 0 <= row["bubble_measured"] < 1 and row["samples_per_s"] > 0
    assert "bubble measured" in done.stdout


def test_bench_says_how_long_it_will_take_and_prints_each_models_rows_as_they_are_measured(tmp_path):
    """The first model's rows come while the second is still measured (the run has not ended), after a line
    that says about how long the whole run takes, table by table."""
    flags = ["--seconds", "0.1", "--models", "linear,mlp", "--tables", "strategies", "--wide"]
    launcher = start_mpidist(2, "bench", *flags, "--output", str(tmp_path / "b.json"))
    lines, seen_while_running = [], None
    try:
        for line in launcher.stdout:
            lines.append(line)
            if re.search(r"\slocal\s", line) and seen_while_running is None:  # (the first row measured)
                seen_while_running = launcher.poll() is None and "strategies: mlp (2 of 2)" not in "".join(
                    lines
                )
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = "".join(lines)
    assert launcher.returncode == 0, (text, launcher.stderr.read())
    assert seen_while_running, text
    estimate = next(line for line in lines if line.startswith("mpidist bench: about "))
    assert re.match(
        r"mpidist bench: about \d+ s \(strategies \d+ s; twice that on a busy machine\)", estimate
    )
    assert (
        text.index(estimate)
        < text.index("strategies: linear (1 of 2)")
        < text.index("strategies: mlp (2 of 2)")
    )
    assert "exchange/bare" in text and re.search(r"\(strategies: \d+ s\)", text)


def test_bench_with_adam_leaves_out_the_sgd_references(tmp_path):
    out = tmp_path / "bench.json"
    done, _ = mpidist(
        2,
        "bench",
        "--seconds",
        "0.2",
        "--models",
        "mlp",
        "--optimizer",
        "adam",
        "--tables",
        "strategies",
        "--output",
        str(out),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in document["rows"]}
    assert document["meta"]["optimizer"] == "adam"
    # the tables --tables left out are measured not at all: empty in the file, absent from the output
    assert document["sharding"] == document["pipeline"] == document["tensor"] == []
    assert not {"sharding:", "pipeline:", "tensor:"} & set(done.stdout.split())
    assert {"hand-written", "hand-written+Allreduce", "torch"}.isdisjoint(rows)
    assert rows["allreduce"]["of_limit"] > 0 and "vs_handwritten" not in rows["local"]
    assert "left out with --optimizer adam" in done.stdout


def _unwritable_output(tmp_path, case):
    """An ``--output`` path that cannot be written, and the reason the message gives (None: not here, as
    root)."""
    import os

    if case == "a directory":
        return tmp_path, "it is a directory; name a file"
    if case == "under a regular file":
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "bench.json", "a part of its path is a file, not a directory"
    if case == "no such directory":
        return tmp_path / "missing" / "bench.json", "its directory does not exist"
    if case == "a named pipe":
        os.mkfifo(tmp_path / "pipe")
        return tmp_path / "pipe", "it is not a regular file"
    if case == "a read-only directory":
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro").chmod(0o555)
        writable = os.access(tmp_path / "ro", os.W_OK)
        return tmp_path / "ro" / "bench.json", None if writable else "permission denied"
    (tmp_path / "old.json").write_text("{}")  # a read-only results file
    (tmp_path / "old.json").chmod(0o444)
    writable = os.access(tmp_path / "old.json", os.W_OK)
    return tmp_path / "old.json", None if writable else "the file is not writable"


@pytest.mark.parametrize(
    "case",
    [
        "a directory",
        "under a regular file",
        "no such directory",
        "a named pipe",
        "a read-only directory",
        "a read-only file",
    ],
)
def test_bench_refuses_an_unwritable_output_before_it_runs_anything(tmp_path, monkeypatch, capsys, case):
    """No benchmark runs (it would be lost): ``check_output`` names the path, every rank exits with code 2."""
    import re

    from mpi4py import MPI

    from mpidist import bench
    from mpidist.runtime.errors import EXIT_USAGE, UsageError

    output, reason = _unwritable_output(tmp_path, case)
    if reason is None:
        pytest.skip("this user (root) writes whatever the permissions")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(UsageError, match=rf"^--output {re.escape(str(output))}: cannot be written: {reason}"):
        bench.check_output(str(output))

    def no_benchmark(*args, **kwargs):
        raise AssertionError("a benchmark ran before --output was checked")

    monkeypatch.setattr(bench, "build_cluster", no_benchmark)
    with pytest.raises(SystemExit) as stopped:
        bench.run_bench(MPI.COMM_SELF, ["mlp"], 0.1, 8, str(output))
    assert stopped.value.code == EXIT_USAGE
    assert f"mpidist: error: --output {output}: cannot be written: {reason}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no probe file left behind


def test_bench_output_check_leaves_a_writable_path_as_it_was(tmp_path):
    from mpidist.bench import check_output

    check_output(str(tmp_path / "new.json"))
    (tmp_path / "old.json").write_text('{"rows": []}')
    check_output(str(tmp_path / "old.json"))
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]
    assert (tmp_path / "old.json").read_text() == '{"rows": []}'


def test_bench_results_replace_an_existing_file_whole_or_not_at_all(tmp_path):
    import os

    from mpidist.bench import write_results

    path = tmp_path / "bench.json"
    path.write_text('{"old": true}')
    path.chmod(0o640)
    write_results(str(path), {"rows": [1, 2]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]} and (path.stat().st_mode & 0o777) == 0o640
    with pytest.raises(TypeError):  # fails half-way through the JSON
        write_results(str(path), {"rows": [1, object()]})
    assert json.loads(path.read_text()) == {"rows": [1, 2]}  # the old results, whole
    assert os.listdir(tmp_path) == ["bench.json"]  # nothing written aside is left


@pytest.mark.parametrize(
    "ranks,strategy",
    [
        (4, ["--strategy", "ps-sync", "--ps", "1", "--aggregate", "2"]),
        (5, ["--strategy", "ps-async", "--ps", "2"]),
    ],
)
def test_ps_ranks_write_mid_run_checkpoints_when_workers_are_not_in_step(tmp_path, ranks, strategy):
    """The first ps gathers the shards and writes; a resumed run goes on from any of them.  With
    --checkpoint-wait every checkpoint is taken at its step: backup workers' between two rounds, ps-async's
    while the chief holds at its step (the workers never waited for a ps, and one write spanned several
    multiples)."""
    epochs = 3
    common = ["--progress", "none", "--metrics", "", "--epochs", str(epochs), *strategy]
    done, _ = mpidist(
        ranks,
        *common,
        "--checkpoint-dir",
        str(tmp_path),
        "--checkpoint-every",
        "10",
        "--checkpoint-wait",
        "--keep",
        "0",
    )
    assert done.returncode == 0, done.stderr
    steps = checkpoint_steps(tmp_path)
    total = steps[-1]
    assert total == epochs * 22  # 1438 // 64: one sample of each of the 64 lanes a step, on 3 workers too
    middle = steps[:-1]
    assert middle == list(range(10, total, 10))  # exactly at each multiple of 10
    for step in middle:
        with h5py.File(checkpoint_at(tmp_path, step)) as handle:
            assert handle.attrs["step"] == step and np.isfinite(handle["params"][...]).all()
            assert handle["optimizer"].attrs["steps"] > 0 and np.abs(handle["optimizer/v"][...]).sum() > 0
            if "--aggregate" in strategy:  # a consistent state: the optimizer took exactly `step` updates
                assert handle["optimizer"].attrs["steps"] == step
    done, _ = mpidist(
        ranks,
        *common,
        "--checkpoint-dir",
        str(tmp_path / "again"),
        "--resume",
        str(checkpoint_at(tmp_path, middle[1])),
    )
    assert done.returncode == 0, done.stderr
    assert f"at step {middle[1]}" in done.stdout and re.search(rf"\n  steps +{total} ", done.stdout)


def test_bench_s_sharding_table_takes_every_bench_model():
    """One process (W = 1): every layout holds the ZeRO paper's 16 bytes a parameter (gathered units left
    out), for an image model as for an MLP."""
    from mpi4py import MPI

    from mpidist.bench.sharding import shard_rows
    from mpidist.runtime.cluster import build_cluster

    cluster = build_cluster(MPI.COMM_SELF)
    for name in ("cnn", "mlp"):
        rows = shard_rows(MPI.COMM_SELF, cluster, name, 2)
        assert [row["layout"] for row in rows] == ["replicated", "shard optimizer", "shard parameters"]
        assert [row["zero_per_param"] for row in rows] == [16.0] * 3 and rows[0]["sent_per_step"] == 0
    cluster.free()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["train", "--epoch", "3"],
            "unrecognized arguments: --epoch 3 (did you mean --epochs?) (see `python -m",
        ),
        (
            ["--lr-schedul", "cosine"],
            "unrecognized arguments: --lr-schedul cosine (did you mean --lr-schedule?)",
        ),
        (
            ["eval", "c.h5", "--split", "test"],
            "unrecognized arguments: --split test (--split is a flag of predict)",
        ),
        (["trian"], "invalid choice: 'trian' (choose from "),
        (["trian"], ") (did you mean train?) (see `python -m mpidist --help`)"),
        (
            ["train", "--zzz"],
            "unrecognized arguments: --zzz (see `python -m mpidist --help`)",
        ),  # (nothing near)
    ],
)
def test_a_mistyped_flag_or_subcommand_is_answered_with_the_near_one(argv, said):
    """Issue 63, item 8."""
    from mpidist.tools.parsing import parse

    with pytest.raises(UsageError) as refused:
        parse(argv)
    assert said in str(refused.value)


def test_a_mistyped_value_a_zoo_name_or_a_file_to_ingest_is_answered_with_what_was_meant(tmp_path):
    """Issue 63, item 8: a choice's near one, the zoo's spec for a mistyped name (not an import error), and
    ingest for a CSV given to train."""
    from mpidist.data import inspect
    from mpidist.settings.config import Settings
    from mpidist.settings.models import resolve
    from mpidist.settings.validation import check_for

    with pytest.raises(
        UsageError, match=r"--strategy 'pipline' is not one of: .* \(did you mean pipeline\?\)$"
    ):
        check_for(Settings(strategy="pipline"), 2)
    with pytest.raises(
        UsageError, match=r"--optimizer 'sdg' is not one of: adam, sgd \(did you mean sgd\?\)$"
    ):
        Settings(optimizer="sdg").validate_values()
    with pytest.raises(
        UsageError, match=r"'AdamW' is not one of: adam, sgd \(--optimizer adam with --weight-decay"
    ):
        Settings(optimizer="AdamW").validate_values()
    with pytest.raises(
        UsageError, match=r"'mpl' is not in the zoo \(did you mean mlp:128,64\?\); choose from "
    ):
        resolve("mpl:128,64")
    (tmp_path / "rows.csv").write_text("a,b,label\n1,2,0\n")
    with pytest.raises(UsageError) as refused:
        inspect(tmp_path / "rows.csv")
    assert str(refused.value).endswith(
        "; a CSV file is read by ingest, which writes a dataset to train on: python -m mpidist ingest "
        f"{tmp_path / 'rows.csv'} rows.h5"
    )


def test_bench_s_estimate_counts_each_tables_windows_and_set_up():
    from mpidist.bench import estimate

    plan = estimate.Plan(("strategies", "pipeline", "tensor"), ("mlp", "cnn"), ranks=2, every_core=True)
    # per model: one process, every core, allreduce and the two ps rows (5 windows); the pipeline's 2
    assert [estimate.windows(plan, table) for table in plan.tables] == [10, 2, 1]
    assert estimate.seconds(plan, "strategies", 1.0) == 10 + 2 * estimate.SETUP["strategies"]
    assert estimate.windows(estimate.Plan(("strategies",), ("mlp",), ranks=1), "strategies") == 2
    assert estimate.windows(estimate.Plan(("tensor",), ("mlp",), ranks=3), "tensor") == 0  # (odd ranks)
    said = estimate.said(plan, 3.0)
    assert said.startswith("mpidist bench: about 78 s (strategies 66 s, pipeline 8 s, tensor 4 s; twice that")


def test_info_says_which_paths_a_gpu_step_takes(monkeypatch):
    """cuDNN's convolutions or im2col and why, CUDA graphs or eager, NCCL's sums or MPI's (a GPU machine's
    first question; this machine has none, so cupy is a stand-in here)."""
    import sys
    import types

    from mpidist.tools import info

    nccl = types.SimpleNamespace(available=True, get_version=lambda: 22704)
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1), nccl=nccl)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setenv("MPIDIST_CUDNN", "0")
    assert info._gpu_kernels() == (
        "convolutions im2col: MPIDIST_CUDNN=0; passes CUDA graphs; allreduce sums by NCCL 22704"
    )
    monkeypatch.setenv("MPIDIST_GRAPHS", "0")
    nccl.available = False
    assert "passes eager (MPIDIST_GRAPHS=0); allreduce sums by MPI (no NCCL" in info._gpu_kernels()
    cuda.runtime.getDeviceCount = lambda: 0
    assert info._gpu_kernels() == "no GPU"
