"""The GPU check's training runs: every strategy and layout trained briefly on a device, and a GPU run's
losses and parameters compared with the CPU's within what float32 rounding allows."""

import json
import math
import shutil
import sys

import numpy as np

from check_parts import mpiexec, run

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
