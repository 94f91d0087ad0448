"""Runs on emulated clusters: N nodes x 2 ranks on this one machine.

MPICH's launcher starts the ranks of each ``-hosts`` name as a node of their
own (``conftest.node_hosts``): they share memory with each other and talk to
the other nodes through MPI's network module, as on a cluster.  Every
strategy trains across nodes; the ps placement, pipelines whose stages span
nodes, a resume on another node layout, streaming data and the refusal of the
shared-memory exchange are checked where the node layout decides them.
"""

import json
import re
from pathlib import Path

import pytest

from mpidist.runtime import comm

from conftest import events, mpidist, strategy_of

LAYOUTS = {"2 nodes x 2": 2, "3 nodes x 2": 3}
PER_NODE = 2
#: each strategy's flags for ``nodes`` nodes of PER_NODE ranks
STRATEGIES = {
    "allreduce": lambda nodes: ["--strategy", "allreduce"],
    "ps-sync": lambda nodes: ["--strategy", "ps-sync", "--ps", "1"],
    "ps-sync --aggregate": lambda nodes: [
        "--strategy",
        "ps-sync",
        "--ps",
        "1",
        "--aggregate",
        str(nodes * PER_NODE - 2),
    ],
    "ps-async": lambda nodes: ["--strategy", "ps-async", "--ps", "1"],
    "pipeline": lambda nodes: ["--strategy", "pipeline", "--stages", str(nodes)],  # a replica spans nodes
    "local-sgd": lambda nodes: ["--strategy", "local-sgd", "--sync-every", "2"],
}


def test_the_table_covers_every_strategy_that_spans_ranks():
    from mpidist.parallel import STRATEGIES as REGISTERED

    assert {strategy_of(flags(2), 4) for flags in STRATEGIES.values()} == set(REGISTERED) - {"local"}


def role_table(stdout):
    """``[(rank, node, role)]`` from the role table the chief prints at start-up."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:4] == ["rank", "host", "node", "pid"])
    rows = []
    for line in lines[start + 1 :]:
        fields = line.split()
        if not fields or not fields[0].isdigit():
            break
        rows.append((int(fields[0]), int(fields[2]), fields[5]))
    return rows


def train(tmp_path, nodes, *flags, epochs=4, timeout=180):
    done, _ = mpidist(
        nodes * PER_NODE,
        "train",
        "--epochs",
        str(epochs),
        "--run-dir",
        str(tmp_path / "run"),
        *flags,
        nodes=nodes,
        timeout=timeout,
    )
    return done


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("strategy", STRATEGIES, ids=list(STRATEGIES))
def test_every_strategy_trains_across_emulated_nodes(tmp_path, strategy, layout):
    nodes = LAYOUTS[layout]
    done = train(tmp_path, nodes, *STRATEGIES[strategy](nodes))
    assert done.returncode == 0, done.stderr
    table = role_table(done.stdout)
    assert [node for _, node, _ in table] == [rank // PER_NODE for rank in range(nodes * PER_NODE)]
    final = events(tmp_path / "run" / "metrics.jsonl", "done")[-1]
    assert final["test_accuracy"] >= 0.8, final  # 4 epochs of the bundled digits, whatever the layout


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_ps_ranks_go_one_per_node_before_a_second_on_any(tmp_path, layout):
    nodes = LAYOUTS[layout]
    done = train(tmp_path, nodes, "--strategy", "ps-sync", "--ps", "2", epochs=1)
    assert done.returncode == 0, done.stderr
    ps_nodes = sorted(node for _, node, role in role_table(done.stdout) if role == "ps")
    assert ps_nodes == [0, 1]
    # the chief
    assert ("0", "worker") == next((str(rank), role) for rank, _, role in role_table(done.stdout))


def test_a_run_resumes_on_another_node_layout(tmp_path):
    checkpoints = tmp_path / "ckpt"
    first = train(tmp_path, 2, "--checkpoint-dir", str(checkpoints), epochs=2)
    assert first.returncode == 0, first.stderr
    written = events(tmp_path / "run" / "metrics.jsonl", "done")[-1]["steps"]
    resumed, _ = mpidist(
        3 * PER_NODE,
        "train",
        "--epochs",
        "4",
        "--checkpoint-dir",
        str(checkpoints),
        "--resume",
        "auto",
        "--run-dir",
        str(tmp_path / "again"),
        nodes=3,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {written}" in resumed.stdout
    final = events(tmp_path / "again" / "metrics.jsonl", "done")[-1]
    assert final["epochs"] == 4 and final["workers"] == 3 * PER_NODE and final["test_accuracy"] >= 0.8


def test_ranks_stream_their_shards_across_nodes(tmp_path):
    done = train(tmp_path, 2, "--data-mode", "stream", epochs=3)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" stream (") == 2 * PER_NODE  # every rank's data column says it streams
    assert events(tmp_path / "run" / "metrics.jsonl", "done")[-1]["test_accuracy"] >= 0.8


def test_the_shared_memory_exchange_is_refused_once_when_workers_span_nodes(tmp_path):
    done = train(tmp_path, 2, "--exchange", "shared-memory", epochs=1)
    assert done.returncode == 2
    assert (
        done.stderr.count(
            "--exchange shared-memory: the workers span more than one node; use --exchange mpi or auto"
        )
        == 1
    )
    auto = train(tmp_path, 2, "--exchange", "auto", "--run-dir", str(tmp_path / "auto"), epochs=1)
    assert auto.returncode == 0, auto.stderr  # auto falls back to MPI's allreduce across nodes


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_info_counts_the_nodes_mpi_sees_whatever_their_host_names(layout):
    nodes = LAYOUTS[layout]
    done, _ = mpidist(nodes * PER_NODE, "info", nodes=nodes)
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("ranks"))
    assert (
        f"{nodes * PER_NODE} on {nodes} node(s): node 0 (" in line and line.count(f") x{PER_NODE}") == nodes
    )


def test_bench_on_emulated_nodes_reports_what_a_node_sends_to_the_others(tmp_path):
    out = tmp_path / "bench.json"
    done = mpidist(
        4,
        "bench",
        *("--seconds", "0.2", "--models", "mlp", "--tables", "strategies", "--output", str(out)),
        nodes=2,
        timeout=180,
    )[0]
    assert done.returncode == 0, done.stderr
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["rows"]}
    assert "allreduce, shared-memory" not in rows  # (a copy per rank with shared gradients: one node only)
    # 2 nodes: each node sends the ring's bound, 2 (N - 1) / N = 1 times its gradient buffer, per step
    assert rows["allreduce"]["internode_bytes_per_step"] == pytest.approx(
        rows["allreduce"]["exchange_bytes"], rel=0.01
    )


def test_with_one_worker_per_node_auto_sums_over_mpi_and_node_is_refused(tmp_path):
    done, _ = mpidist(2, "train", "--epochs", "1", "--run-dir", str(tmp_path / "run"), nodes=2, timeout=120)
    assert done.returncode == 0, done.stderr
    start, final = (events(tmp_path / "run" / "metrics.jsonl", kind)[-1] for kind in ("start", "done"))
    for role, held in zip(final["roles"], start["held_bytes"]):
        assert "internode_bytes_per_step" not in role  # (no ring: MPI's Iallreduce)
        assert held["params"] == 4 * start["params"]  # a copy of its own on each rank
    refused, _ = mpidist(2, "train", "--exchange", "node", nodes=2, timeout=120)
    assert refused.returncode == 2
    assert (
        refused.stderr.count(
            "--exchange node: each node holds one worker, so there is nothing for a node's "
            "ranks to share; use --exchange mpi or auto"
        )
        == 1
    ), refused.stderr


def test_sharded_workers_gather_each_unit_once_per_node_and_with_one_worker_a_node_node_is_refused(tmp_path):
    """--shard parameters on 2 nodes x 2: gathered once per node (auto's choice, and --exchange node's), each
    worker holds half of the one parameter slot and its own gradient slot, 3/4 of what --exchange mpi's
    workers hold, and the two train alike; with one worker a node, --exchange node is refused on every rank
    at once and auto gathers on every rank."""
    flags = ["train", "--shard", "parameters", "--steps", "3", "--eval-every", "0", "--log-every", "1"]

    def run(ranks, exchange, name):
        more = ["--exchange", exchange, "--run-dir", "", "--metrics", str(tmp_path / name)]
        return mpidist(ranks, *flags, *more, nodes=2, timeout=120)[0]

    held, losses = {}, {}
    for exchange in ("node", "mpi"):
        done = run(4, exchange, f"{exchange}.jsonl")
        assert done.returncode == 0, done.stderr
        assert ("gathered once per node of 2" in done.stdout) == (exchange == "node"), done.stdout
        held[exchange] = [
            rank["gathered_units"]
            for rank in events(tmp_path / f"{exchange}.jsonl", "start")[0]["held_bytes"]
        ]
        losses[exchange] = [event["loss"] for event in events(tmp_path / f"{exchange}.jsonl", "step")]
    assert [4 * node for node in held["node"]] == [3 * mpi for mpi in held["mpi"]], held
    assert losses["node"] == pytest.approx(losses["mpi"], rel=1e-5) and len(losses["node"]) == 3
    refused = run(2, "node", "refused.jsonl")
    assert refused.returncode == 2
    assert refused.stderr.count("--exchange node: each node holds one worker") == 1, refused.stderr
    auto = run(2, "auto", "auto.jsonl")
    assert auto.returncode == 0 and "gathered once per node" not in auto.stdout, auto.stderr


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_backup_workers_hear_every_note_across_nodes_even_where_most_are_left_for_later_rounds(
    tmp_path, layout
):
    # --aggregate 1: each round takes one note and leaves the others' for later rounds.  The coordinator once
    # took notes with a receive from any source, which MPICH's network module left unmatched: this run hung
    # every time
    nodes = LAYOUTS[layout]
    done = train(
        tmp_path,
        nodes,
        "--strategy",
        "ps-sync",
        "--ps",
        "1",
        "--aggregate",
        "1",
        "--steps",
        "40",
        "--log-every",
        "1",
        epochs=20,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    final = events(tmp_path / "run" / "metrics.jsonl", "done")[-1]
    (ps,) = [role for role in final["roles"] if "aggregate" in role]
    assert final["steps"] == 40 and ps["updates"] == 40 and ps["accepted"] == 40
    assert ps["dropped"] >= 1  # the notes left for later rounds were heard there (stale) and answered


def test_no_protocol_receives_from_any_source():
    # a posted receive from MPI_ANY_SOURCE hung across nodes (MPICH's UCX module): mpidist receives by name
    # (the stall monitor and the failure watch only poll, with Iprobe)
    receive = re.compile(r"\b(recv|Recv|Irecv|irecv|Probe|Mprobe|Improbe|Mrecv)\([^)]*ANY_SOURCE")
    package = Path(comm.__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(package)}: {match.group(0)}"
        for path in sorted(package.rglob("*.py"))
        for match in receive.finditer(path.read_text())
    ]
    assert found == []
