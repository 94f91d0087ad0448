"""The GPU check's parts, each under its own time limit, and the one summary they write.

``gpu/check.sh`` runs this after installing the carried wheels (MPICH, mpi4py,
pytest-mpi).  On a machine with a GPU every part runs; on one without, the
parts that need no GPU still run (the installs, ``info``, the CPU references of
every strategy) and the rest are reported as not run, so the script cannot rot
where no GPU is at hand.  The limits add up to :data:`TOTAL_LIMIT` seconds,
under the 8 minutes that leave a second run room within a 15-minute GPU lease.
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: Seconds each part may take; the installs are check.sh's (it passes how long they took).
LIMITS = {
    "install": 45,
    "gpu": 10,
    "info": 30,
    "unit tests": 65,
    "strategies": 150,
    "resume": 50,
    "benchmark": 120,
}
TOTAL_LIMIT = sum(LIMITS.values())

#: Every strategy and layout, as (name, ranks, train arguments).  Two ranks share the GPU (the
#: products of two layouts need four); ps ranks compute on the host.  On GPUs allreduce sums over
#: MPI: the node's shared-memory exchanges hold host memory.  Not run: backup workers (ps-sync
#: --aggregate, whose step takes whichever gradients come first) and in-graph replication.
CASES = [
    ("local", 1, ["--strategy", "local"]),
    ("allreduce", 2, ["--strategy", "allreduce"]),
    ("ps-sync (ps on the host)", 2, ["--strategy", "ps-sync", "--ps", "1"]),
    ("ps-async (ps on the host)", 2, ["--strategy", "ps-async", "--ps", "1"]),
    ("local-sgd", 2, ["--strategy", "local-sgd", "--sync-every", "2"]),
    ("pipeline (1f1b)", 2, ["--strategy", "pipeline", "--stages", "2"]),
    ("pipeline --schedule gpipe", 2, ["--strategy", "pipeline", "--stages", "2", "--schedule", "gpipe"]),
    ("hybrid (pipeline x data)", 4, ["--strategy", "pipeline", "--stages", "2"]),
    ("--tensor 2", 2, ["--strategy", "allreduce", "--tensor", "2"]),
    ("pipeline x tensor", 4, ["--strategy", "pipeline", "--stages", "2", "--tensor", "2"]),
    ("--shard optimizer", 2, ["--strategy", "allreduce", "--shard", "optimizer"]),
]
#: A sharded checkpoint written by one split layout on the GPU, then resumed by another (each rank
#: reads its slices from the host file straight into its device buffers): (label, ranks, arguments)
#: of the writer, then of the reader.
RESUME = (
    (
        "pipeline 2",
        2,
        ["--strategy", "pipeline", "--stages", "2", "--checkpoint-every", "3", "--checkpoint-wait"],
    ),
    ("--tensor 2", 2, ["--strategy", "allreduce", "--tensor", "2"]),
)
#: Asynchronous updates land in an order no run repeats, on the CPU too: only their first step is compared.
FIRST_STEP_ONLY = {"ps-async (ps on the host)"}
TRAIN = [
    "--data",
    "digits",
    "--model",
    "mlp",
    "--steps",
    "6",
    "--batch-size",
    "32",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--seed",
    "0",
    "--progress",
    "none",
]
#: GPU against CPU (float32) may differ by this many times what float32 itself costs (CPU float32
#: against float64), with a floor for runs whose float32 error happens to be tiny.
ROUNDING_FACTOR, FLOOR = 10.0, 1e-6
#: Seconds one GPU run may take (cupy compiles its kernels on first use; a hang must not eat the part).
GPU_RUN_LIMIT = 60


def cupy_gpus():
    """``(GPUs cupy sees, why none where it sees none)``."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # no cupy, a cupy built for another CUDA, no driver: no GPU to use either way
        return 0, f"{type(err).__name__}: {err}"
    return count, "" if count else "cupy sees no GPU"


def gpu_part():
    """Whether cupy can compute here; a failure where the driver lists a GPU that cupy cannot use."""
    part = Part("gpu")
    count, why = cupy_gpus()
    listed = shutil.which("nvidia-smi") and run(["nvidia-smi", "-L"], part.left(), os.devnull)[0] == 0
    if count:
        part.rows = [f"cupy sees {count} GPU(s)"]
    elif listed:
        part.fail(f"nvidia-smi lists a GPU, but cupy cannot use it ({why})")
    else:
        part.skip(f"no GPU ({why})")
    return part


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


def info_part(out):
    part = Part("info")
    code, _ = run(mpiexec(1) + [sys.executable, "-m", "mpidist", "info"], part.left(), out / "info.txt")
    if code != 0:
        part.fail(f"python -m mpidist info exited {code} (see info.txt)")
    part.rows = [line.rstrip() for line in (out / "info.txt").read_text().splitlines() if line.strip()]
    return part


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


@needs_gpu("unit tests")
def unit_part(out, part):
    runs = [
        (
            "tests/test_gpu.py, 1 process",
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"],
            "unit-serial.log",
        ),
        (
            "tests/test_gpu.py, 2 ranks",
            mpiexec(2)
            + [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                "-m",
                "mpi",
                "--with-mpi",
                "tests/test_gpu.py",
            ],
            "unit-mpi.log",
        ),
    ]
    for label, command, log in runs:
        code, seconds = run(command, part.left(), out / log)
        tail = (out / log).read_text().strip().splitlines()[-1:] or [""]
        part.rows.append({"tests": label, "exit": code, "seconds": round(seconds, 1), "last line": tail[0]})
        if code != 0:
            part.fail(f"{label}: exit {code} (see {log})")
    return part


def run_dir_of(out, label, device, dtype):
    return out / "runs" / f"{label}-{device}-{dtype}".replace(" ", "_").replace("/", "")


def train(out, label, ranks, arguments, device, dtype, limit):
    """One short training run; ``(losses per step, final parameters)``, or a string saying why not."""
    run_dir = run_dir_of(out, label, device, dtype)
    for place in (run_dir.parent, run_dir):  # (an earlier check's folder is removed, never through a link)
        if place.is_symlink():
            return f"{place} is a symbolic link, which the check never follows: remove it"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = mpiexec(ranks) + [
        sys.executable,
        "-m",
        "mpidist",
        "train",
        *TRAIN,
        *arguments,
        "--device",
        device,
        "--dtype",
        dtype,
        "--run-dir",
        str(run_dir),
        "--checkpoint-dir",
        str(run_dir / "ck"),
    ]
    run_dir.mkdir(parents=True)
    code, _ = run(command, limit, run_dir / "output.txt")
    if code != 0:
        last = (run_dir / "output.txt").read_text().strip().splitlines()[-3:]
        return f"{'timed out' if code is None else f'exit {code}'}: " + " | ".join(last)
    try:
        events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = np.array([event["loss"] for event in events if event.get("event") == "step"])
        checkpoints = sorted((run_dir / "ck").glob("ckpt-*.h5"))
        if not checkpoints:
            return f"no checkpoint in {run_dir / 'ck'}"
        import h5py

        with h5py.File(checkpoints[-1], "r") as file:
            params = np.asarray(file["params"], dtype=np.float64)
    except (OSError, ValueError, KeyError) as err:
        return f"its metrics or checkpoint unreadable: {err}"
    return losses, params


def _relative(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare(case, gpu, cpu, cpu64):
    """The row of one strategy: its errors against the CPU and the bound float32 rounding sets."""
    if len(gpu[0]) != len(cpu[0]) or gpu[1].shape != cpu[1].shape:
        return {"verdict": "fail", "why": "not the same steps or parameters as the CPU run"}
    if case in FIRST_STEP_ONLY:
        pairs = [("first loss", gpu[0][:1], cpu[0][:1], cpu64[0][:1])]
    else:
        pairs = [("loss", gpu[0], cpu[0], cpu64[0]), ("params", gpu[1], cpu[1], cpu64[1])]
    row = {}
    for name, ours, reference, exact in pairs:
        error, rounding = _relative(ours, reference), _relative(reference, exact)
        bound = max(ROUNDING_FACTOR * rounding, FLOOR)
        row[f"{name} error"], row[f"{name} float32 rounding"], row[f"{name} bound"] = error, rounding, bound
        if not math.isfinite(error) or error > bound:
            row["verdict"], row["why"] = "fail", f"{name} differs by {error:.2e}, over {bound:.2e}"
    if case in FIRST_STEP_ONLY and not np.all(np.isfinite(gpu[0])):
        row["verdict"], row["why"] = "fail", "a loss is not finite"
    row.setdefault("verdict", "pass")
    return row


def strategies_part(out, gpu):
    part = Part("strategies")
    for case, ranks, arguments in CASES:
        row = {"strategy": case, "ranks": ranks}
        part.rows.append(row)
        per_run = part.left() / (3 if gpu else 2)
        if per_run < 5:
            row.update(verdict="not run", why="the part's time limit")
            part.fail("the part's time limit ran out before every strategy ran")
            continue
        cpu = train(out, case, ranks, arguments, "cpu", "float32", per_run)
        cpu64 = train(out, case, ranks, arguments, "cpu", "float64", per_run)
        if isinstance(cpu, str) or isinstance(cpu64, str):
            row.update(verdict="fail", why=f"CPU reference: {cpu if isinstance(cpu, str) else cpu64}")
            part.fail("a CPU reference failed")
            continue
        row["cpu reference"] = "ok"
        if not gpu:
            row.update(verdict="not run", why="no GPU")
            continue
        ours = train(out, case, ranks, arguments, "gpu", "float32", min(part.left(), GPU_RUN_LIMIT))
        row.update(
            {"verdict": "fail", "why": ours} if isinstance(ours, str) else compare(case, ours, cpu, cpu64)
        )
        if row["verdict"] == "fail":
            part.fail("a strategy's GPU run differs from the CPU or failed")
    if not gpu and part.status == "pass":
        part.skip("no GPU: the CPU references ran, the GPU runs did not")
    return part


def resume_runs(out, device, dtype, limit):
    """The reader's run of :data:`RESUME` on ``device``, resumed from the writer's step-3 checkpoint."""
    (writer, ranks, arguments), (reader, reader_ranks, reader_arguments) = RESUME
    written = train(out, writer, ranks, arguments, device, dtype, limit / 2)
    if isinstance(written, str):
        return f"{writer} (the writer): {written}"
    found = sorted((run_dir_of(out, writer, device, dtype) / "ck").glob("ckpt-00000003*.h5"))
    if not found:
        return f"{writer} wrote no step-3 checkpoint"
    checkpoint = found[0]
    resumed = train(
        out,
        f"{reader} from {writer}",
        reader_ranks,
        reader_arguments + ["--resume", str(checkpoint)],
        device,
        dtype,
        limit / 2,
    )
    return f"{reader} (the reader): {resumed}" if isinstance(resumed, str) else resumed


@needs_gpu("resume")
def resume_part(out, part):
    (writer, _, _), (reader, _, _) = RESUME
    row = {"written by": writer, "resumed by": reader}
    part.rows.append(row)
    runs = {}
    for device, dtype in (("cpu", "float32"), ("cpu", "float64"), ("gpu", "float32")):
        runs[device, dtype] = resume_runs(out, device, dtype, max(part.left(), 1) / (3 - len(runs)))
        if isinstance(runs[device, dtype], str):
            row.update(verdict="fail", why=f"{device} {dtype}: {runs[device, dtype]}")
            part.fail("a resume failed")
            return part
    row.update(compare(reader, runs["gpu", "float32"], runs["cpu", "float32"], runs["cpu", "float64"]))
    if row["verdict"] == "fail":
        part.fail("the resumed GPU run differs from the CPU's")
    return part


@needs_gpu("benchmark")
def benchmark_part(out, part):
    steps = [
        (
            "models",
            [sys.executable, str(HERE / "bench.py"), "models", "--out", str(out / "bench-models.json")],
            0.5,
        ),
        (
            "send",
            mpiexec(2)
            + [sys.executable, str(HERE / "bench.py"), "send", "--out", str(out / "bench-send.json")],
            0.5,
        ),
        (
            "precision",
            [sys.executable, str(HERE / "bench.py"), "precision", "--out", str(out / "bench-precision.json")],
            1.0,
        ),
    ]
    for name, command, share in steps:
        code, _ = run(command, part.left() * share, out / f"bench-{name}.log")
        if code != 0:
            part.fail(f"bench.py {name}: exit {code} (see bench-{name}.log)")
            continue
        part.rows += json.loads((out / f"bench-{name}.json").read_text())
    return part


def _format(value):
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def write_summary(out, parts, install):
    lines = [
        f"mpidist GPU check: {'a GPU' if parts[0]['gpu'] else 'no GPU'} here; limits add up to "
        f"{TOTAL_LIMIT} s",
        "",
    ]
    for part in [install] + parts[1:]:
        lines.append(
            f"[{part['status']}] {part['part']} ({part['seconds']} s of {part['limit_s']})"
            + (f": {part['reason']}" if part["reason"] else "")
        )
        for row in part["rows"]:
            text = row if isinstance(row, str) else ", ".join(f"{k} {_format(v)}" for k, v in row.items())
            lines.append(f"    {text}")
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    (out / "summary.json").write_text(
        json.dumps(
            {"gpu": parts[0]["gpu"], "total_limit_s": TOTAL_LIMIT, "parts": [install] + parts[1:]}, indent=1
        )
    )
    return text


def _guarded(build, out, gpu, installed):
    """The part ``build`` makes; one that could not run or crashed is a part that says so."""
    name = {
        info_part: "info",
        unit_part: "unit tests",
        strategies_part: "strategies",
        resume_part: "resume",
        benchmark_part: "benchmark",
    }[build]
    if not installed:
        part = Part(name)
        part.skip("the wheels' install failed")
        return part
    try:
        return build(out) if build is info_part else build(out, gpu)
    except Exception as err:  # a check that breaks reports it with the rest, and the summary is still written
        part = Part(name)
        part.fail(f"the check itself broke: {type(err).__name__}: {err}")
        return part


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the summary and every log")
    parser.add_argument("--install-exit", type=int, required=True, help="the wheels' install's exit code")
    parser.add_argument("--install-seconds", type=float, required=True, help="how long the install took")
    args = parser.parse_args()
    # (out_folder.py lies beside this script, on sys.path when it runs as one; where check.sh claimed OUT
    # already, the folder is the check's and is claimed again as it is)
    from out_folder import EXIT_REFUSED, Refused, claim

    try:
        args.out = claim(args.out).resolve()  # (the runs start in the repository)
    except Refused as why:
        print(f"gpu/check.py: error: --out {args.out}: {why}", file=sys.stderr)
        return EXIT_REFUSED
    install = {
        "part": "install",
        "status": "pass" if args.install_exit == 0 else "fail",
        "reason": ""
        if args.install_exit == 0
        else f"pip exited {args.install_exit} (see install.log; wheels for another Python? gpu/wheels.sh "
        f"with MPIDIST_WHEELS_PYTHON={sys.version_info.major}.{sys.version_info.minor})",
        "limit_s": LIMITS["install"],
        "seconds": round(args.install_seconds, 1),
        "rows": [],
    }
    found = gpu_part()
    gpu = found.status == "pass"
    parts = [{"gpu": gpu}, found.as_dict()]
    print(f"[{found.status}] gpu", flush=True)
    for build in (info_part, unit_part, strategies_part, resume_part, benchmark_part):
        part = _guarded(build, args.out, gpu, install["status"] == "pass")
        parts.append(part.as_dict())
        print(f"[{part.status}] {part.name}", flush=True)
    try:
        print(write_summary(args.out, parts, install), end="")
    except OSError as err:  # (a full disk, OUT removed meanwhile: the parts ran, their verdict is lost)
        print(
            f"gpu/check.py: error: cannot write the summary in {args.out}: {err.strerror or err}",
            file=sys.stderr,
        )
        return 1
    failed = install["status"] == "fail" or any(p["status"] == "fail" for p in parts[1:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
