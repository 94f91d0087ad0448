"""``plan --calibrate``: measure, under the user's own launcher, what a prediction needs (collective).

Rank 0 times the model while the other ranks sleep (the cores are its own):
each top-level layer's forward and backward at four batch sizes, timed in
interleaved rounds for ``--seconds`` (a line fitted through them: a fixed
cost and a cost per sample), scaled to add up
to the whole pass's own line (timed for ``--seconds``), the loss, a whole
``local`` step (what the step adds besides the layers: the optimizer and
its checks, per parameter), the spread of step times, and a sum of one
buffer into another; first of all, a short ``train`` of one process, whose
peak resident memory anchors the memory a rank holds besides its arrays.
Then pairs of ranks sum buffers of 8 B to 32 MiB (an ``Allreduce`` of the
two), within a node and, where there are several, between two nodes; a line
through the times gives each link's latency and time per byte as the
collectives see it (their sums and copies included).  The same pairs train
side by side, in blocks, to measure how much they slow each other and how
far apart their steps end (:func:`_crowding`), and run ``allreduce
--exchange mpi`` with its buckets reduced during backward and after it, to
measure how much of the exchange backward hides (:func:`_overlap_times`).
One-stage pipelines of 1 and 8 micro-batches give a micro-batch's own cost.
"""

import dataclasses
import os
import time

import numpy as np
from mpi4py import MPI

from .. import data, nn
from ..bench.timing import release, sleep_until_released
from ..loop.setup import Inputs, build_model_for
from ..nn.tensor import TensorSum, operators, split_model
from ..parallel import LocalStrategy
from ..runtime import comm as mpi
from ..runtime.cluster import node_layout
from ..runtime.memory import available_bytes, high_water, peak_memory, reset_high_water
from .calibration import Calibration, LayerCost
from .buckets import hideable
from .step import Layout, predict, slowest_of
from .links import Link, fit

SIZES = [8 << (2 * k) for k in range(12)]  # 8 B .. 32 MiB by factors of 4
REPEATS = 7


def calibrate(world, config, seconds=1.0):
    """The :class:`Calibration` of ``config``'s model and data on this machine (complete on rank 0; every rank
    must call)."""
    baseline = peak_memory()  # (before any data or model: what Python, numpy and MPI hold)
    node, _, _, node_of_rank = node_layout(world)
    figures = trainer = None
    if world.Get_rank() == 0:
        figures, trainer = _compute(config, seconds)
        release(world)
    else:
        sleep_until_released(world)
    within = _pair(world, node_of_rank, same_node=True)
    between = _pair(world, node_of_rank, same_node=False)
    trainer = trainer or _Trainer(config)
    crowding, spreads = zip(
        *[_crowding(world, node_of_rank, same, trainer, seconds) or (None, None) for same in (True, False)]
    )
    overlap = _overlap_times(world, node_of_rank, config, trainer, seconds)
    node.Free()
    if world.Get_rank() != 0:
        return None
    peak = figures.pop("run_peak_bytes")
    measured = next((spread for spread in spreads if spread is not None), None)
    if measured is not None:  # (as a synchronous step meets it; the spread of one rank alone otherwise)
        figures["jitter"] = measured
    made = Calibration(
        **figures,
        node=within,
        network=between,
        baseline_bytes=0,
        overlap=0.0,
        node_crowding=crowding[0],
        network_crowding=crowding[1],
        ranks_per_node=max(node_of_rank.count(n) for n in set(node_of_rank)),
        cores=len(os.sched_getaffinity(0)),
        node_memory_bytes=baseline * world.Get_size() + (available_bytes() or 0),
    )
    # what a rank holds besides the arrays the model counts: the one-process run's peak less its arrays
    arrays = predict(made, Layout("local", 1, 1, made.batch_per_rank)).memory
    return dataclasses.replace(
        made, baseline_bytes=max(baseline, peak - arrays), overlap=_overlap_share(made, overlap)
    )


def _median_seconds(fn, repeats=REPEATS):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), times


class _Trainer:
    """``config``'s model on a batch of its training rows, ready to train: ``step()`` is one ``local`` step."""

    def __init__(self, config):
        inputs = Inputs.of(config)
        self.info = data.inspect(data.resolve(inputs.data), allow_external=config.allow_external)
        self.model = model = build_model_for(config, inputs, self.info, np)
        self.loss = nn.loss_for(self.info.num_classes, np)
        self.batch = batch = max(4, config.batch_size)
        shard = data.Shard(self.info, "train", 0, 1, model.input_shape, model.dtype, rows=slice(0, batch))
        x, y = shard.x, shard.y
        while len(y) < batch:  # (a split smaller than a batch: its rows again)
            x, y = np.concatenate([x, shard.x]), np.concatenate([y, shard.y])
        self.x, self.y = x[:batch], y[:batch]
        self.make = lambda size: nn.make_optimizer(
            config.optimizer, size, config.lr, xp=np, dtype=model.dtype
        )  # noqa
        self.local = LocalStrategy(model, self.loss, self.make, seed=config.seed)
        self.local.initialize()  # (first: passes then run in the workspace training uses, as fast as there)
        self.steps = iter(range(1 << 30))

    def step(self):
        self.local.train_step(self.x, self.y, 1.0, next(self.steps))


def _read_overhead(config, info, model):
    """Bytes reading one worker's lanes of the training split in memory (worker 0 of 2) takes at its peak above
    what it then holds: the blocks and chunks the file is read in (0 where the peak cannot be started over)."""
    global_batch = 2 * max(4, config.batch_size)
    if info.sizes["train"] < global_batch or not reset_high_water():
        return 0
    before = high_water()
    shard = data.Shard(
        info, "train", 0, 2, model.input_shape, model.dtype, lanes=data.Lanes.of(global_batch, 2, 0)
    )
    after = high_water()
    if before is None or after is None:
        return 0
    return max(0, after - before - int(shard.x.nbytes) - int(shard.y.nbytes))


def _compute(config, seconds):
    rate, peak = _short_run(config, max(4, config.batch_size))  # (first: its peak is a whole run's, no more)
    trainer = _Trainer(config)
    info, model, loss, x, y, batch = (
        trainer.info,
        trainer.model,
        trainer.loss,
        trainer.x,
        trainer.y,
        trainer.batch,
    )
    read_overhead = _read_overhead(config, info, model)
    sizes = sorted({max(1, batch // 8), max(1, batch // 4), max(1, batch // 2), batch})  # (micro-batches too)
    forward, backward, losses = _scaled(
        *_layer_lines(model, loss, x, y, sizes, seconds), _whole_line(model, loss, x, y, sizes, seconds)
    )
    step, times = _median_seconds(trainer.step, max(REPEATS, int(seconds / 0.01)) if seconds else REPEATS)
    overhead = max(0.0, batch / rate - step) if rate > 0 else 0.0
    layers_s = (
        sum(f[0] + f[1] * batch + b[0] + b[1] * batch for f, b in zip(forward, backward))
        + losses[0]
        + losses[1] * batch
    )
    params = max(1, model.num_params)
    buffer = np.ones(max(params, 1 << 20), dtype=model.dtype)
    other = buffer.copy()
    summed, _ = _median_seconds(lambda: np.add(buffer, other, out=buffer))
    added = params * buffer.itemsize * summed / buffer.nbytes  # (a micro-batch's gradients into the step's)
    fixed = sum(f[0] + b[0] for f, b in zip(forward, backward)) + losses[0] + added
    micro_batch_s = _micro_batch_seconds(config, batch, fixed)
    splits, sums = _tensor_shape(model)
    shapes = model.shapes[1:] + [model.output_shape]
    layers = tuple(
        LayerCost(
            type(layer).__name__,
            model.layer_params(index),
            int(np.prod(shapes[index])),
            splits[index],
            forward[index],
            backward[index],
        )
        for index, layer in enumerate(model.layers)
    )
    return {
        "model": config.model,
        "data": str(info.path),
        "optimizer": config.optimizer,
        "dtype": np.dtype(model.dtype).name,
        "itemsize": int(np.dtype(model.dtype).itemsize),
        "sample_bytes": int(np.prod(model.input_shape)) * int(np.dtype(model.dtype).itemsize),
        "train_samples": int(info.sizes["train"]),
        "test_samples": int(info.sizes.get("test", 0)),
        "layers": layers,
        "loss": losses,
        "tensor_sums": sums,
        "batch_per_rank": batch,
        "optimizer_per_param": max(0.0, step - layers_s) / params,
        "step_overhead": overhead,
        "micro_batch_s": micro_batch_s,
        "run_peak_bytes": peak,
        "read_overhead_bytes": read_overhead,
        "sum_per_byte": summed / buffer.nbytes,
        # (the spread of the upper half, robust to the odd step a busy machine stretches tenfold)
        "jitter": float((np.percentile(times, 84) - np.median(times)) / np.median(times)),
    }, trainer


def _micro_batch_seconds(config, batch, fixed, steps=150):
    """Seconds a pipeline stage spends on each micro-batch besides ``fixed`` (the layers' and the loss's fixed
    seconds and the sum of the gradients): from one-stage pipelines of 1 and of M micro-batches, the step's
    growth per micro-batch added."""
    micro = min(8, batch)
    if micro < 2:
        return 0.0
    rates = [
        _short_run(config, batch, steps, strategy="pipeline", stages=1, micro_batches=m)[0]
        for m in (1, micro)
    ]
    if min(rates) <= 0:
        return 0.0
    return max(0.0, (batch / rates[1] - batch / rates[0]) / (micro - 1) - fixed)


def _short_run(config, batch, steps=200, **strategy):
    """``(samples/s, peak resident bytes)`` of ``steps`` steps of ``train`` on one process (with ``strategy``'s
    settings), with a run directory's metrics (in a scratch one, removed after), as users run it."""
    import io
    import shutil
    import tempfile

    from mpi4py import MPI

    from ..api import train
    from ..runtime import leftovers

    scratch = tempfile.mkdtemp(prefix="mpidist-calibrate-")
    try:
        with leftovers.pending(scratch, tree=True):  # (a signal that ends the command removes it too)
            result = train(
                model=config.model,
                data=config.data,
                optimizer=config.optimizer,
                lr=config.lr,
                dtype=config.dtype,
                batch_size=batch,
                steps=steps,
                epochs=10**6,
                eval_every=0,
                checkpoint_dir="",
                run_dir=scratch,
                progress="none",
                comm=MPI.COMM_SELF,
                stream=io.StringIO(),
                **strategy,
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result.figures.get("samples_per_s") or 0.0, peak_memory()


def _interleaved(workspace, sizes, seconds, measure):
    """``{size: [measure(size) each round]}``, in rounds of every size in turn for ``seconds`` (at least
    ``REPEATS`` rounds): a drift of the machine while it measures then moves every size alike, where sizes
    measured one after the other took it as a cost of their samples (a small layer's cost per sample, 0.2 us,
    adds only a few microseconds across the sizes).  Each size keeps its own ``workspace`` slot, as a step's
    slices of two sizes do: no pass reallocates its arrays, as no training pass does."""
    at = {size: [] for size in sizes}
    try:
        for slot, size in enumerate(sizes):  # (a round first, untimed: each slot's arrays are made)
            workspace.slot = slot
            measure(size)
        deadline = time.perf_counter() + seconds
        while len(at[sizes[-1]]) < REPEATS or time.perf_counter() < deadline:
            for slot, size in enumerate(sizes):
                workspace.slot = slot
                at[size].append(measure(size))
    finally:
        workspace.slot = 0
    return at


def _layer_lines(model, loss, x, y, sizes, seconds):
    """Per layer, forward and backward ``(fixed, per sample)`` seconds fitted over ``sizes`` from the medians
    of passes interleaved over ``seconds``; the loss's too."""
    at = _interleaved(
        model.workspace, sizes, seconds, lambda size: _timed_pass(model, loss, x[:size], y[:size])
    )
    medians = {size: [np.median(np.array(values), axis=0) for values in zip(*at[size])] for size in sizes}
    lines = [
        [_line(sizes, [medians[size][which][index] for size in sizes]) for index in range(len(model.layers))]
        for which in range(2)
    ]
    return lines[0], lines[1], _line(sizes, [medians[size][2] for size in sizes])


def _whole_line(model, loss, x, y, sizes, seconds):
    """``(fixed, per sample)`` of a whole training pass (forward, loss, backward as training runs them), from
    the medians of passes interleaved over ``seconds``: steadier than the sum of the layers' own lines."""

    def timed_pass(n):
        start = time.perf_counter()
        out = model.forward(x[:n], training=True)
        loss.forward(out, y[:n])
        model.backward(loss.backward(), input_grad=False)
        return time.perf_counter() - start

    at = _interleaved(model.workspace, sizes, seconds, timed_pass)
    return _line(sizes, [float(np.median(at[size])) for size in sizes])


def _scaled(forward, backward, losses, whole):
    """The layers' lines (and the loss's) scaled so that they add up to the whole pass's ``whole`` line: each
    layer keeps its share, the total is the steadier measurement."""
    parts = list(forward) + list(backward) + [losses]
    factors = []
    for column in range(2):
        total = sum(part[column] for part in parts)
        factors.append(whole[column] / total if total > 0 else 1.0)
    scale = lambda part: (part[0] * factors[0], part[1] * factors[1])  # noqa: E731
    return [scale(f) for f in forward], [scale(b) for b in backward], scale(losses)


def _line(sizes, seconds):
    """``(fixed, per sample)``, neither below zero, through ``seconds`` measured at ``sizes`` samples."""
    if len(sizes) == 1:
        return 0.0, float(seconds[0]) / sizes[0]
    slope, fixed = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float), 1)
    if slope < 0:
        return float(np.median(seconds)), 0.0
    if fixed < 0:
        return 0.0, float(np.median(np.asarray(seconds) / np.asarray(sizes)))
    return float(fixed), float(slope)


def _timed_pass(model, loss, x, y):
    """One training pass, each top-level layer timed: ``(forward s per layer, backward s per layer, loss s)``."""
    model.workspace.active = True
    forward, backward = np.zeros(len(model.layers)), np.zeros(len(model.layers))
    out = x
    for index, layer in enumerate(model.layers):
        start = time.perf_counter()
        out = layer.forward(out, True)
        forward[index] = time.perf_counter() - start
    start = time.perf_counter()
    loss.forward(out, y)
    grad = loss.backward()
    spent = time.perf_counter() - start
    # as training runs it: backward stops at the first layer with parameters, without its input gradient
    for index in range(len(model.layers) - 1, model.first_trained - 1, -1):
        start = time.perf_counter()
        if index == model.first_trained:
            model.layers[index].backward_params(grad)
        else:
            grad = model.layers[index].backward(grad)
        backward[index] = time.perf_counter() - start
    return forward, backward, spent


def _tensor_shape(model):
    """Which top-level layers ``--tensor`` divides, and the elements per sample of each forward sum."""
    try:
        part, placement = split_model(model, 0, 2)
        where = placement.positions()  # (a calibration's model: small)
    except ValueError:
        return [False] * len(model.layers), ()
    ends = model.offsets[1:] + [model.num_params]
    kept = np.bincount(np.searchsorted(np.asarray(ends), where, side="right"), minlength=len(model.layers))
    splits = [bool(kept[index] < model.layer_params(index)) for index in range(len(model.layers))]
    sizes = []
    for operator in operators(part):
        if isinstance(operator, TensorSum):
            operator.reduce = lambda array, sizes=sizes: sizes.append(int(array.size))
    part.forward(np.zeros((1, *model.input_shape), dtype=model.dtype), training=False)
    return splits, tuple(sizes)


BLOCKS = 4  # crowding's blocks of each kind, interleaved


def _crowding(world, node_of_rank, same_node, trainer, seconds):
    """``(crowding, spread)`` on rank 0: how much slower its step runs while the next rank on its node
    (``same_node``; or on another node) trains too than while that rank sleeps (ranks that share a node's
    memory and caches slow each other), and the spread of the two's step times as a synchronous step meets
    it (what waiting for the slower adds).  Measured in :data:`BLOCKS` blocks of each, in turn: rank 0 alone,
    the two together, the two waiting for each other after each step.  Blocks, not single steps: a host
    slows two cores kept busy more than two that take turns (one block alone and one together, minutes
    apart, gave 1.0 to 1.24 for the same pair; single steps in turn, 1.04-1.07 where runs met 1.15).
    ``(1.0, None)`` where there is no such rank.  Every rank calls; two of them train."""

    def measure(pair):
        first = pair.Get_rank() == 0
        start = time.perf_counter()
        trainer.step()
        steps = max(REPEATS, int(seconds / BLOCKS / 3 / max(time.perf_counter() - start, 1e-6)))
        count = np.array([steps], dtype=np.int64)
        mpi.bcast(pair, count, root=0)  # (rank 0's count: the pair takes as many steps)
        alone, together, waited = [], [], []
        for _ in range(BLOCKS):
            if first:  # alone: its partner asleep (not spinning in a barrier, which would take a core)
                _timed(trainer.step, count[0], alone)
                release(pair)
            else:
                sleep_until_released(pair)
            pair.Barrier()
            _timed(trainer.step, count[0], together)
            pair.Barrier()
            _timed(trainer.step, count[0], waited, pair)  # (as a synchronous step: each waits for the slower)
        if not first:
            return None
        # the wait for the slower of two is 1/sqrt(pi) standard deviations of a step: the spread as it acts
        spread = (np.median(waited) - np.median(together)) / np.median(together) / slowest_of(2)
        return max(1.0, float(np.median(together) / np.median(alone))), max(0.0, float(spread))

    made = _on_pair(world, node_of_rank, same_node, measure)
    return (1.0, None) if made is NO_PAIR else made


def _timed(step, count, into, pair=None):
    """``count`` calls of ``step``, each one's seconds appended to ``into``; with ``pair``, each between two
    barriers (timed to the second: the wait for the slower rank)."""
    for _ in range(int(count)):
        if pair is not None:
            pair.Barrier()
        start = time.perf_counter()
        step()
        if pair is not None:
            pair.Barrier()
        into.append(time.perf_counter() - start)


NO_PAIR = object()  # what :func:`_on_pair` gives where there is no second rank to measure with


def _on_pair(world, node_of_rank, same_node, measure):
    """Collective: ``measure(pair)`` on rank 0 and the next rank on its node (``same_node``) or on another node,
    over a communicator of the two, the other ranks waiting; its result on rank 0 (None on the others), or
    :data:`NO_PAIR` on every rank where there is no such rank."""
    partner = next(
        (r for r in range(1, world.Get_size()) if (node_of_rank[r] == node_of_rank[0]) == same_node), None
    )
    if partner is None:
        return NO_PAIR
    pair = world.Split(0 if world.Get_rank() in (0, partner) else MPI.UNDEFINED, key=world.Get_rank())
    made = None
    if pair != MPI.COMM_NULL:
        made = measure(pair)
        pair.Free()
    world.Barrier()
    return made if world.Get_rank() == 0 else None


def _overlap_times(world, node_of_rank, config, trainer, seconds):
    """Collective: on rank 0 and the next rank on another node (else on its node), the times of a local step
    and of ``allreduce --exchange mpi`` steps with buckets of a quarter of the gradients, reduced as backward
    fills them and after it, interleaved; ``(times, bucket bytes, nodes of the pair)`` on rank 0 (None
    elsewhere, or without a second rank)."""
    model = trainer.model
    bucket = max(1 << 12, (model.num_params + 1) * np.dtype(model.dtype).itemsize // 4)

    def measure(pair):
        from ..bench.timing import synced_alternating
        from ..parallel import AllreduceStrategy
        from ..parallel.exchange import Exchange
        from ..runtime.cluster import build_cluster

        cluster = build_cluster(pair)
        inputs, info = Inputs.of(config), trainer.info
        loss = nn.loss_for(info.num_classes, np)
        owners = {
            name: AllreduceStrategy(
                build_model_for(config, inputs, info, np),
                loss,
                trainer.make,
                cluster,
                seed=config.seed,
                exchange="mpi",
                bucket_bytes=bucket,
            )
            for name in ("overlapped", "after backward")
        }
        for owner in owners.values():
            owner.initialize()
        late = owners["after backward"]
        late.exchange = Exchange(late.worker_comm, late.buffer, late.bucket_bytes, overlap=False)
        counter = iter(range(1 << 30))
        steps = {"alone": trainer.step}
        steps.update(
            {
                name: lambda owner=owner: owner.train_step(trainer.x, trainer.y, 0.5, next(counter))
                for name, owner in owners.items()
            }
        )
        times = synced_alternating(pair, steps, 2 * seconds, every=True)
        for owner in owners.values():
            owner.free()
        cluster.free()
        return times

    for same_node, nodes in (
        (False, 2),
        (True, 1),
    ):  # (across nodes where there are two: the link that counts)
        times = _on_pair(world, node_of_rank, same_node, measure)
        if times is not NO_PAIR:
            return (times, bucket, nodes) if world.Get_rank() == 0 else None
    return None


def _overlap_share(cal, measured):
    """The share of what buckets could hide (the bucket model's) that the measured steps hid: the median of
    each turn's ``after backward - overlapped`` over the exchange (``after backward - alone``), against the
    model's ``(one bucket - these buckets) / one bucket``.  0 where nothing was measured, where the buckets
    could hide next to nothing, or where what was hidden is within the turns' noise: a machine that overlaps
    nothing must not be credited with its noise."""
    if measured is None:
        return 0.0
    times, bucket, nodes = measured
    late, early = np.asarray(times["after backward"]), np.asarray(times["overlapped"])
    exchange = float(np.median(late) - np.median(times["alone"]))
    gains = late - early
    gained = float(np.median(gains))
    # beyond noise: three standard errors of the median, and more turns gaining than losing by three standard
    # deviations of a fair coin's count (this machine's steps stretch at random, by more than the gain)
    noise = 3 * 1.2533 * float(np.std(gains)) / np.sqrt(len(gains))
    wins = int(np.sum(gains > 0)) - len(gains) / 2
    layout = Layout("allreduce", nodes, 2 // nodes, 2 * cal.batch_per_rank, exchange="mpi")
    if exchange <= 0 or gained <= noise or wins <= 1.5 * np.sqrt(len(gains)) or cal.link_for(layout) is None:
        return 0.0
    hidden, whole = hideable(cal, layout, bucket)
    could = hidden / whole if whole > 0 else 0.0
    return float(min(1.0, gained / exchange / could)) if could > 0.02 else 0.0


def _pair(world, node_of_rank, same_node):
    """The :class:`Link` between rank 0 and the next rank on its node (``same_node``) or on another node, as
    the collectives see it: an ``Allreduce`` of ``n`` bytes over the two, a ring's two steps of ``n / 2``,
    takes ``2 latency + n per_byte`` (sums and copies included); None where there is no such rank.  Every
    rank calls; two of them measure."""

    def measure(pair):
        seconds = []
        for size in SIZES:
            buffer = np.ones(size // 4, dtype=np.float32)
            trips = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                mpi.allreduce_sum(pair, buffer)
                trips.append(time.perf_counter() - start)
            seconds.append(float(np.median(trips[1:])))
        return seconds

    seconds = _on_pair(world, node_of_rank, same_node, measure)
    if seconds is NO_PAIR or world.Get_rank() != 0:
        return None
    whole = fit([4 * (size // 4) for size in SIZES], seconds)
    return Link(whole.latency / 2, whole.per_byte)
