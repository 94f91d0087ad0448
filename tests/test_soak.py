"""Soak: random sequences of runs, resumes, kills and signals on one checkpoint directory lose nothing.

Each sequence drives 2-rank runs of the default model on one directory, one
operation at a time, chosen at random (seeded, so a failure names its replay):

- ``resume``: ``--resume auto`` a few steps further, to the end;
- ``kill``: the same, with ``kill -9`` of a random rank at a random moment
  (checkpoints are written every step, so many kills land mid-write);
- ``term``: the same, with SIGTERM to a random rank (exit 3 after a checkpoint);
- ``fresh``: a new run without ``--resume`` (refused with exit 2: the directory is another run's);
- ``branch``: a new run with ``--new-lineage``, killed at a random moment or not;
- ``second``: a second run while one is live (refused with exit 2: the directory is locked).

After every operation: every checkpoint file loads; ``--resume auto`` would
take the lineage whose checkpoint was written last, at that lineage's newest
step; no lineage's newest step went down (nothing newest was ever pruned or
lost); the files of lineages the operation did not run are untouched; and a
``resume`` says it resumed from exactly the file expected.

``MPIDIST_SOAK_SEQUENCES`` sets how many sequences run (CI: a few; the closing
note of the issue that asked for it reports a run of 50).
"""

import os
import random
import signal
import time

import pytest

from mpidist.store import checkpoint
from mpidist.store.lineage import CheckpointDir

from conftest import events, rank_pids, run_mpi, start_mpi

SEQUENCES = int(os.environ.get("MPIDIST_SOAK_SEQUENCES", "3"))
OPERATIONS = (
    ("resume",) * 7 + ("kill",) * 5 + ("term",) * 3 + ("fresh", "fresh", "branch", "second", "second")
)
SLOW = {"MPIDIST_TEST_DELAY": "*:0.02"}


def flags(p, *more, metrics="m.jsonl"):
    return [
        "-m",
        "mpidist",
        "--progress",
        "none",
        "--metrics",
        str(p / metrics),
        "--log-every",
        "1",
        "--epochs",
        "100",
        "--checkpoint-dir",
        str(p / "ck"),
        "--checkpoint-every",
        "1",
        "--checkpoint-wait",
        "--keep",
        "2",
        *more,
    ]


def snapshot(directory):
    """``{lineage: {name: (step, mtime, size)}}`` of the checkpoint files."""
    found = {}
    for entry in CheckpointDir(directory).entries():
        info = entry.path.stat()
        found.setdefault(entry.lineage, {})[entry.path.name] = (entry.step, info.st_mtime_ns, info.st_size)
    return found


def newest_steps(files):
    return {run: max(step for step, _, _ in names.values()) for run, names in files.items()}


def interrupt(p, extra, rng, number):
    """Start a run, let it reach a random step, send ``number`` to a random rank; its exit code."""
    launcher = start_mpi(2, flags(p, *extra), env=SLOW)
    try:
        target, deadline = rng.randint(1, 8), time.monotonic() + 60
        while launcher.poll() is None and time.monotonic() < deadline:
            if any(e["step"] >= target for e in events(p / "m.jsonl", "step")):
                break
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.03))  # anywhere in a step, a checkpoint write included
        pids = rank_pids(launcher)
        if launcher.poll() is None and pids:
            os.kill(pids[rng.choice(sorted(pids))], number)
        launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return launcher.returncode


def second_while_first_runs(p, rng):
    """A run on the directory while another is live: refused, exit 2."""
    first = start_mpi(2, flags(p, "--resume", "auto", "--steps", str(10**6)), env=SLOW)
    try:
        deadline = time.monotonic() + 60
        while not events(p / "m.jsonl", "step") and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        done, _ = run_mpi(2, flags(p, "--resume", "auto", "--steps", "5", metrics="second.jsonl"))
        assert done.returncode == 2 and "is in use by another run" in done.stderr, done.stderr
    finally:
        pids = rank_pids(first)
        if pids:  # the first run stops after a checkpoint
            os.kill(pids[rng.choice(sorted(pids))], signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 3


@pytest.mark.parametrize("sequence", range(SEQUENCES))
def test_no_sequence_of_runs_kills_and_signals_loses_the_newest_checkpoint(tmp_path, sequence):
    rng = random.Random(sequence)
    done, _ = run_mpi(2, flags(tmp_path, "--steps", "3"))
    assert done.returncode == 0, done.stderr
    history = []
    for _ in range(6):
        operation = rng.choice(OPERATIONS)
        history.append(operation)
        replay = f"sequence {sequence}: {' '.join(history)}"
        before = snapshot(tmp_path / "ck")
        expected, _ = checkpoint.newest_valid(tmp_path / "ck")
        further = ["--steps", str(expected.step + rng.randint(2, 8))]
        (tmp_path / "m.jsonl").unlink(missing_ok=True)
        touched = {expected.lineage}
        if operation == "resume":
            done, _ = run_mpi(2, flags(tmp_path, "--resume", "auto", *further), env=SLOW)
            assert done.returncode == 0, (replay, done.stderr)
            assert f"resumed from {expected.path} at step {expected.step}" in done.stdout, replay
        elif operation in ("kill", "term"):
            number = signal.SIGKILL if operation == "kill" else signal.SIGTERM
            code = interrupt(tmp_path, ["--resume", "auto", *further], rng, number)
            # (a kill: whatever the launcher says)
            assert operation == "kill" or code in (0, 3), (
                replay,
                code,
            )
        elif operation == "fresh":
            done, _ = run_mpi(2, flags(tmp_path, *further))
            assert done.returncode == 2 and "holds the checkpoints of another run" in done.stderr, replay
        elif operation == "branch":
            if rng.random() < 0.5:
                done, _ = run_mpi(2, flags(tmp_path, "--new-lineage", "--steps", "4"), env=SLOW)
                assert done.returncode == 0, (replay, done.stderr)
            else:
                interrupt(tmp_path, ["--new-lineage", "--steps", "6"], rng, signal.SIGKILL)
            touched = set()
        else:
            second_while_first_runs(tmp_path, rng)
        after = snapshot(tmp_path / "ck")
        for run, files in before.items():  # other lineages: untouched; the newest step of each: never lower
            if run not in touched:
                assert after.get(run) == files, replay
            assert newest_steps(after)[run] >= newest_steps(before)[run], replay
        for entry in CheckpointDir(tmp_path / "ck").entries():
            checkpoint.load(entry.path)  # every file under a checkpoint name is whole
        latest, skipped = checkpoint.newest_valid(tmp_path / "ck")
        newest_file = CheckpointDir(tmp_path / "ck").last_written()
        assert skipped == [] and latest.lineage == newest_file.lineage, replay
        assert latest.step == newest_steps(after)[latest.lineage], replay
