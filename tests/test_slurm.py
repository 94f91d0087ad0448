"""The scripts in slurm/, submitted with sbatch to a real (private, single-node) Slurm.

Needs Debian's slurm-wlm (``.ci/run`` installs it).  Without it these tests
skip, saying so -- unless ``MPIDIST_REQUIRE_SLURM=1`` (set by CI), where a
missing Slurm is a failure, so CI can never pass by skipping them.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, checkpoint_at
from slurm_cluster import PrivateSlurm, missing_commands

SCRIPTS = ROOT / "slurm"
CPU_SCRIPTS = ["train-cpu.sbatch", "train-cpu-srun.sbatch", "train-requeue.sbatch"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_commands()
    if missing:
        reason = f"Slurm is not installed (no {', '.join(missing)}; apt-get install slurm-wlm)"
        if os.environ.get("MPIDIST_REQUIRE_SLURM") == "1":
            pytest.fail(reason + ", and MPIDIST_REQUIRE_SLURM=1 says these tests must run")
        pytest.skip(reason)
    cluster = PrivateSlurm(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def job_env(**extra):
    """What a job needs to find this checkout's mpidist and its venv's mpiexec (sbatch exports it)."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        "MPIDIST_PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        **extra,
    }


def submit(slurm, tmp_path, script, *flags, sbatch=(), wait=True, env=None):
    """``sbatch SBATCH slurm/SCRIPT FLAGS`` from ``tmp_path``; returns (CompletedProcess, job id).

    ``wait``: until the job ends, with the job's exit code as the CompletedProcess's, as ``sbatch --wait``
    gives -- but looked at every 0.2 s: ``--wait`` looks after 2, 3, 4, ... s, and a job of 6 s took 10.
    """
    command = ["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", *sbatch]
    done = slurm.run(
        *command, str(SCRIPTS / script), *flags, cwd=tmp_path, env=job_env(**(env or {})), timeout=180
    )
    match = re.match(r"^(\d+)", done.stdout.strip())
    job = int(match.group(1)) if match else None
    if wait and job is not None:
        fields = slurm.wait_for_end(job, timeout=180)
        code, signal_number = map(int, fields["ExitCode"].split(":"))
        done.returncode = code or (128 + signal_number if signal_number else 0)
    return done, job


def output(tmp_path, job):
    return (tmp_path / f"job-{job}.out").read_text()


def metrics(tmp_path, job):
    path = tmp_path / "runs" / str(job) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("script", CPU_SCRIPTS)
def test_every_cpu_script_trains_to_the_end(slurm, tmp_path, script):
    done, job = submit(slurm, tmp_path, script, "--epochs", "3")
    log = output(tmp_path, job) if job else ""
    assert done.returncode == 0, f"{done.stderr}\n{log}\n{slurm.logs()}"
    assert "strategy allreduce on 4 worker(s)" in log and "mpidist: done" in log
    final = metrics(tmp_path, job)[-1]
    assert final["event"] == "done" and final["steps"] == 66 and final["test_accuracy"] > 0.9
    assert checkpoint_at(tmp_path / "runs" / str(job) / "checkpoints", 66).exists()
    assert slurm.job(job)["ExitCode"] == "0:0"


def test_a_ps_strategy_gets_one_ps_per_node_and_flags_override_the_script(slurm, tmp_path):
    done, job = submit(
        slurm, tmp_path, "train-cpu.sbatch", "--strategy", "ps-sync", "--steps", "10", sbatch=["--ntasks=3"]
    )
    log = output(tmp_path, job)
    assert done.returncode == 0, log
    assert "strategy ps-sync on 2 worker(s) and 1 ps" in log and metrics(tmp_path, job)[-1]["steps"] == 10


def test_a_bad_flag_fails_the_job_with_mpidists_exit_code(slurm, tmp_path):
    done, job = submit(slurm, tmp_path, "train-cpu-srun.sbatch", "--epochs", "0")
    assert done.returncode == 2
    assert slurm.job(job)["ExitCode"] == "2:0"
    assert output(tmp_path, job).count("mpidist: error: --epochs must be at least 1, got 0") == 1


def test_a_request_the_cluster_cannot_hold_is_refused_at_submission(slurm, tmp_path):
    done, job = submit(slurm, tmp_path, "train-cpu.sbatch", sbatch=["--ntasks=64"], wait=False)
    assert done.returncode != 0 and job is None
    assert "More processors requested than permitted" in done.stderr


def test_the_gpu_script_is_refused_where_there_are_no_gpus(slurm, tmp_path):
    done, job = submit(slurm, tmp_path, "train-gpu.sbatch", wait=False)
    assert done.returncode != 0 and job is None
    assert "Invalid generic resource (gres) specification" in done.stderr


@pytest.mark.parametrize(
    "tasks, gpus",
    [("5", None), (None, "4"), ("5,4", "4")],  # (no GPUs; no --ntasks-per-node; nodes unlike)
    ids=["no-gpus", "no-ntasks-per-node", "nodes-unlike"],
)
def test_the_gpu_script_checks_its_gpu_request_itself(tmp_path, tasks, gpus):
    """Run as a plain script (as under a Slurm that grants no GPUs, or a job without --ntasks-per-node,
    which died on an unbound variable): a clear message, exit 2."""
    import subprocess

    env = dict(os.environ, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="1", SLURM_JOB_NUM_NODES="1")
    env.update(SLURM_NTASKS="5")
    for name, value in (("SLURM_NTASKS_PER_NODE", tasks), ("SLURM_GPUS_PER_NODE", gpus)):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    done = subprocess.run(
        ["bash", str(SCRIPTS / "train-gpu.sbatch")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2, done.stderr
    assert (
        "needs --gpus-per-node N and --ntasks-per-node of at least N, the same on every node" in done.stderr
    )


def test_the_requeue_script_refuses_a_max_runs_that_is_no_number_before_it_runs(tmp_path):
    """Found only after a stop, it ended the job with exit 1, and the job was not requeued."""
    import subprocess

    env = dict(os.environ, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID="1", MPIDIST_MAX_RUNS="abc")
    done = subprocess.run(
        ["bash", str(SCRIPTS / "train-requeue.sbatch")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2 and "MPIDIST_MAX_RUNS=abc: give a whole number of runs" in done.stderr
    assert not (tmp_path / "runs").exists()  # (nothing made, nothing run)


def wait_for_step(tmp_path, job, step, slurm, timeout=90):
    path = tmp_path / "runs" / str(job) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and any(
            e.get("event") == "step" and e["step"] >= step for e in metrics(tmp_path, job)
        ):
            return
        time.sleep(0.2)
    pytest.fail(f"job {job} never reached step {step}: {slurm.job(job)}\n{slurm.logs()}")


@pytest.mark.parametrize("interrupt", ["time-limit warning (SIGUSR1)", "preemption (scontrol requeue)"])
def test_the_requeue_script_checkpoints_requeues_and_resumes_to_the_end(slurm, tmp_path, interrupt):
    flags = ["--epochs", "6", "--log-every", "1"]
    # about 30 ms a step: 132 steps take 4 s
    _, job = submit(
        slurm, tmp_path, "train-requeue.sbatch", *flags, wait=False, env={"MPIDIST_TEST_DELAY": "0:0.03"}
    )
    slurm.wait_for(job, {"RUNNING"})
    wait_for_step(tmp_path, job, 10, slurm)
    if interrupt.startswith("time"):
        assert slurm.run("scancel", "--signal=USR1", str(job)).returncode == 0  # as --signal=USR1@T would
    else:
        assert slurm.run("scontrol", "requeue", str(job)).returncode == 0  # SIGTERM, then requeued
    fields = slurm.wait_for(job, {"PENDING"})
    assert fields["Restarts"] == "1"
    # Slurm holds a requeued job back about 2 min; start it now, but not in the second its old
    # credential was revoked: slurmd compares whole seconds and kills the job as "credential revoked"
    time.sleep(2)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    fields = slurm.wait_for_end(job)
    log = output(tmp_path, job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log
    events = metrics(tmp_path, job)
    (stopped,) = [e for e in events if e["event"] == "stopped"]
    assert stopped["signal"] == ("SIGUSR1" if interrupt.startswith("time") else "SIGTERM")
    assert (
        f"job {job} run 2" in log and f"resumed from {stopped['checkpoint']} at step {stopped['step']}" in log
    )
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 133))  # none lost, none twice
    assert events[-1]["event"] == "done" and events[-1]["steps"] == 132


def test_every_script_is_submitted_here_and_every_sbatch_line_says_what_it_does():
    scripts = sorted(path.name for path in SCRIPTS.glob("*.sbatch"))
    assert scripts == sorted(CPU_SCRIPTS + ["train-gpu.sbatch"])  # a new script must join a test above
    for name in scripts:
        for line in (SCRIPTS / name).read_text().splitlines():
            if line.startswith("#SBATCH"):
                assert re.match(r"#SBATCH \S+\s+# \w", line), f"{name}: no comment on {line!r}"


def test_every_script_shows_what_a_site_changes_before_its_first_job():
    """Issue 63, item 7: the account and partition many sites ask for, and where a job that starts without
    the submitting environment (--export=NONE) loads its MPI and activates the environment."""
    for path in sorted(SCRIPTS.glob("*.sbatch")):
        lines = path.read_text().splitlines()
        for option in ("--account=PROJECT", "--partition=QUEUE"):
            (line,) = [line for line in lines if line.startswith(f"##SBATCH {option}")]
            assert re.match(r"#SBATCH \S+\s+# \w", line[1:]), f"{path.name}: {line!r} uncommented"
        guidance = next(index for index, line in enumerate(lines) if "--export=NONE" in line)
        strict = next(index for index, line in enumerate(lines) if line.startswith("set -"))
        assert guidance < strict and any("module load" in line for line in lines[guidance:strict]), path.name
    install = (SCRIPTS.parent / "docs" / "install.rst").read_text()
    assert "builds against the MPI whose" not in install and "--no-binary=mpi4py" in install


@pytest.mark.parametrize(
    "script,signal_name", [("train-cpu.sbatch", "TERM"), ("train-cpu-srun.sbatch", "USR1")]
)
def test_a_signalled_job_checkpoints_and_ends_with_exit_code_3(slurm, tmp_path, script, signal_name):
    """Slurm's signals reach the ranks through srun and through MPICH's mpiexec (its proxies pass them on)."""
    _, job = submit(slurm, tmp_path, script, "--epochs", "400", wait=False)
    slurm.wait_for(job, {"RUNNING"})
    wait_for_step(tmp_path, job, 30, slurm)
    assert slurm.run("scancel", f"--signal={signal_name}", str(job)).returncode == 0
    fields = slurm.wait_for_end(job)
    assert fields["ExitCode"] == "3:0", output(tmp_path, job)
    (stopped,) = [e for e in metrics(tmp_path, job) if e["event"] == "stopped"]
    assert stopped["signal"] == f"SIG{signal_name}" and Path(stopped["checkpoint"]).exists()


def test_a_stopped_cluster_leaves_no_job_running(slurm, tmp_path):
    """A job still running when its cluster stops (a test that timed out) is ended with it, steps and all."""
    marker = f"mpidist-left-{os.getpid()}"
    done = slurm.run(
        "sbatch",
        "--parsable",
        f"--output={tmp_path}/job.out",
        "--wrap",
        f"srun --mpi=none bash -c 'sleep 600; : {marker}'",
        cwd=tmp_path,
    )
    job = int(done.stdout.strip())
    try:
        slurm.wait_for(job, {"RUNNING"})
        deadline = time.monotonic() + 30
        while not any(marker in command for command in commands()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(marker in command for command in commands()), (tmp_path / "job.out").read_text()
    finally:
        slurm.stop()
        left, running = slurm.leftovers(), [command for command in commands() if marker in command]
        slurm.start()  # (for the module's other tests)
    assert not left and not running, (left, running)


def commands():
    """Every process's command line, as text."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found
