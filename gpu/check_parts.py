"""A part of the GPU check: its time limit, its verdict and figures, and the commands it runs under it."""

import os
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Seconds each part may take; the installs are check.sh's (it passes how long they took).
LIMITS = {
    "install": 45,
    "gpu": 10,
    "info": 30,
    "unit tests": 80,
    "strategies": 135,
    "resume": 50,
    "benchmark": 120,
}
TOTAL_LIMIT = sum(LIMITS.values())


def run(command, limit, log, env=None):
    """Run ``command`` for at most ``limit`` seconds with its output in ``log``; ``(exit code, seconds)``.

    The exit code is None after a timeout, and the reason where the command could not start.  A
    command that outlives its limit is told to stop (mpiexec then ends its ranks, which the
    launcher runs in sessions of their own), then killed with its process group.
    """
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
            )
        except OSError as err:
            return f"could not start {command[0]}: {err.strerror or err}", time.monotonic() - start
        try:
            code = process.wait(timeout=max(limit, 1))
        except BaseException as err:  # the limit, or this check interrupted: leave nothing running
            _stop(process)
            if not isinstance(err, subprocess.TimeoutExpired):
                raise
            code = None
    return code, time.monotonic() - start


def _stop(process, grace=5):
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Part:
    """One part's verdict ("pass", "fail" or "not run"), why, and its figures."""

    def __init__(self, name):
        self.name, self.limit = name, LIMITS[name]
        self.deadline = time.monotonic() + self.limit
        self.status, self.reason, self.rows, self.start = "pass", "", [], time.monotonic()

    def left(self):
        return self.deadline - time.monotonic()

    def fail(self, reason):
        self.status, self.reason = "fail", reason

    def skip(self, reason):
        self.status, self.reason = "not run", reason

    def as_dict(self):
        return {
            "part": self.name,
            "status": self.status,
            "reason": self.reason,
            "limit_s": self.limit,
            "seconds": round(time.monotonic() - self.start, 1),
            "rows": self.rows,
        }


def mpiexec(ranks):
    return ["mpiexec", "-n", str(ranks)]


def needs_gpu(name):
    """The part ``name`` as the decorated ``build(out, part)`` makes it where there is a GPU; not run
    elsewhere."""

    def decorate(build):
        def part_for(out, gpu):
            part = Part(name)
            if not gpu:
                part.skip("no GPU visible to cupy")
                return part
            return build(out, part)

        return part_for

    return decorate
