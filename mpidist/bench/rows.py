"""The rows of ``bench``'s table: mpidist's strategies, and the references that make them mean something.

The rows of one process (``local``, ``hand-written``, ``torch``) are
:mod:`mpidist.bench.one_process`'s.

Every rank together, alternating step by step as well:

* ``no exchange``: every rank computes mpidist's local step and nothing is
  exchanged: the limit for data parallelism on these cores;
* ``no exchange, barrier``: the same, then a ``Barrier``: what a step costs
  that only waits for the slowest rank, the floor of every synchronous
  exchange (ranks that differ in speed, or stall at random, pay it);
* ``allreduce`` (its default exchange: one copy of the model per node, each
  rank summing and updating its part), ``allreduce, shared-memory`` (a copy
  per rank, the gradients summed in one shared window), ``allreduce, mpi``
  (``--exchange mpi``: ``Iallreduce`` per bucket, the default 64 MiB buckets),
  and ``allreduce, mpi, 0.25 MiB`` with and without overlap (buckets small
  enough to split these models, reduced as backward fills them or after it):
  what each way of summing costs;
* ``allreduce, bf16``: ``--compress bf16``, half the bytes (its exchange is
  timed against the bare float32 ``Allreduce``: below 1, compression pays);
* ``allreduce, shard parameters``: each worker holding 1/W of the model and
  gathering a unit at a time, once per node (units of ``--bucket-mb``'s
  64 MiB: these models are one unit), ``..., mpi`` gathering it on every
  rank (``--exchange mpi``), and with units of 0.25 MiB (a unit's gather
  overlapping the one before's compute), those kept from forward to
  backward too (``--no-reshard-after-forward``: no second gather);
* ``hand-written+Allreduce``: the hand-written loop with one ``Allreduce`` of
  its flat gradient buffer after backward;

then ``ps-sync`` and ``ps-async`` with one ps, and each exchange against the
bare MPI calls that move the same bytes.
"""

import math
import time

import numpy as np
from mpi4py import MPI

from .. import nn
from ..parallel import (
    AllreduceStrategy,
    Exchange,
    FullyShardedStrategy,
    LocalStrategy,
    PsAsyncStrategy,
    PsSyncStrategy,
)
from ..runtime import comm as mpi
from ..runtime.cluster import build_cluster
from ..runtime.rma import Window
from .handwritten import handwritten_for
from .timing import synced_alternating, synced_timed, timed_steps

#: each zoo model's samples: MNIST-shaped for mlp-wide and cnn (the README's figures), MNIST-1D's 40-step
#: signals for the transformer (its figures in docs/models.rst), the bundled digits' otherwise
SHAPES = {"mlp-wide": ((28, 28), 10), "cnn": ((28, 28), 10), "transformer": ((40,), 10)}
DEFAULT_SHAPE = ((8, 8), 10)


def shape_of(spec):
    """``(sample shape, classes)`` bench feeds the zoo model ``spec`` (``cnn``, ``transformer:2,64,4``)."""
    return SHAPES.get(spec.split(":")[0], DEFAULT_SHAPE)


SMALL_BUCKETS = 1 << 18  # bytes: buckets that split mlp-wide (2.7 MB) and cnn (0.4 MB), to measure overlap


def sgd(size):
    return nn.make_optimizer("sgd", size, 0.01)


def adam(size):
    return nn.make_optimizer("adam", size, 0.001)


#: ``bench --optimizer``: what every mpidist row trains with.  The hand-written loop and torch implement SGD
#: with momentum alone, so their rows (and the ratios against them) come with ``sgd`` only.
OPTIMIZERS = {"sgd": sgd, "adam": adam}


def _model(name, xp=np):
    """The zoo model ``name`` for bench's sample shape, in float32 (on a GPU with ``xp`` cupy)."""
    return nn.build_model(name, *shape_of(name), xp, np.float32)


def _allreduce(model, cluster, optimizer="sgd", **arguments):
    """An initialised allreduce strategy on ``model`` with ``optimizer``."""
    strategy = AllreduceStrategy(
        model, nn.loss_for(10, np), OPTIMIZERS[optimizer], cluster, seed=0, **arguments
    )
    strategy.initialize()
    return strategy


def _fully_sharded(name, cluster, optimizer="sgd", bucket_bytes=64 << 20, keep=False, exchange="auto"):
    """An initialised ``allreduce --shard parameters`` on model ``name``, units of at most
    ``bucket_bytes``, gathered as ``exchange`` says (once per node where it can, or on every rank)."""
    strategy = FullyShardedStrategy(
        _model(name),
        nn.loss_for(10, np),
        OPTIMIZERS[optimizer],
        cluster,
        seed=0,
        bucket_bytes=bucket_bytes,
        keep=keep,
        exchange=exchange,
    )
    strategy.initialize()
    return strategy


def _problem(name, batch, seed, xp=np):
    classes = shape_of(name)[1]
    rng = np.random.default_rng(seed)
    model = _model(name, xp)
    x = rng.random((batch,) + model.input_shape, dtype=np.float32)
    y = rng.integers(0, classes, batch)
    return model, x, y


def _local(name, batch, seed, optimizer="sgd"):
    """A local strategy on ``name`` with its batch, and a step function that counts steps."""
    model, x, y = _problem(name, batch, seed)
    local = LocalStrategy(model, nn.loss_for(10, np), OPTIMIZERS[optimizer], seed=0)
    local.initialize()
    counter = iter(range(1 << 30))
    return local, x, y, lambda: local.train_step(x, y, 1.0, next(counter))


def _row(name, strategy, ranks, workers, batch, per_step, params):
    return {
        "model": name,
        "strategy": strategy,
        "ranks": ranks,
        "workers": workers,
        "batch_per_rank": batch,
        "params": params,
        "steps_per_s": 1 / per_step,
        "samples_per_s": workers * batch / per_step,
    }


def parallel_rows(world, cluster, name, batch, seconds, optimizer="sgd"):
    """``no exchange``, every ``allreduce`` exchange (see the module's docstring) and
    ``hand-written+Allreduce``."""
    size = world.Get_size()
    model, x, y = _problem(name, batch, world.Get_rank())
    strategy = _allreduce(model, cluster, optimizer)
    owners = {
        "allreduce": strategy,
        "allreduce, mpi": _allreduce(_model(name), cluster, optimizer, exchange="mpi"),
        "allreduce, mpi, 0.25 MiB": _allreduce(
            _model(name), cluster, optimizer, exchange="mpi", bucket_bytes=SMALL_BUCKETS
        ),
        "allreduce, mpi, 0.25 MiB, no overlap": _allreduce(
            _model(name), cluster, optimizer, exchange="mpi", bucket_bytes=SMALL_BUCKETS
        ),
        "allreduce, bf16": _allreduce(_model(name), cluster, optimizer, compress="bf16"),
        "allreduce, shard parameters": _fully_sharded(name, cluster, optimizer),
        "allreduce, shard parameters, mpi": _fully_sharded(name, cluster, optimizer, exchange="mpi"),
        "allreduce, shard parameters, 0.25 MiB": _fully_sharded(name, cluster, optimizer, SMALL_BUCKETS),
        "allreduce, shard parameters, 0.25 MiB, kept": _fully_sharded(
            name, cluster, optimizer, SMALL_BUCKETS, keep=True
        ),
    }
    if cluster.num_nodes == 1 and size > 1:  # (a copy per rank, the gradients in one node's shared window)
        owners["allreduce, shared-memory"] = _allreduce(
            _model(name), cluster, optimizer, exchange="shared-memory"
        )
    after_backward = owners["allreduce, mpi, 0.25 MiB, no overlap"]
    after_backward.exchange = Exchange(
        after_backward.worker_comm, after_backward.buffer, after_backward.bucket_bytes, overlap=False
    )
    _, _, _, alone_step = _local(name, batch, world.Get_rank(), optimizer)
    _, _, _, waiting_step = _local(name, batch, world.Get_rank(), optimizer)

    def then_wait():  # a synchronous step's floor: the local step, then wait for the slowest rank
        waiting_step()
        world.Barrier()

    counter = iter(range(1 << 30))
    steps = {"no exchange": alone_step, "no exchange, barrier": then_wait}
    for label, owner in owners.items():
        steps[label] = lambda owner=owner: owner.train_step(x, y, 1.0 / size, next(counter))
    hand = handwritten_for(model, batch) if optimizer == "sgd" else None
    if hand is not None:
        flat = x.reshape(batch, -1)

        def hand_allreduce():
            hand.backprop(flat, y, 1.0 / size)
            world.Allreduce(MPI.IN_PLACE, hand.grads)
            hand.update()

        steps["hand-written+Allreduce"] = hand_allreduce
    if size == 1:  # nothing to exchange: the variants would only repeat "no exchange"
        steps = {"allreduce": steps["allreduce"]}
    medians = synced_alternating(world, steps, seconds)
    rows = {
        label: _row(name, label, size, size, batch, per_step, model.num_params)
        for label, per_step in medians.items()
    }
    if size > 1:  # on one rank both are no-ops: a ratio of microseconds would mislead
        # each exchange against one bare float32 Allreduce of the same buffer (bf16: what compression saves)
        bare = np.zeros_like(strategy.buffer)
        for label in ("allreduce", "allreduce, shared-memory", "allreduce, mpi", "allreduce, bf16"):
            owner = owners.get(label)
            if owner is None:
                continue
            # each timed exchange sums the buffer in place: from zeros (and no rounding error carried over
            # from training), like the bare call's, it stays zero instead of doubling to overflow
            world.Barrier()  # (the last timed step's copies from the peers' buffers are over)
            owner.buffer[...] = 0
            if hasattr(owner.exchange, "residual"):
                owner.exchange.residual[...] = 0
            _compare(
                world,
                rows[label],
                _whole_exchange(owner.exchange),
                lambda: world.Allreduce(MPI.IN_PLACE, bare),
                seconds,
                owner.exchange.bytes_per_step,
            )
        internode = strategy.stats().get("internode_bytes_per_step")
        if internode is not None:  # what this node sent to other nodes per training step (emulated nodes)
            rows["allreduce"]["internode_bytes_per_step"] = strategy.exchange.node.allreduce(internode)
    for owner in owners.values():
        owner.free()
    return list(rows.values())


def _whole_exchange(exchange):
    """The exchange of a whole buffer at once, as after backward."""

    def run():
        exchange.begin()
        exchange.finish()
        exchange.after_update()

    return run


def _compare(world, row, exchange, bare, seconds, nbytes):
    """Median time of mpidist's exchange and of the bare MPI calls, interleaved."""
    medians = synced_alternating(world, {"ours": exchange, "bare": bare}, seconds)
    row.update(exchange_bytes=int(nbytes), exchange_ms=1e3 * medians["ours"], bare_ms=1e3 * medians["bare"])
    row["exchange_over_bare"] = row["exchange_ms"] / row["bare_ms"]


def ps_sync_row(world, name, batch, seconds, optimizer="sgd"):
    cluster = build_cluster(world, num_ps=1)
    workers = cluster.num_workers
    model, x, y = _problem(name, batch, world.Get_rank())
    strategy = PsSyncStrategy(model, nn.loss_for(10, np), OPTIMIZERS[optimizer], cluster, seed=0)
    strategy.initialize()
    if not strategy.is_worker:
        x = y = None
    counter = iter(range(1 << 30))
    per_step = synced_timed(world, lambda: strategy.train_step(x, y, 1.0 / workers, next(counter)), seconds)
    row = _row(name, "ps-sync", world.Get_size(), workers, batch, per_step, model.num_params)
    send, recv = strategy.outbox.copy(), np.zeros_like(strategy.inbox)
    values, counts, displs = strategy.values.copy(), strategy.counts, strategy.displs

    def ours():
        mpi.reduce_scatter_sum(world, strategy.outbox, strategy.inbox, counts)
        mpi.allgatherv_inplace(world, strategy.values, counts, displs)

    def bare():
        world.Reduce_scatter(send, recv, recvcounts=list(counts))
        world.Allgatherv(MPI.IN_PLACE, [values, list(counts), list(displs), MPI.FLOAT])

    _compare(world, row, ours, bare, seconds, send.nbytes)
    cluster.free()
    return row


def ps_async_row(world, name, batch, seconds, optimizer="sgd"):
    """Workers train for ``seconds`` while the ps serves; then exchange against raw window ops."""
    cluster = build_cluster(world, num_ps=1)
    model, x, y = _problem(name, batch, world.Get_rank())
    strategy = PsAsyncStrategy(model, nn.loss_for(10, np), OPTIMIZERS[optimizer], cluster, seed=0)
    strategy.initialize()
    ps = strategy.ps_ranks[0]
    raw = Window(world, model.num_params if cluster.rank == ps else 0, np.float32)
    timings = np.zeros(3)  # steps/s, exchange ms, bare ms (workers)
    if strategy.serves:
        strategy.serve()
    else:
        step, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or step < 5:
            strategy.train_step(x, y, 1.0 / cluster.num_workers, step)
            step += 1
        timings[0] = step / (time.perf_counter() - start)
        grads, values = strategy.host_grads, strategy.host_params

        def ours():
            strategy.exchange.pull(values)
            strategy.exchange.push(grads)

        def bare():  # the same atomic operations, called raw: what mpidist adds is the rest
            raw.read(values, ps)
            raw.flush(ps)
            raw.add(grads, ps)
            raw.flush(ps)

        for index, fn in ((1, ours), (2, bare)):
            per_call, _ = timed_steps(fn, seconds / 2)
            timings[index] = 1e3 * per_call
    strategy.finish()
    totals = mpi.sum_float64(world, timings)
    workers = cluster.num_workers
    raw.free()
    strategy.free()
    cluster.free()
    row = _row(
        name,
        "ps-async",
        world.Get_size(),
        workers,
        batch,
        1 / max(totals[0] / workers, 1e-9),
        model.num_params,
    )
    row.update(
        exchange_bytes=int(2 * model.num_params * 4),
        exchange_ms=totals[1] / workers,
        bare_ms=totals[2] / workers,
    )
    row["exchange_over_bare"] = row["exchange_ms"] / row["bare_ms"] if row["bare_ms"] else math.nan
    return row
