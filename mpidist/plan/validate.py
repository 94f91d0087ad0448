"""How far ``plan`` can be trusted here: its predictions against runs of the same layouts, measured.

``python -m mpidist.plan.validate --model mlp-wide --data mnist-5k``, in each
of ``--rounds`` rounds, calibrates (two ranks on this node, then one rank on
each of two emulated nodes for the network) and trains each layout of
:data:`LAYOUTS` for ``--steps`` steps (each rank with the BLAS threads of one
of the two calibrated ranks: half the cores); it prints each layout's
predicted samples/s and peak memory (medians of the rounds' predictions)
beside the medians measured, with their ratios.  Every rank runs on this
machine: on a machine of fewer cores than ranks, nothing here means
anything.  Two names must reach this machine for the emulated nodes
(``--hosts``; MPICH's launcher starts each name's ranks as a node).
"""

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

from ..runtime.threads import launch_environment
from . import calibration
from .check import read_layout
from .step import predict

#: (name, ranks, nodes, train's flags besides the model and data): what the issue asks the model to match
LAYOUTS = (
    ("local", 1, 1, ["--strategy", "local"]),
    ("allreduce, one node", 2, 1, ["--strategy", "allreduce"]),
    ("allreduce, two nodes", 2, 2, ["--strategy", "allreduce"]),
    ("ps-sync --ps 1", 2, 1, ["--strategy", "ps-sync", "--ps", "1"]),
    ("pipeline, M = 4", 2, 1, ["--strategy", "pipeline", "--stages", "2", "--micro-batches", "4"]),
    ("pipeline, M = 8", 2, 1, ["--strategy", "pipeline", "--stages", "2", "--micro-batches", "8"]),
)


def _mpiexec(ranks, nodes, hosts, args):
    launcher = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    where = ["-hosts", ",".join(f"{host}:{ranks // nodes}" for host in hosts[:nodes])] if nodes > 1 else []
    return [launcher, *where, "-n", str(ranks), sys.executable, "-m", "mpidist", *args]


def _run(command):
    # every rank of every run with the BLAS threads of one of the calibration's two ranks: half the cores (an
    # emulated node's rank would take every core, as on a node of its own, and oversubscribe the machine; a
    # one-rank run would compute faster than the rank that was calibrated)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    threads = {name: share for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run(command, capture_output=True, text=True, env=launch_environment(**threads))
    if done.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return done


def calibrated(folder, model, data, hosts, seconds):
    """One calibration with both links: this node's (two ranks on it) and the network's (two emulated
    nodes)."""
    for name, nodes in (("node", 1), ("network", 2)):
        _run(
            _mpiexec(
                2,
                nodes,
                hosts,
                [
                    "plan",
                    "--calibrate",
                    "--model",
                    model,
                    "--data",
                    data,
                    "--seconds",
                    str(seconds),
                    "--calibration",
                    str(folder / f"{name}.json"),
                ],
            )
        )
    within, between = calibration.load(folder / "node.json"), calibration.load(folder / "network.json")
    return dataclasses.replace(within, network=between.network, network_crowding=between.network_crowding)


def batch_flags(name, ranks, batch_per_rank):
    """The global batch that gives each worker (each pipeline replica) ``batch_per_rank`` samples."""
    workers = 1 if name.startswith(("ps-sync", "pipeline")) else ranks
    return ["--batch-size", str(batch_per_rank * workers)]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mpidist.plan.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="mlp-wide")
    parser.add_argument("--data", default="mnist-5k")
    parser.add_argument("--steps", type=int, default=300, help="steps a run (default: 300)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    parser.add_argument(
        "--seconds", type=float, default=1.0, help="calibration time per measurement (default: 1)"
    )
    parser.add_argument(
        "--hosts",
        default=f"127.0.0.1,{socket.gethostname()}",
        help="two names of this machine, one per emulated node",
    )
    parser.add_argument("--output", default=None, help="JSON file for the rows")
    options = parser.parse_args(argv)
    hosts = options.hosts.split(",")
    folder = Path(tempfile.mkdtemp(prefix="mpidist-plan-validate-"))
    try:
        measured = {name: [] for name, *_ in LAYOUTS}
        predicted = {name: [] for name, *_ in LAYOUTS}
        calibrations = []
        for round_ in range(options.rounds):
            # a calibration each round, beside the runs it predicts: this machine's speed drifts by ~10%
            cal = calibrated(folder, options.model, options.data, hosts, options.seconds)
            calibrations.append(cal.to_json())
            for name, ranks, nodes, flags in LAYOUTS:
                run_dir = folder / f"{round_}-{name.replace(' ', '_').replace(',', '')}"
                _run(
                    _mpiexec(
                        ranks,
                        nodes,
                        hosts,
                        [
                            "--model",
                            options.model,
                            "--data",
                            options.data,
                            *flags,
                            *batch_flags(name, ranks, cal.batch_per_rank),
                            "--steps",
                            str(options.steps),
                            "--eval-every",
                            "0",
                            "--checkpoint-dir",
                            "",
                            "--progress",
                            "none",
                            "--run-dir",
                            str(run_dir),
                        ],
                    )
                )
                read = read_layout(run_dir)
                if isinstance(read, str):  # (a run that exited 0 but left no figures: say so, do not guess)
                    raise SystemExit(f"mpidist plan validate: {name}: {read}")
                measured[name].append(read)
                predicted[name].append(predict(cal, read[0]))
        rows = []
        for name, runs in measured.items():
            made = predicted[name]
            speed, peak = median(run[1] for run in runs), median(run[2] for run in runs)
            rate, memory = median(m.samples_per_s for m in made), median(m.memory for m in made)
            rows.append(
                {
                    "layout": name,
                    "predicted": rate,
                    "measured": speed,
                    "speed_ratio": rate / speed,
                    "memory_predicted_mib": memory / 2**20,
                    "memory_measured_mib": peak / 2**20,
                    "memory_ratio": memory / peak,
                    "measured_each": [run[1] for run in runs],
                    "predicted_each": [m.samples_per_s for m in made],
                }
            )
        from ..bench.output import format_table, write_results
        from .check import COLUMNS

        print(
            f"mpidist plan: {options.model} on {options.data}, {options.steps} steps a run, medians of "
            f"{options.rounds} interleaved rounds"
        )
        shown = [column for column in COLUMNS if column[0] not in ("ranks", "nodes", "holds")]
        print(format_table(rows, shown))
        if options.output:
            # (whole; a link replaced)
            write_results(options.output, {"calibrations": calibrations, "rows": rows})
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
