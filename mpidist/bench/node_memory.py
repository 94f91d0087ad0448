"""The memory of one node under two exchanges: the sum of its ranks' proportional set size, sampled as they
train.

``python -m mpidist.bench.node_memory --ranks 4 -- --model mlp:2048,2048 --optimizer adam``
launches ``mpiexec -n 4 python -m mpidist train ...`` once per ``--exchange``
(default: ``auto``, then ``mpi``), reads every rank's pid from the role table,
and samples ``Pss`` from ``/proc/<pid>/smaps_rollup`` until the run ends.
``Pss`` splits a shared page between the processes that map it, so the sum
over a node's ranks counts a shared window once (plain RSS counts it once per
rank).  Prints, per exchange, the median and the largest sum seen, in MB
(the largest comes at the end, where the chief gathers the optimizer state
to save it); Linux only.
"""

import argparse
import shutil
import subprocess
import sys
import threading
import time
from statistics import median

from ..runtime.memory import kib_field
from ..runtime.threads import launch_environment


def pss_bytes(pid):
    """``Pss`` of process ``pid`` in bytes, or 0 once it has gone."""
    return kib_field(f"/proc/{pid}/smaps_rollup", b"Pss") or 0


def _pids(lines):
    """The pids of the role table's rows, from the run's output lines (a list another thread fills)."""
    for at, line in enumerate(lines):
        fields = line.split()
        if fields[:4] == ["rank", "host", "node", "pid"]:
            rows = [row.split() for row in lines[at + 1 :]]
            return [int(row[3]) for row in rows if len(row) > 3 and row[0].isdigit()]
    return []


def node_pss(ranks, flags, interval=0.1):
    """Run ``train`` on ``ranks`` ranks with ``flags``: every sum of their Pss sampled, in bytes."""
    command = [
        shutil.which("mpiexec") or "mpiexec",
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mpidist",
        "train",
        "--progress",
        "none",
        "--run-dir",
        "",
        "--checkpoint-dir",
        "",
        *flags,
    ]
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launch_environment()
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True)
    reader.start()
    samples = []
    while run.poll() is None:
        pids = _pids(list(lines))
        if len(pids) == ranks:
            samples.append(sum(pss_bytes(pid) for pid in pids))
        time.sleep(interval)
    reader.join()
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {run.returncode}:\n{''.join(lines[-20:])}")
    return samples


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mpidist.bench.node_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=4, help="ranks, all on this node (default: 4)")
    parser.add_argument(
        "--exchanges", default="auto,mpi", help="--exchange values to compare (default: auto,mpi)"
    )
    parser.add_argument("flags", nargs="*", help="train's flags, after --")
    options = parser.parse_args(argv)
    flags = options.flags or ["--model", "mlp:2048,2048", "--optimizer", "adam", "--steps", "300"]
    for exchange in options.exchanges.split(","):
        samples = node_pss(options.ranks, [*flags, "--exchange", exchange])
        print(
            f"--exchange {exchange}: the node's Pss (sum over its {options.ranks} ranks) "
            f"{median(samples) / 1e6:.1f} "
            f"MB while training (median of {len(samples)} samples), {max(samples, default=0) / 1e6:.1f} MB "
            "at most"
        )


if __name__ == "__main__":
    main()
