"""``allreduce --shard parameters``: each worker holds a shard of every unit, gathered as it runs.

Against the local reference on the same global batch (tests/parallel/test_recipe.py's: a warm-up into a
cosine, a clip that bites on some steps, weight decay, accumulation in slices), equal to 1e-9 in float64
at every step, each worker's shards compared with their places in the reference's parameters.
"""

import h5py
import numpy as np
import pytest
from mpi4py import MPI
from conftest import ROOT, mpidist, run_mpi
from small_net import small_convnet, worker_slice
from test_recipe import STEPS, batches, clip_for, make, recipe, reference_run

from mpidist import nn
from mpidist.parallel import AllreduceStrategy, LocalStrategy
from mpidist.parallel.data.fully_sharded import FullyShardedStrategy
from mpidist.runtime.cluster import build_cluster

#: the small convnet's units at 40 parameters: the convolution (30), the first Dense (224), the last (36)
UNIT_BYTES = 40 * 8


def sharded(cluster, optimizer, accumulate=1, clip=0.0, keep=False, prefetch=True, exchange="auto"):
    return FullyShardedStrategy(
        small_convnet(np.float64),
        nn.loss_for(4, np),
        make(optimizer),
        cluster,
        seed=3,
        bucket_bytes=UNIT_BYTES,
        recipe=recipe(accumulate, clip),
        keep=keep,
        prefetch=prefetch,
        exchange=exchange,
    )


def test_the_allreduce_settings_choose_the_fully_sharded_class():
    settings = type("Settings", (), {"shard": "parameters"})
    assert AllreduceStrategy.variant(settings, 4) is FullyShardedStrategy
    settings.shard = "optimizer"
    assert AllreduceStrategy.variant(settings, 4) is AllreduceStrategy


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "keep, prefetch", [(False, True), (True, True), (False, False)], ids=["two", "kept", "one in flight"]
)
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("exchange", ["auto", "mpi"], ids=["a copy a node", "a copy a rank"])
def test_shards_train_as_local_on_the_global_batch(exchange, optimizer, accumulate, keep, prefetch):
    """Two units in flight, every unit kept, or one unit in flight (each gathered as it is about to run, its
    gradients' sum waited for before the next unit's backward writes in the one gradient slot); each unit
    gathered once per node (its slots shared by the node's workers, its gradients summed over the node, then
    between nodes) or on every worker: the same steps."""
    cluster = build_cluster(MPI.COMM_WORLD)
    workers = cluster.num_workers
    global_batch = 3 * workers + 2
    expected, clipped = reference_run(global_batch, optimizer)
    xs, ys = batches(global_batch)
    clip = clip_for(global_batch, optimizer)
    strategy = sharded(cluster, optimizer, accumulate, clip, keep, prefetch, exchange)
    assert [unit.size for unit in strategy.shards.units] == [30, 224, 36]
    assert len(strategy.gathers.gathered.slots) == (3 if keep else 2 if prefetch else 1)
    assert ("one unit in flight" in strategy.describe(cluster.rank)) == (not prefetch)
    sharing = cluster.local_size if exchange == "auto" else 1  # (every node here holds 2 workers or more)
    assert strategy.route.sharing == sharing
    assert (f"gathered once per node of {sharing}" in strategy.describe(cluster.rank)) == (sharing > 1)
    strategy.initialize()
    where = strategy.placement.positions()
    part = worker_slice(global_batch, workers, cluster.worker_index)
    for step in range(STEPS):
        strategy.train_step(xs[step][part], ys[step][part], (part.stop - part.start) / global_batch, step)
        np.testing.assert_allclose(strategy.params, expected[step][where], rtol=1e-9, atol=1e-12)
        assert strategy.clipped == clipped[step]
    # every worker holds a shard of its own, and together they are the model, each element once
    held = np.concatenate(cluster.workers.allgather(where))
    assert np.array_equal(np.sort(held), np.arange(strategy.model.num_params))
    # the units every worker gathers are bit-identical
    strategy.gathers.idle_pass()
    slots = b"".join(slot.tobytes() for slot in strategy.gathers.gathered.slots)
    assert len(set(cluster.workers.allgather(slots))) == 1
    # a node's workers read one copy: what one writes there, after the node's barrier, the others read
    first = strategy.gathers.gathered.slots[0]
    if cluster.local_rank == 0:
        first[0] = -1.0
    strategy.route.settle()
    assert (first[0] == -1.0) == (cluster.local_rank == 0 or sharing > 1)
    strategy.route.settle()  # (nobody writes it before every worker has read it)
    strategy.free()
    cluster.free()


# -- whole runs: what a worker holds, and a sharded checkpoint resumed on any layout ------------------------
#: mlp on digits, in float64 at --bucket-mb 0.1 (13,107 parameters a unit at most): Dense 64-128 (8,320), then
#: Dense 128-128 (16,512), then Dense 128-10 (1,290), each a unit; shards of 4 blocks: 2,080 + 4,128 + 323,
#: the last shard of the last unit 321
SHARDS_OF_4 = [6_531, 6_531, 6_531, 6_529]
#: two slots of parameters and two of gradients: units 0 and 2 share the first (8,320), unit 1 the second; the
#: four workers of one node read one copy of the parameters' (a quarter each), and each has its gradients'
SLOTS = 8_320 + 16_512
GATHERED = SLOTS // 4 + SLOTS


def test_a_sharded_checkpoint_resumes_on_any_layout_as_a_run_that_never_stopped(tmp_path):
    """Written by 4 workers holding a quarter each; resumed 4 steps on as 3 such workers, as a pipeline of 2
    stages and as local: each equal to 1e-9 (float64) to a local run of 14 steps that never stopped.  The
    start event reports each worker's bytes, 32/W a parameter (float64 Adam) and two gathered units, as the
    start-up check priced them."""
    from conftest import checkpoint_at, events

    from mpidist.store import checkpoint

    common = ["--dtype", "float64", "--optimizer", "adam", "--progress", "none", "--run-dir", ""]
    common += ["--checkpoint-wait", "--bucket-mb", "0.1"]
    done, _ = mpidist(
        4,
        *common,
        "--shard",
        "parameters",
        "--steps",
        "10",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "1/4 of 3 unit(s)" in done.stdout and "each rank holding 1/4 of the model" in done.stdout
    held = events(tmp_path / "m.jsonl", "start")[0]["held_bytes"]
    assert held == [
        {
            "rank": rank,
            "params": 8 * s,
            "grads": 8 * s,
            "optimizer_state": 16 * s,
            "gathered_units": 8 * GATHERED,
        }
        for rank, s in enumerate(SHARDS_OF_4)
    ], held
    written = checkpoint_at(tmp_path / "ck", 10)
    layouts = {
        "never-stopped": (1, ["--strategy", "local", "--steps", "14"]),
        "sharded-3": (3, ["--shard", "parameters", "--resume", str(written), "--steps", "14"]),
        "pipeline": (
            2,
            ["--strategy", "pipeline", "--stages", "2", "--resume", str(written), "--steps", "14"],
        ),
        "local": (1, ["--strategy", "local", "--resume", str(written), "--steps", "14"]),
    }
    params = {}
    for name, (ranks, flags) in layouts.items():
        done, _ = mpidist(ranks, *common, *flags, "--checkpoint-dir", str(tmp_path / name), timeout=120)
        assert done.returncode == 0, (name, done.stderr)
        params[name] = checkpoint.load(checkpoint_at(tmp_path / name, 14)).params
    assert not np.allclose(params["local"], checkpoint.load(written).params)  # (4 steps did train)
    for name in ("sharded-3", "pipeline", "local"):
        np.testing.assert_allclose(params[name], params["never-stopped"], rtol=1e-9, atol=1e-12, err_msg=name)
    # eval and predict in the same layout (3 ranks, each a shard: their shares of the split in step) give
    # what the whole model gives on one rank
    for command, flags in (("eval", []), ("predict", ["--output", str(tmp_path / "p-{}.h5")])):
        printed = []
        for ranks, layout in ((1, []), (3, ["--shard", "parameters"])):
            more = [flag.format(ranks) for flag in flags]
            done, _ = mpidist(ranks, command, str(written), *layout, *more, timeout=120)
            assert done.returncode == 0, (command, layout, done.stderr)
            said = done.stdout.replace(str(tmp_path / f"p-{ranks}.h5"), "OUT").splitlines(keepends=True)
            # (each layout says its own price: what a rank holds differs, the figures do not)
            printed.append("".join(line for line in said if not line.startswith("mpidist: memory: ")))
        assert printed[0] == printed[1] and "accuracy" in printed[0], printed
    with h5py.File(tmp_path / "p-1.h5") as one, h5py.File(tmp_path / "p-3.h5") as three:
        np.testing.assert_array_equal(one["probabilities"][...], three["probabilities"][...])


@pytest.mark.parametrize("nodes, ranks", [(2, 4), (3, 6)])
def test_shards_train_as_local_on_emulated_nodes(nodes, ranks):
    """The equality above with the workers spread over emulated nodes (their gathers and sums between nodes
    go through MPI's network module)."""
    here = str(ROOT / "tests" / "parallel" / "test_fully_sharded.py")
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--with-mpi", here, "-k", "train_as_local_on_the"]
    done, _ = run_mpi(ranks, args, timeout=180, nodes=nodes)
    assert done.returncode == 0 and "24 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--elastic"],
            "--shard parameters keeps a slice of the parameters and optimizer state on one worker",
        ),
        (["--compress", "bf16"], "--shard parameters does not combine with --compress bf16"),
        (
            ["--exchange", "shared-memory"],
            "--shard parameters does not combine with --exchange shared-memory",
        ),
        (["--model", f"{ROOT}/examples/custom_model.py:build"], "keeps running statistics (BatchNorm)"),
        (["--shard", "optimizer", "--no-reshard-after-forward"], "applies to --shard parameters alone"),
    ],
)
def test_what_cannot_run_sharded_is_refused_with_its_reason(flags, message):

    done, _ = mpidist(2, "train", "--shard", "parameters", *flags, "--steps", "1", "--run-dir", "")
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_tensor_parts_sharded_over_the_replicas_may_ask_to_gather_once_per_node():
    """--tensor 2 on 4 ranks of one node: each part's two replicas share its gathered units (--exchange node,
    what auto takes), where a replicated tensor run's --exchange node is refused."""
    flags = ["train", "--tensor", "2", "--exchange", "node", "--steps", "1", "--run-dir", ""]
    done, _ = mpidist(4, *flags, "--shard", "parameters", timeout=120)
    assert done.returncode == 0 and done.stdout.count("gathered once per node of 2") == 4, done.stderr
    refused, _ = mpidist(4, *flags, timeout=120)
    assert refused.returncode == 2 and "does not combine with --exchange node" in refused.stderr


def test_under_an_address_space_limit_each_worker_gathers_into_slots_of_its_own():
    """ulimit -v counts the node's whole windows in every rank that maps them, which the price of one copy a
    node leaves out: auto gathers on every rank, and --exchange node is refused, on every rank alike."""
    flags = ["-m", "mpidist", "train", "--shard", "parameters", "--steps", "1", "--run-dir", ""]
    limited = ("prlimit", f"--as={8 << 30}")
    auto, _ = run_mpi(2, flags, timeout=120, prefix=limited)
    assert auto.returncode == 0 and "1/2 of 1 unit(s)" in auto.stdout, auto.stderr
    assert "gathered once per node" not in auto.stdout
    asked, _ = run_mpi(2, [*flags, "--exchange", "node"], timeout=120, prefix=limited)
    assert asked.returncode == 2, asked.stderr
    assert asked.stderr.count("--exchange node: an address-space limit (ulimit -v)") == 1, asked.stderr


def test_under_a_memory_cap_sharded_workers_train_a_model_none_of_them_can_hold(tmp_path):
    """mlp:3072,3072,3072 with Adam (19.1 M parameters: a whole copy's training state is 365 MiB) under 460 MB
    of data a rank: replicated, every worker is refused, told that sharded it fits; sharded over 4 workers
    (each 1/4 of the state and two gathered layers of 9.4 M parameters, 415 MiB a rank in all: what the
    process holds, its threads and MPI's copy of a unit included), it trains and checkpoints; and capped 2%
    above its own price, it runs to its end (nothing allocated past the price: the node's shared slots are
    let go without private copies)."""
    from test_memory_price import stated

    flags = ["--data", "digits", "--model", "mlp:3072,3072,3072", "--optimizer", "adam", "--batch-size", "32"]
    flags += ["--eval-every", "0", "--progress", "none", "--metrics", "", "--run-dir", "", "--steps", "2"]
    flags += ["--checkpoint-dir", str(tmp_path / "ck")]

    def run(*more, cap=460_000_000):
        prefix = ("prlimit", f"--data={int(cap)}")
        return run_mpi(4, ["-m", "mpidist", "train", *flags, *more], timeout=120, prefix=prefix)[0]

    whole = run("--exchange", "mpi")
    assert whole.returncode == 2 and not list(tmp_path.glob("ck/*.h5")), whole.stderr
    assert "sharded, it fits: --shard parameters (each of the 4 workers needs" in whole.stderr, whole.stderr
    sharded = run("--shard", "parameters")
    assert sharded.returncode == 0, sharded.stderr
    assert len(list(tmp_path.glob("ck/*.h5"))) == 1
    tight = run(
        "--shard",
        "parameters",
        "--checkpoint-dir",
        str(tmp_path / "tight"),
        cap=stated(sharded.stdout) * 1.02,
    )
    assert tight.returncode == 0, tight.stderr


def test_where_two_units_in_flight_do_not_fit_one_does_and_the_run_trains_alike(tmp_path):
    """mlp:2048,2048,2048 with Adam at --bucket-mb 4 (a unit a layer, the largest 4.2 M parameters) on 2
    workers: capped below the price of two units in flight, every worker gathers one unit at a time (a unit of
    gradients fewer, and half a unit of parameters: the node's workers share one copy), says so, states the
    smaller price, and trains to the same losses as the run that prefetched."""
    from conftest import events
    from test_memory_price import stated

    flags = [
        "--data",
        "mnist-5k",
        "--model",
        "mlp:2048,2048,2048",
        "--optimizer",
        "adam",
        "--batch-size",
        "32",
    ]
    flags += [
        "--shard",
        "parameters",
        "--bucket-mb",
        "4",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--log-every",
        "1",
    ]
    flags += ["--progress", "none", "--run-dir", ""]

    def run(name, *prefix):
        done, _ = run_mpi(
            2,
            ["-m", "mpidist", "train", *flags, "--metrics", str(tmp_path / name)],
            timeout=120,
            prefix=prefix,
        )
        assert done.returncode == 0, done.stderr
        return done, [e["loss"] for e in events(tmp_path / name, "step")]

    prefetching, losses = run("free.jsonl")
    price = stated(prefetching.stdout)
    assert "one unit in flight" not in prefetching.stdout
    in_turn, capped_losses = run("capped.jsonl", "prlimit", f"--data={int(price * 0.95)}")
    assert "one unit of each at a time" in in_turn.stdout and "one unit in flight" in in_turn.stdout
    # (a unit of gradients left out of the price, and one of parameters, which the node's two workers share)
    largest = 2048 * 2048 * 4
    assert stated(in_turn.stdout) <= price - largest - largest // 2 + (1 << 20), (price, in_turn.stdout)
    # every rank prices the layout it takes (a rank that could have prefetched too)
    needed = [
        events(tmp_path / name, "start")[0]["memory"]["needed"] for name in ("free.jsonl", "capped.jsonl")
    ]
    assert all(b <= a - largest - largest // 2 + (1 << 20) for a, b in zip(*needed)), needed
    assert capped_losses == losses and len(losses) == 3


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("name", ["deep", "residual", "transformer"])
def test_tensor_parts_sharded_over_the_replicas_train_as_local(name):
    """data x tensor 2: each part of a tensor group sharded over the replicas (2 or 3 of them), against local
    on the global batch with a clip that bites (tests/parallel/test_tensor.py's runs): the same loss and
    clipping at each step, and the same model to 1e-9, each worker's shards at their places."""
    from test_tensor import tensor_runs

    cluster, strategy, reference = tensor_runs(2, name, clip=0.05, sharded=64 * 8)
    assert len(strategy.shards.units) > 1 and reference.clipped
    where = strategy.placement.positions()
    # (atol: Adam's steps on a gradient near zero, as tests/parallel/test_tensor.py's)
    np.testing.assert_allclose(strategy.params, reference.model.params[where], rtol=1e-9, atol=1e-9)
    # the workers' shards are the whole model, each element written once
    mine = [where[lo:hi] for lo, hi in _written(strategy)]
    written = np.concatenate(cluster.workers.allgather(np.concatenate(mine + [np.zeros(0, int)])))
    assert np.array_equal(np.sort(written), np.arange(reference.model.num_params))
    strategy.free()
    cluster.free()


def _written(strategy):
    """``(lo, hi)`` of the regions this worker writes, in its buffer of shards."""
    return [(r.lo, r.lo + r.size) for r in strategy.placement.regions if r.writes]


@pytest.mark.mpi(min_size=2)
def test_workers_with_unequal_shares_of_a_split_evaluate_in_step_as_one_process():
    """Worker ``w`` evaluates ``w + 1`` batches (the ones before it have run out while it gathers): the
    figures are local's over every batch, and no worker is left waiting in a gather."""
    cluster = build_cluster(MPI.COMM_WORLD)
    workers, worker = cluster.num_workers, cluster.worker_index
    xs, ys = batches(5)
    every = [(xs[k % STEPS] + k, ys[k % STEPS]) for k in range(workers * (workers + 1) // 2)]
    first = worker * (worker + 1) // 2
    strategy = sharded(cluster, "sgd")
    strategy.initialize()
    figures = strategy.evaluate(every[first : first + worker + 1])
    local = LocalStrategy(small_convnet(np.float64), nn.loss_for(4, np), make("sgd"), seed=3)
    local.initialize()
    expected = local.evaluate(every)
    assert figures["samples"] == expected["samples"] == 5 * len(every)
    assert figures["loss"] == pytest.approx(expected["loss"], rel=1e-12)
    assert figures["accuracy"] == expected["accuracy"]
    strategy.free()
    cluster.free()


def test_the_start_up_check_prices_what_each_worker_then_reports():
    """holding's price of a worker under --shard parameters (before any strategy exists) is what the run's
    start event reports: the closed form above, per rank."""
    from types import SimpleNamespace

    from mpidist.nn import zoo
    from mpidist.parallel import holding

    model = zoo.build_model("mlp", (64,), 10, np, np.float64, buffers=False)  # (digits)
    settings = SimpleNamespace(
        strategy="allreduce",
        shard="parameters",
        tensor=1,
        bucket_mb=0.1,
        reshard_after_forward=True,
        exchange="auto",
        device="cpu",
    )
    for rank, shard in enumerate(SHARDS_OF_4):
        cluster = SimpleNamespace(
            num_workers=4,
            worker_index=rank,
            is_chief=rank == 0,
            size=4,
            num_nodes=1,
            local_size=4,
            nodes_alike=True,
        )
        held = holding.held(settings, cluster, model, 2)
        assert (held.params, held.grads, held.optimizer, held.gathered) == (shard, shard, shard, GATHERED)
        assert holding.held_bytes(held, 2, 8) == 32 * shard + 8 * GATHERED
