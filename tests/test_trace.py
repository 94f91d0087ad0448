"""--trace: every rank's timeline in one Chrome trace file, for each strategy."""

import collections
import json

import pytest

from mpidist.observe import trace
from mpidist.runtime import recorder

from conftest import mpidist, strategy_of


def test_spans_are_chrome_records_and_nothing_is_kept_while_off():
    tracer = recorder.Tracer()
    with tracer.span("forward", "compute"):
        pass
    assert tracer.events == []
    tracer.enable()
    with tracer.span("forward", "compute", micro_batch=2):
        pass
    tracer.flow(True, recorder.flow_id(0, 5, 0, 1, 4), "activations")
    tracer.phase("compute", 7)
    span, arrow, phase = tracer.records(pid=3, offset=100.0)
    assert span["ph"] == "X" and span["pid"] == 3 and span["tid"] == recorder.MAIN and span["dur"] >= 0
    assert span["args"] == {"micro_batch": 2} and span["cat"] == "compute"
    assert arrow["ph"] == "s" and arrow["id"] == recorder.flow_id(0, 5, 0, 1, 4) and "dur" not in arrow
    assert phase["name"] == "compute" and phase["args"] == {"step": 7}
    assert span["ts"] == pytest.approx(tracer.events[0][3] + 100.0, abs=1e-3)
    assert recorder.flow_id(0, 5, 0, 1, 4) != recorder.flow_id(0, 5, 0, 1, 5) < 1 << recorder.FLOW_BITS


def check_chrome_format(events):
    """The schema of the Chrome trace event format, as Perfetto and chrome://tracing read it."""
    for event in events:
        assert {"ph", "pid", "tid"} <= set(event) and isinstance(event["pid"], int), event
        if event["ph"] != "M":
            assert isinstance(event["ts"], (int, float)) and "name" in event and "cat" in event, event
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
    starts = collections.Counter(e["id"] for e in events if e["ph"] == "s")
    finishes = collections.Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts == finishes  # every arrow has both ends, once
    assert all(e.get("bp") == "e" for e in events if e["ph"] == "f")


def spans(events, pid):
    return {(e["cat"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == pid}


STRATEGIES = {
    "local": (1, []),
    "allreduce": (2, []),
    "local-sgd": (2, ["--strategy", "local-sgd"]),
    "backup workers": (4, ["--strategy", "ps-sync", "--ps", "1", "--aggregate", "2"]),
    "allreduce over MPI buckets": (2, ["--exchange", "mpi", "--bucket-mb", "0.01"]),
    "ps-sync": (3, ["--strategy", "ps-sync", "--ps", "1"]),
    "ps-async": (3, ["--strategy", "ps-async", "--ps", "1"]),
    "pipeline": (2, ["--strategy", "pipeline", "--stages", "2"]),
    "hybrid": (4, ["--strategy", "pipeline", "--stages", "2"]),
}


def test_the_table_covers_every_strategy():
    from mpidist.parallel import STRATEGIES as REGISTERED

    assert {strategy_of(flags, ranks) for ranks, flags in STRATEGIES.values()} == set(REGISTERED)


@pytest.mark.parametrize("case", STRATEGIES, ids=list(STRATEGIES))
def test_a_traced_run_has_a_span_for_every_rank_and_phase(tmp_path, case):
    ranks, flags = STRATEGIES[case]
    done, _ = mpidist(
        ranks, "train", "--epochs", "2", "--trace", *flags, "--progress", "none", cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (run,) = (tmp_path / "runs").iterdir()
    document = json.loads((run / "trace.json").read_text())
    events = document["traceEvents"]
    check_chrome_format(events)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(ranks))
    for rank, name in names.items():
        got = spans(events, rank)
        assert ("checkpoint", "gather") in got and ("wait", "finish") in got, (rank, got)
        if "ps" in name:
            assert ("serve", "serve") in got or ("serve", "update") in got, (name, got)
            continue
        assert {("compute", "forward"), ("compute", "backward"), ("step", "step")} <= got, (name, got)
        assert ("eval", "evaluate test") in got and any(cat == "exchange" for cat, _ in got), (name, got)
        if "stage" in name:
            assert {("pipeline", "send"), ("pipeline", "recv")} <= got, (name, got)
    assert ("checkpoint", "write") in spans(events, 0)  # the chief writes it
    if "buckets" in case:
        assert ("exchange", "bucket") in spans(events, 0)
    if case.startswith("pipeline") or case == "hybrid":
        assert any(e["ph"] == "s" for e in events)
    # the clocks are aligned: each step overlaps on every rank (they wait for each other)
    if case == "allreduce":
        steps = {
            rank: [e for e in events if e["pid"] == rank and e["name"] == "step"] for rank in range(ranks)
        }
        assert len(steps[0]) == len(steps[1]) == 44
        for mine, theirs in zip(steps[0], steps[1]):
            assert mine["ts"] < theirs["ts"] + theirs["dur"] and theirs["ts"] < mine["ts"] + mine["dur"]
    assert "trace.json" in done.stdout


def test_trace_detail_has_a_span_per_layer_and_no_trace_writes_none(tmp_path):
    done, _ = mpidist(
        2,
        "train",
        "--epochs",
        "1",
        "--trace",
        "detail",
        "--run-dir",
        str(tmp_path / "a"),
        "--progress",
        "none",
    )
    assert done.returncode == 0, done.stderr
    events = json.loads((tmp_path / "a" / "trace.json").read_text())["traceEvents"]
    layers = {e["name"] for e in events if e["ph"] == "X" and "layer" in e.get("args", {})}
    assert {"Dense", "ReLU"} <= layers
    done, _ = mpidist(2, "train", "--epochs", "1", "--run-dir", str(tmp_path / "b"), "--progress", "none")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "b" / "trace.json").exists()


def test_bench_tracing_compares_training_with_and_without_the_trace(tmp_path):
    output = tmp_path / "bench.json"
    done, _ = mpidist(
        2,
        "bench",
        "--tracing",
        "digits",
        "--models",
        "mlp",
        "--steps",
        "5",
        "--output",
        str(output),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    off, on = json.loads(output.read_text())["tracing"]
    assert (off["trace"], on["trace"]) == ("off", "on") and off["steps"] == on["steps"] == 5
    assert (
        len(off["rounds"]) == len(on["rounds"]) == 7
        and on["vs_untraced"] == on["samples_per_s"] / off["samples_per_s"]
    )
    assert "vs untraced" in done.stdout
    assert not list(tmp_path.glob("trace.json")) and not (tmp_path / "runs").exists()  # nothing left behind
    done, _ = mpidist(1, "bench", "--tracing", "digits", "--streaming", "digits")
    assert done.returncode == 2 and "two benchmarks: give one" in done.stderr


def test_a_resumed_run_keeps_the_earlier_timeline_and_an_unwritable_one_is_refused_first(tmp_path):
    run = tmp_path / "run"
    done, _ = mpidist(2, "train", "--steps", "10", "--trace", "--run-dir", str(run), "--progress", "none")
    assert done.returncode == 0, done.stderr
    first = (run / "trace.json").read_bytes()
    done, _ = mpidist(
        2,
        "train",
        "--steps",
        "20",
        "--trace",
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        "--progress",
        "none",
    )
    assert done.returncode == 0, done.stderr
    assert (run / "trace.json").read_bytes() == first
    later = json.loads((run / "trace-from-step-10.json").read_text())["traceEvents"]
    assert sorted({e["args"]["step"] for e in later if e["name"] == "step"}) == list(range(11, 21))
    blocked = tmp_path / "blocked"
    (blocked / "trace.json").mkdir(parents=True)
    done, _ = mpidist(2, "train", "--steps", "5", "--trace", "--run-dir", str(blocked), "--progress", "none")
    assert done.returncode == 2 and "is a directory; the timeline is written there as a file" in done.stderr
    assert not list(blocked.glob("*.toml"))  # refused before anything was written


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("root", ["first", "last"])
def test_every_ranks_events_are_written_once_whichever_rank_writes(tmp_path, root):
    """The writing rank's own events are written in their turn, also when ranks before it sent theirs
    first."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    writer = 0 if root == "first" else size - 1
    path = world.bcast(str(tmp_path / "trace.json") if rank == writer else None, root=writer)
    tracer = recorder.tracer()
    tracer.enable()
    tracer.complete(f"mark-{rank}", "compute", recorder.now())
    problem = trace.gather_and_write(world, writer, 0.0, f"rank {rank}", path)
    marks = None
    if rank == writer:
        events = json.loads(open(path, encoding="utf-8").read())["traceEvents"]
        marks = sorted((e["pid"], e["name"]) for e in events if e["name"].startswith("mark-"))
    marks = world.bcast(marks, root=writer)  # every rank asserts the same: none is left waiting
    assert problem is None and not tracer.on
    assert marks == [(r, f"mark-{r}") for r in range(size)]
