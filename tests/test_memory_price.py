"""The memory a run states it needs is an upper bound: under a limit a few percent above it, it ends.

Each run prices what every rank will hold before it allocates any of it (``mpidist: memory: X a rank at
most``: what the process holds already, its training state, data, a step's and an evaluation's arrays, its
threads, checkpoints and the end; :mod:`mpidist.loop.pricing`), and a rank that cannot hold its price is
refused then, in one line.  Here every layout trains, and ``eval`` and ``predict`` run on every split layout,
under ``prlimit --data`` 3% above the price the same command states unlimited (what ``ulimit -d`` bounds:
every private mapping a process makes, arrays, heaps, stacks, BLAS buffers): each ends with exit 0.  Before
the price, runs that passed the start-up check died allocating (a MemoryError traceback, or OpenBLAS's own
abort with no mpidist line), and a finished run exited 2 as it built the model it returns.
"""

import re

import pytest

from conftest import run_mpi

ABOVE = 1.03  # the limit a run gets, over the price it states
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
TRAIN = [
    "train",
    "--model",
    "mlp:1024,1024",
    "--data",
    "mnist-5k",
    "--optimizer",
    "adam",
    "--steps",
    "6",
    "--checkpoint-every",
    "3",
    "--progress",
    "none",
]
LAYOUTS = {
    "local": (1, ["--strategy", "local"]),
    "allreduce": (2, ["--strategy", "allreduce"]),
    "--shard optimizer": (2, ["--strategy", "allreduce", "--shard", "optimizer"]),
    "--shard parameters": (2, ["--strategy", "allreduce", "--shard", "parameters"]),
    "pipeline": (2, ["--strategy", "pipeline", "--stages", "2"]),
    "tensor": (2, ["--strategy", "allreduce", "--tensor", "2"]),
    "pipeline x tensor": (4, ["--strategy", "pipeline", "--stages", "2", "--tensor", "2"]),
    # what the layouts above leave out: a streamed dataset, a compiled pooling layer with --trace detail and
    # --clip-norm, a pipeline's 1F1B schedule over more micro-batches
    "streamed": (2, ["--strategy", "allreduce", "--memory-budget", "8M"]),
    "cnn, traced, clipped": (2, ["--model", "cnn", "--trace", "detail", "--clip-norm", "1"]),
    "pipeline 1f1b": (
        2,
        ["--strategy", "pipeline", "--stages", "2", "--schedule", "1f1b", "--micro-batches", "8"],
    ),
    # a 16-bit model beside its float32 master copies, the loss's float32 arrays and bfloat16's MPI sum
    "cnn, allreduce --precision bf16": (
        2,
        ["--model", "cnn", "--strategy", "allreduce", "--precision", "bf16"],
    ),
}
SPLITS = {
    "whole": [],
    "--stages 2": ["--stages", "2"],
    "--tensor 2": ["--tensor", "2"],
    "--shard parameters": ["--shard", "parameters"],
}


def stated(output):
    """The price a run states: ``mpidist: memory: 260.1 MiB a rank at most``, in bytes."""
    found = re.search(r"mpidist: memory: ([\d.,]+) (KiB|MiB|GiB) a rank at most", output)
    assert found, output
    return float(found.group(1).replace(",", "")) * UNITS[found.group(2)]


def capped(ranks, args, limit, cwd):
    done, _ = run_mpi(
        ranks, ["-m", "mpidist", *args], timeout=180, cwd=cwd, prefix=("prlimit", f"--data={limit}")
    )
    return done


def priced_then_capped(ranks, args, cwd, finished):
    """Run ``args`` unlimited for its price, then under a limit 3% above it: it must end as ``finished`` says,
    exit 0."""
    free, _ = run_mpi(ranks, ["-m", "mpidist", *args], timeout=180, cwd=cwd)
    assert free.returncode == 0, free.stderr
    price = stated(free.stdout)
    done = capped(ranks, args, int(price * ABOVE), cwd)
    assert done.returncode == 0, (price, done.stdout[-2000:], done.stderr[-3000:])
    assert finished in done.stdout and "Traceback" not in done.stderr, done.stderr
    return price


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_to_the_end_under_a_limit_just_above_its_price(tmp_path, layout):
    ranks, flags = LAYOUTS[layout]
    args = [*TRAIN, *flags, "--metrics", "", "--run-dir", "run"]

    def fresh(name):  # (each run its own directory: a run's checkpoints are another's to resume)
        return [*args[:-1], name]

    free, _ = run_mpi(ranks, ["-m", "mpidist", *fresh("free")], timeout=180, cwd=tmp_path)
    assert free.returncode == 0, free.stderr
    price = stated(free.stdout)
    done = capped(ranks, fresh("capped"), int(price * ABOVE), tmp_path)
    assert done.returncode == 0, (price, done.stdout[-2000:], done.stderr[-3000:])
    assert "mpidist: done" in done.stdout and "Traceback" not in done.stderr, done.stderr


def test_a_limit_below_the_price_is_refused_at_start_up_in_one_line_naming_every_item(tmp_path):
    free, _ = run_mpi(2, ["-m", "mpidist", *TRAIN, "--run-dir", ""], timeout=180, cwd=tmp_path)
    price = stated(free.stdout)
    done = capped(2, [*TRAIN, "--run-dir", ""], int(price * 0.9), tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("mpidist: error") == 1 and "Traceback" not in done.stderr, done.stderr
    line = next(line for line in done.stderr.splitlines() if "mpidist: error" in line)
    for item in (
        "held already",
        "training state",
        "data",
        "a step's arrays",
        "an evaluation batch",
        "threads",
    ):
        assert item in line, line
    assert "more than this process's limit (ulimit -d: " in line


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of TRAIN's model, allreduce on 2 ranks."""
    where = tmp_path_factory.mktemp("priced")
    done, _ = run_mpi(
        2, ["-m", "mpidist", *TRAIN, "--metrics", "", "--run-dir", "", "--checkpoint-dir", "ck"], cwd=where
    )
    assert done.returncode == 0, done.stderr
    return str(next((where / "ck").glob("ckpt-*.h5")))


@pytest.mark.parametrize("layout", ["allreduce", "pipeline"])
def test_a_resumed_run_trains_to_the_end_under_a_limit_just_above_its_price(tmp_path, checkpoint, layout):
    ranks, flags = LAYOUTS[layout]
    # (from the checkpoint of step 6, to step 9: a lineage of its own beside the unlimited run's)
    args = [*TRAIN, *flags, "--steps", "9", "--resume", checkpoint, "--new-lineage", "--run-dir", "run"]
    priced_then_capped(ranks, args, tmp_path, "mpidist: done")


@pytest.mark.parametrize("split", list(SPLITS))
def test_eval_runs_to_the_end_under_a_limit_just_above_its_price(tmp_path, checkpoint, split):
    priced_then_capped(2, ["eval", checkpoint, *SPLITS[split]], tmp_path, "mpidist eval: ")


@pytest.mark.parametrize("split", list(SPLITS))
def test_predict_runs_to_the_end_under_a_limit_just_above_its_price(tmp_path, checkpoint, split):
    args = ["predict", checkpoint, "--output", "p.h5", *SPLITS[split]]
    priced_then_capped(2, args, tmp_path, "mpidist predict: ")
    assert (tmp_path / "p.h5").is_file()
