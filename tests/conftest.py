"""Shared helpers: the repository root, and running commands under mpiexec."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec_path():
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def run_mpi(ranks, args, timeout=60, cwd=None, env=None):
    """Run ``mpiexec -n ranks python ARGS``; returns the CompletedProcess and seconds taken.

    A run that outlives ``timeout`` is a hang: the test fails with what it printed.
    """
    import time
    command = [mpiexec_path(), "-n", str(ranks), sys.executable] + list(args)
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                              env=full_env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"hung: {' '.join(command)} ran past {timeout} s\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}")
    return done, time.perf_counter() - start


def mpidist(ranks, *flags, timeout=60, cwd=None, env=None):
    """``mpiexec -n ranks python -m mpidist FLAGS``."""
    return run_mpi(ranks, ["-m", "mpidist", *flags], timeout=timeout, cwd=cwd, env=env)
