"""The GPU check's parts, each under its own time limit, and the one summary they write.

A part's limit, verdict and commands are :mod:`check_parts`; the training runs
it compares, GPU against CPU, are :mod:`check_runs`.

``gpu/check.sh`` runs this after installing the carried wheels (MPICH, mpi4py,
pytest-mpi).  On a machine with a GPU every part runs; on one without, the
parts that need no GPU still run (the installs, ``info``, the CPU references of
every strategy) and the rest are reported as not run, so the script cannot rot
where no GPU is at hand.  The limits add up to :data:`TOTAL_LIMIT` seconds,
under the 8 minutes that leave a second run room within a 15-minute GPU lease.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# its modules lie beside it: on the path when it runs as a script, not when a test loads it
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from check_parts import LIMITS, TOTAL_LIMIT, Part, mpiexec, needs_gpu, run  # noqa: E402

# (FIRST_STEP_ONLY, FLOOR, ROUNDING_FACTOR and run_dir_of are read here by the check's tests)
from check_runs import (  # noqa: E402, F401
    CASES,
    FIRST_STEP_ONLY,
    FLOOR,
    GPU_RUN_LIMIT,
    RESUME,
    ROUNDING_FACTOR,
    compare,
    resume_runs,
    run_dir_of,
    train,
)


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


def info_part(out):
    part = Part("info")
    code, _ = run(mpiexec(1) + [sys.executable, "-m", "mpidist", "info"], part.left(), out / "info.txt")
    if code != 0:
        part.fail(f"python -m mpidist info exited {code} (see info.txt)")
    part.rows = [line.rstrip() for line in (out / "info.txt").read_text().splitlines() if line.strip()]
    return part


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
            "layers",
            [sys.executable, str(HERE / "bench.py"), "layers", "--out", str(out / "bench-layers.json")],
            0.3,
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
