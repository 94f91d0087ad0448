"""A signal ends a command other than ``train`` where it lands: one line, exit 3, nothing aside, the old
output kept.

(issue 41, items 3 and 8.)  The commands run as one process, without a
launcher, as a user runs them at a terminal; test_faults.py's catalogue runs
the same under mpiexec at 2 and 4 ranks.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpidist.runtime import leftovers
from mpidist.runtime.errors import EXIT_PREEMPTED

from conftest import ROOT, child_environ
from writes import (
    hangups_as_at_a_terminal,
    left_aside,
    made_up_calibration,
    one_line_and_no_traceback,
    run_hooked,
)

STORED_CHECKPOINT = ROOT / "tests" / "checkpoints" / "format1-mlp8-digits.h5"


# Every command that writes a file aside, each stopped while the file is whole but not yet renamed into place:
# (command line, output, whether an output existed before)
WRITERS = {
    "ingest": (["ingest", "synthetic:3000,8,3", "out.h5"], "out.h5", True),
    "ingest --shard-size": (
        ["ingest", "synthetic:3000,8,3", "shards", "--shard-size", "1000"],
        "shards",
        False,
    ),
    "ingest lee-text": (["ingest", "lee-text", "out.h5"], "out.h5", True),
    "predict --output .h5": (["predict", str(STORED_CHECKPOINT), "--output", "p.h5"], "p.h5", True),
    "predict --output .csv": (["predict", str(STORED_CHECKPOINT), "--output", "p.csv"], "p.csv", True),
    "predict --output in directories it makes": (
        ["predict", str(STORED_CHECKPOINT), "--output", "new/sub/p.npy"],
        "new/sub/p.npy",
        False,
    ),
    "plan --output": (
        ["plan", "--calibration", "c.json", "--link", "25GB/s,2us", "--output", "plan.json"],
        "plan.json",
        True,
    ),
}


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("case", list(WRITERS))
def test_a_signal_that_lands_where_exceptions_are_swallowed_still_ends_the_command(tmp_path, case, number):
    """The signal comes inside a ``__del__`` (as it may inside a weak reference's callback, which is where a
    hostile sweep met it): an exception raised there is swallowed, and the command went on to write its output
    and exit 0.  Now: exit 3, one line, nothing aside, the previous output as it was."""
    args, output, existed = WRITERS[case]
    made_up_calibration(tmp_path)
    if existed:
        (tmp_path / output).write_text("the previous output")
    done = run_hooked(tmp_path, f"signal-in-del={int(number)}", *args)
    assert done.returncode == EXIT_PREEMPTED, done.stdout + done.stderr
    line = one_line_and_no_traceback(done.stderr)
    assert line.startswith(f"mpidist: stopped by {signal.Signals(number).name} (rank 0)"), line
    assert not left_aside(tmp_path), left_aside(tmp_path)
    if existed:
        assert (tmp_path / output).read_text() == "the previous output"
    else:  # (nor the directories made for it)
        assert not (tmp_path / Path(output).parts[0]).exists(), Path(output).parts[0]


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_mid_ingest_ends_it_at_once_with_its_line_and_no_file_aside(tmp_path, number):
    """A signal from outside while a large ingest writes (tens of MB): the process is gone within seconds."""
    (tmp_path / "big.h5").write_text("the previous output")
    ingest = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpidist",
            "ingest",
            "synthetic:2000000,50,10",
            "big.h5",
            "--compression",
            "none",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_environ(PYTHONPATH=str(ROOT)),
        preexec_fn=hangups_as_at_a_terminal,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            path.stat().st_size > (1 << 20) for path in tmp_path.glob(".big.h5.tmp-*")
        ):
            time.sleep(0.02)
        ingest.send_signal(number)
        out, err = ingest.communicate(timeout=10)
    finally:
        ingest.kill()
    assert ingest.returncode == EXIT_PREEMPTED, out + err
    assert one_line_and_no_traceback(err).startswith(f"mpidist: stopped by {signal.Signals(number).name}")
    assert not left_aside(tmp_path) and (tmp_path / "big.h5").read_text() == "the previous output"


def test_a_hangup_ignored_by_nohup_stays_ignored(tmp_path):
    """``nohup python -m mpidist ingest ...``: the terminal going away does not stop it."""

    def ignore_hangups():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    ingest = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mpidist",
            "ingest",
            "synthetic:300000,50,10",
            "big.h5",
            "--compression",
            "none",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_environ(PYTHONPATH=str(ROOT)),
        preexec_fn=ignore_hangups,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(tmp_path.glob(".big.h5.tmp-*")):
            time.sleep(0.02)
        ingest.send_signal(signal.SIGHUP)
        out, err = ingest.communicate(timeout=120)
    finally:
        ingest.kill()
    assert ingest.returncode == 0, out + err
    assert (tmp_path / "big.h5").stat().st_size > 0 and not left_aside(tmp_path)


def test_a_signal_while_plan_calibrate_times_the_training_loop_ends_it_with_nothing_written(tmp_path):
    """The run ``plan --calibrate`` times kept the signal for itself (a run stops at a step boundary, its
    caller goes on): the calibration was written, exit 0, its step overhead 0.  Now the command ends there."""
    (tmp_path / "cal.json").write_text("the previous calibration")
    done = run_hooked(
        tmp_path,
        f"signal-in-train={int(signal.SIGTERM)},0.5",
        "plan",
        "--calibrate",
        "--seconds",
        "0.1",
        "--calibration",
        "cal.json",
        env={"MPIDIST_TEST_DELAY": "*:0.05"},
    )
    assert done.returncode == EXIT_PREEMPTED, done.stdout + done.stderr
    assert one_line_and_no_traceback(done.stderr).startswith("mpidist: stopped by SIGTERM (rank 0)")
    assert (tmp_path / "cal.json").read_text() == "the previous calibration"
    assert not left_aside(tmp_path), left_aside(tmp_path)  # (the timed run's scratch folder neither)


def test_leftovers_removes_what_is_pending_newest_first_and_forgets_what_was_left(tmp_path):
    made, aside, scratch = tmp_path / "made", tmp_path / "made" / ".out.tmp-1", tmp_path / "scratch"
    made.mkdir()
    scratch.mkdir()
    (scratch / "inner").mkdir()
    with leftovers.pending(made), leftovers.pending(aside), leftovers.pending(scratch, tree=True):
        aside.write_text("half")
        with leftovers.pending(tmp_path / "renamed"):  # left before the signal: not removed
            (tmp_path / "renamed").write_text("whole")
        leftovers.remove_all()
        assert not made.exists() and not scratch.exists() and (tmp_path / "renamed").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "someone's").write_text("")
    with leftovers.pending(kept):  # a directory made for an output, filled by someone else since: kept
        leftovers.remove_all()
    assert (kept / "someone's").exists()
    leftovers.remove_all()  # (nothing pending: nothing happens)
    assert sorted(path.name for path in Path(tmp_path).iterdir()) == ["kept", "renamed"]


@pytest.fixture
def dispositions():
    """Every signal a command catches as this test found it, given back after the test sets its own: what
    the tests inherit is the launcher's (``nohup`` ignores SIGHUP, a job started with ``&`` by a script
    SIGINT), not what a test asserts."""
    from mpidist.runtime import preempt

    found = {number: signal.getsignal(number) for number in preempt.INTERRUPTS}
    yield
    for number, handler in found.items():
        signal.signal(number, handler)


@pytest.mark.parametrize("launched", ["at a terminal", "by nohup", "in the background of a script"])
def test_a_command_holds_the_handlers_while_it_runs_even_over_a_run_inside_and_gives_them_back(
    dispositions, launched
):
    """SIGHUP ends a command where it was left as it comes (SIG_DFL), and stays ignored under ``nohup``; the
    rest are caught however they came (a script's ``&`` ignores SIGINT, which a command still acts on)."""
    from mpidist.runtime import preempt

    signal.signal(signal.SIGHUP, signal.SIG_IGN if launched == "by nohup" else signal.SIG_DFL)
    signal.signal(
        signal.SIGINT, signal.SIG_IGN if launched.startswith("in the") else signal.default_int_handler
    )
    before = {number: signal.getsignal(number) for number in preempt.INTERRUPTS}
    with preempt.interrupt_on_signals():
        assert signal.getsignal(signal.SIGTERM) is preempt._end_here
        with preempt.stop_signals():  # (a training run the command makes: plan --calibrate, bench)
            assert signal.getsignal(signal.SIGTERM) is preempt._end_here
        assert signal.getsignal(signal.SIGINT) is preempt._end_here
        assert signal.getsignal(signal.SIGHUP) is (
            signal.SIG_IGN if launched == "by nohup" else preempt._end_here
        )
    assert {number: signal.getsignal(number) for number in preempt.INTERRUPTS} == before
    with preempt.stop_signals():  # (and a run after it, as train's own, installs its handlers again)
        assert signal.getsignal(signal.SIGTERM) == preempt.stop_signals()._handle
        assert signal.getsignal(signal.SIGINT) == preempt.stop_signals()._handle


INTERRUPTED_IMPORT = """
import runpy, sys

class Interrupt:  # (Ctrl-C arriving while mpidist's libraries load: as the import of mpidist.nn starts)
    def find_spec(self, name, path, target=None):
        if name == "mpidist.nn":
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupt())
if sys.argv[1] == "cli":  # (python -m mpidist: argv[0] is "-m" while the package loads)
    sys.argv = ["-m", "info"]
    runpy.run_module("mpidist", run_name="__main__")
else:  # (a program of the user's that imports mpidist)
    try:
        import mpidist
    except KeyboardInterrupt:
        print("the program's own interrupt")
"""


@pytest.mark.parametrize("how", ["cli", "program"])
def test_ctrl_c_while_mpidist_loads_stops_the_cli_without_a_traceback(how):
    """Ctrl-C within half a second of a launch showed a KeyboardInterrupt traceback from the imports; a
    program that imports mpidist keeps its KeyboardInterrupt to catch."""
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT, how],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=child_environ(PYTHONPATH=str(ROOT)),
    )
    if how == "cli":
        assert done.returncode == EXIT_PREEMPTED
        assert done.stderr.strip() == "mpidist: stopped by SIGINT while starting"
    else:
        assert done.returncode == 0 and done.stdout.strip() == "the program's own interrupt", done.stderr
