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
far apart their steps end (:func:`~mpidist.plan.pairs.crowding`), and run
``allreduce --exchange mpi`` with its buckets reduced during backward and
after it, to measure how much of the exchange backward hides
(:func:`~mpidist.plan.pairs.overlap_times`).
One-stage pipelines of 1 and 8 micro-batches give a micro-batch's own cost.

This module holds the whole measurement's order and rank 0's figures of the
model and the run; how a pass is timed is :mod:`~mpidist.plan.pass_times`,
what two ranks measure together :mod:`~mpidist.plan.pairs`.
"""

import dataclasses
import os

import numpy as np

from .. import data, nn
from ..bench.timing import release, sleep_until_released
from ..loop.setup import Inputs, build_model_for
from ..nn.tensor import TensorSum, operators, split_model
from ..parallel import LocalStrategy
from ..runtime.cluster import node_layout
from ..runtime.memory import available_bytes, high_water, peak_memory, reset_high_water
from .calibration import Calibration, LayerCost
from .pairs import crowding, measured_link, overlap_share, overlap_times
from .pass_times import REPEATS, layer_lines, median_seconds, scaled, whole_line
from .layout import Layout
from .step import predict


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
    within = measured_link(world, node_of_rank, same_node=True)
    between = measured_link(world, node_of_rank, same_node=False)
    trainer = trainer or _Trainer(config)
    crowdings, spreads = zip(
        *[crowding(world, node_of_rank, same, trainer, seconds) or (None, None) for same in (True, False)]
    )
    overlap = overlap_times(world, node_of_rank, config, trainer, seconds)
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
        node_crowding=crowdings[0],
        network_crowding=crowdings[1],
        ranks_per_node=max(node_of_rank.count(n) for n in set(node_of_rank)),
        cores=len(os.sched_getaffinity(0)),
        node_memory_bytes=baseline * world.Get_size() + (available_bytes() or 0),
    )
    # what a rank holds besides the arrays the model counts: the one-process run's peak less its arrays
    arrays = predict(made, Layout("local", 1, 1, made.batch_per_rank)).memory
    return dataclasses.replace(
        made, baseline_bytes=max(baseline, peak - arrays), overlap=overlap_share(made, overlap)
    )


class _Trainer:
    """``config``'s model on a batch of its training rows, ready to train: ``step()`` is one ``local``
    step."""

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

        def make(size):
            return nn.make_optimizer(config.optimizer, size, config.lr, xp=np, dtype=model.dtype)

        self.make = make
        self.local = LocalStrategy(model, self.loss, self.make, seed=config.seed)
        self.local.initialize()  # (first: passes then run in the workspace training uses, as fast as there)
        self.steps = iter(range(1 << 30))

    def step(self):
        self.local.train_step(self.x, self.y, 1.0, next(self.steps))


def _read_overhead(config, info, model):
    """Bytes reading one worker's lanes of the training split in memory (worker 0 of 2) takes at its peak
    above what it then holds: the blocks and chunks the file is read in (0 where the peak cannot be started
    over)."""
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
    forward, backward, losses = scaled(
        *layer_lines(model, loss, x, y, sizes, seconds), whole_line(model, loss, x, y, sizes, seconds)
    )
    step, times = median_seconds(trainer.step, max(REPEATS, int(seconds / 0.01)) if seconds else REPEATS)
    overhead = max(0.0, batch / rate - step) if rate > 0 else 0.0
    layers_s = (
        sum(f[0] + f[1] * batch + b[0] + b[1] * batch for f, b in zip(forward, backward))
        + losses[0]
        + losses[1] * batch
    )
    params = max(1, model.num_params)
    buffer = np.ones(max(params, 1 << 20), dtype=model.dtype)
    other = buffer.copy()
    summed, _ = median_seconds(lambda: np.add(buffer, other, out=buffer))
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
    """``(samples/s, peak resident bytes)`` of ``steps`` steps of ``train`` on one process (with
    ``strategy``'s settings), with a run directory's metrics (in a scratch one, removed after), as users run
    it."""
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
