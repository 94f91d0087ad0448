"""Text files read a line at a time, each line bounded (runtime.lines; issue 41, item 10)."""

import os
import subprocess
import sys
import textwrap

import pytest

from mpidist.runtime.errors import UsageError
from mpidist.runtime.lines import LINE_LIMIT, bounded_lines

from conftest import mpidist


def test_lines_are_numbered_and_a_line_over_the_limit_is_refused_naming_it(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"one\n" + b"x" * 9 + b"\n" + b"y" * 10 + b"\nlast")
    got = []
    with pytest.raises(UsageError, match=r"^f: line 3 is longer than 10 bytes"):
        for number, line in bounded_lines(path, "f", limit=10):
            got.append((number, line))
    # (a line of exactly the limit, newline included, passes)
    assert got == [
        (1, "one\n"),
        (2, "x" * 9 + "\n"),
    ]
    path.write_bytes(b"a\n" + b"z" * 10)  # (the last line, without a newline, of the limit)
    assert list(bounded_lines(path, "f", limit=10)) == [(1, "a\n"), (2, "z" * 10)]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_pipe_or_a_directory_is_refused_without_waiting(tmp_path, kind):
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(UsageError, match="not a regular file"):
        list(bounded_lines(path, str(path)))


MEASURE = textwrap.dedent("""
    import sys, tracemalloc
    from pathlib import Path
    from mpidist.runtime.errors import UsageError
    from mpidist.plan.check import read_layout
    from mpidist.tools import csv_table, plotting

    folder = Path(sys.argv[1])
    readers = {"plot": lambda: plotting.read_run(folder / "run"),
               "plan --check": lambda: read_layout(folder / "run"),
               "ingest": lambda: csv_table.read_csv(folder / "wide.csv")}
    for name, read in readers.items():
        tracemalloc.start()
        try:
            said = read()
        except UsageError as err:
            said = str(err)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(f"{name}\\t{peak}\\t{said}")
""")


def test_one_line_of_64_mib_is_refused_by_every_reader_in_bounded_memory(tmp_path):
    """``plot`` and ``plan --check`` read a metrics file of one 1 GiB line whole (2.1 GB) before their check;
    ``ingest`` and ``predict`` read a CSV whole.  Each now holds at most the limit of one line."""
    size = 64 << 20
    (tmp_path / "run").mkdir()
    for path in (tmp_path / "run" / "metrics.jsonl", tmp_path / "wide.csv"):
        with open(path, "wb") as handle:
            handle.write(b'{"event": "step", "step": 1, "pad": "' if path.suffix == ".jsonl" else b"1,")
            handle.truncate(size)  # (a sparse file of zeros: no newline anywhere)
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t", 2) for line in done.stdout.splitlines()]
    assert [row[0] for row in rows] == ["plot", "plan --check", "ingest"]
    for name, peak, said in rows:
        assert "line 1 is longer than 16,777,216 bytes" in said, (name, said)
        # (old: > 128 MiB)
        assert int(peak) < LINE_LIMIT * 2 + (8 << 20), f"{name} held {int(peak) >> 20} MiB"


def test_plot_of_a_metrics_file_of_one_long_line_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b"x" * (LINE_LIMIT + 10))
    done, _ = mpidist(1, "plot", str(tmp_path), "--output", str(tmp_path / "plots"))
    assert done.returncode == 2, done.stderr
    assert (
        "metrics.jsonl: line 1 is longer than 16,777,216 bytes" in done.stderr
        and "Traceback" not in done.stderr
    )
    assert not (tmp_path / "plots").exists()
