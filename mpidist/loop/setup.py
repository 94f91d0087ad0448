"""What one rank builds before it trains: dataset, model, its shards, the strategy.

The checkpoint a run resumes from, and what the run takes from it, is
:mod:`mpidist.loop.resuming`'s; :func:`prepare` fits it to the model built here.

Everything here is local (no collectives) and may fail on bad input with a
:class:`~mpidist.runtime.errors.UsageError`, so the training loop runs it inside
:func:`mpidist.runtime.agreement.agreed`.  It is built again, for the survivors'
layout, when an elastic run loses workers (see :mod:`mpidist.loop.elastic`).
"""

import dataclasses
import os
import sys

import numpy as np

from .. import data, nn
from ..nn.precision import compute_dtype, master_dtype
from ..parallel import STRATEGIES
from ..parallel.recipe import recipe_for, total_steps
from ..runtime import comm as mpi
from ..runtime.errors import UsageError
from ..runtime.memory import human
from ..runtime.text import printable
from ..settings import models
from ..store import checkpoint
from ..runtime.agreement import agreed
from . import pricing, tensorboard
from .callbacks import EarlyStopping
from .judged import check_monitors, check_validation
from .resuming import find_resume, fit_to_model, resume_notes, resumed_buffer


@dataclasses.dataclass
class Inputs:
    """What a run trains: its model (a :class:`~mpidist.settings.models.ModelSource`) and its data.

    ``data`` is a dataset file's path, a bundled dataset's name, or an
    :class:`~mpidist.data.arrays.ArrayData`.
    """

    model: models.ModelSource
    data: object

    @classmethod
    def of(cls, config, model=None, data=None):
        """The inputs ``config`` names, or the objects given in Python in place of its strings."""
        return cls(
            models.resolve(config.model if model is None else model), config.data if data is None else data
        )


@dataclasses.dataclass
class Setup:
    """Everything the loop needs, built locally on each rank."""

    info: data.DatasetInfo
    model: nn.Sequential
    train: data.Shard  # None on ranks that read no training data (ps)
    test: data.Shard  # None on ranks that do not evaluate
    val: data.Shard  # the validation split (a val/ group, or --val-fraction's), evaluated each epoch; or None
    local_batch: int
    steps_per_epoch: int
    reading: data.Reading = None  # in memory or streamed, and why (the start-up table's data column)
    resume: checkpoint.Checkpoint = None
    skipped: list = dataclasses.field(default_factory=list)  # unreadable checkpoints passed over
    notes: list = dataclasses.field(default_factory=list)  # what the chief says about the set-up
    price: object = None  # what this rank will hold (:class:`~mpidist.runtime.price.Price`), checked
    prefetch: bool = True  # --shard parameters: two units in flight (False: one, where two do not fit)


def build_model_for(config, inputs, info, xp, cluster=None, training=True):
    """The model sized for dataset ``info``; a shape mismatch is a :class:`UsageError` naming the dataset.

    With ``cluster``, what this rank will hold under the run's layout must fit
    (:mod:`mpidist.parallel.holding`); without, the whole model's training
    state, or with ``training`` False nothing (the caller prices what it holds).
    """
    try:
        # (a map of shapes: the strategy makes the buffers of what this rank holds, the whole model's or a
        # part's)
        dtype = compute_dtype(config.precision, config.dtype)  # (--precision: the model computes in 16 bits)
        model = inputs.model.build(info.sample_shape, info.outputs, xp, dtype, buffers=False)
        check_outputs(model, info, inputs.model.spec)
        if training:
            pricing.check_holds(config, cluster, model)
        return model
    except UsageError as err:
        outputs = f"{info.num_classes:,} classes" if info.num_classes else f"{info.target_width} target(s)"
        raise UsageError(f"dataset {info.name!r} ({info.path}, {outputs}): {err}") from None


def check_outputs(model, info, spec):
    """Refuse a classifier whose outputs do not give one row of ``num_classes`` per label of a sample."""
    if not info.num_classes:
        return
    shape, labels = tuple(model.output_shape), info.target_shape
    if shape != labels + (info.num_classes,):
        per = f"{labels[0]} labels per sample (one per position)" if labels else "one label per sample"
        raise UsageError(
            f"the model ({printable(spec)}) outputs {shape} per sample, but the dataset has {per}, "
            f"of {info.num_classes:,} classes: it needs outputs {labels + (info.num_classes,)}"
        )


def data_layout(config, cluster):
    """``(data-parallel workers, this rank's index among them)``: whose shard this rank reads (the strategy
    says)."""
    return STRATEGIES[config.strategy].data_layout(config, cluster)


def agreed_setup(config, cluster, xp, inputs, outputs, callbacks=()):
    """Collective: :func:`prepare` this rank, and on the chief open ``outputs`` (with the user's
    ``callbacks`` and the run's own early stopping), agreed on by every rank: a refusal on any rank ends them
    all (:func:`~mpidist.runtime.agreement.agreed`), and what the chief opened for the run is taken back.
    Returns the :class:`Setup`, and the early stopping (None without ``--early-stop``)."""
    try:
        with agreed(cluster.world):
            if config.tensorboard:  # (imported before the price: its libraries are what the process holds)
                tensorboard.require()
            setup = prepare(config, cluster, xp, inputs, *find_resume(config))
            stopping = (
                EarlyStopping(config.early_stop, monitor=config.keep_best or "val_loss")
                if config.early_stop
                else None
            )
            check_monitors(callbacks, config, setup.info)
            outputs.open(config, list(callbacks) + ([stopping] if stopping else []), setup.resume)
    except SystemExit:  # (refused, here or on another rank)
        outputs.abandon()
        raise
    return in_one_layout(config, cluster, setup), stopping


def in_one_layout(config, cluster, setup):
    """Collective where the run may gather its units one at a time
    (:func:`~mpidist.loop.pricing.gathers_in_turn`): every rank takes the layout the most constrained one
    could afford (its gathers are collectives, called alike by every worker); a note says why where it is
    one unit in flight."""
    if not pricing.gathers_in_turn(config) or cluster.size == 1:
        return setup
    prefetch = np.array([int(setup.prefetch)], dtype=np.int64)
    mpi.allreduce_min(cluster.world, prefetch)
    if prefetch[0]:
        return setup
    largest = pricing.largest_unit_bytes(config, setup.model)
    note = (
        f"note: --shard parameters: two units in flight (the largest {human(largest)} of parameters, as "
        "much of gradients) do not fit in what a rank may hold: one unit of each at a time, each gathered "
        "as it is about to run (its gathers no longer overlap the compute)"
    )
    # (a rank that could have prefetched holds what the others' layout holds: its price says so)
    price = setup.price
    if setup.prefetch and price is not None:
        price = pricing.one_in_flight(config, cluster, setup.model, price)
    return dataclasses.replace(setup, prefetch=False, price=price, notes=[*setup.notes, note])


def prepare(config, cluster, xp, inputs, resume=None, skipped=(), priced=True):
    """Local set-up of one rank (no collectives) for ``inputs``, to start from ``resume`` (a checkpoint, or
    None); ``priced``: refuse a rank that cannot hold its price (:func:`mpidist.loop.pricing.check`; not
    for the survivors of a lost rank, who still hold the lost layout's memory)."""
    info = data.inspect(data.resolve(inputs.data), allow_external=config.allow_external)
    # (a resumed run's rows are its checkpoint's: drawn by the seed it continues with)
    if config.val_fraction:
        info = data.carve_validation(
            info, config.val_fraction, config.seed if resume is None else resume.seed
        )
    if config.eval_samples:
        info = data.limit_evaluation(info, config.eval_samples)
    check_validation(config, info)
    model = build_model_for(config, inputs, info, xp, cluster)
    notes = []
    if info.num_classes > info.sizes["train"]:
        notes.append(
            f"warning: dataset {info.name!r} declares {info.num_classes:,} classes but has "
            f"{info.sizes['train']:,} training samples: some classes have none (a wrong num_classes?)"
        )
    notes.extend(STRATEGIES[config.strategy].check_model(config, model))
    workers, worker = data_layout(config, cluster)
    running = strategy_class(config, workers)
    if model.running_entries() and not running.running_statistics:
        names = [name for name, cls in STRATEGIES.items() if cls.running_statistics]
        carried = ", ".join(names[:-1]) + " or " + names[-1]
        raise UsageError(
            f"--model {config.model} keeps running statistics (BatchNorm), which --strategy "
            f"{running.title(config)} cannot carry: its workers step independently; use {carried}, "
            "or LayerNorm"
        )
    in_graph = config.replication == "in-graph"
    if not in_graph and info.sizes["train"] < workers:
        raise UsageError(
            f"dataset {info.name!r} has {info.sizes['train']} training sample(s), fewer than the "
            f"{workers} workers: worker {info.sizes['train']} would have an empty shard"
        )
    # one sample of each of the global batch's lanes a step: n // B steps, in-graph or not, on any worker
    # count
    steps = data.steps_per_epoch(info.sizes["train"], config.batch_size, 1 if in_graph else workers)
    if steps == 0:
        raise UsageError(
            f"dataset {info.name!r} has {info.sizes['train']} training samples: too few for "
            f"--batch-size {config.batch_size} over {workers} workers"
        )
    dropped = data.left_out(info.sizes["train"], config.batch_size, 1 if in_graph else workers)
    if dropped is not None:
        notes.append(f"note: {dropped}")
    reads = _reads(config, cluster, info, worker, workers)
    lanes = (
        data.Lanes.of(config.batch_size, reads["train"][2], reads["train"][1]) if "train" in reads else None
    )
    # every rank sizes the data order's buffer alike, by the widest worker's lanes (a resumed run keeps its
    # own)
    widest = data.Lanes.of(config.batch_size, 1 if in_graph else workers, 0)
    order = data.order_buffer_for(
        config, info, model.input_shape, model.dtype, widest, resumed_buffer(resume)
    )
    reading = data.plan(
        config,
        info,
        [
            (
                split,
                lanes.rows(info.sizes[split]) if split == "train" else len(range(w, info.sizes[split], n)),
            )
            for split, w, n in reads.values()
        ],
        model.input_shape,
        model.dtype,
        lanes,
        order,
    )
    if order[2] and config.shuffle_buffer not in (0, order[0]):
        notes.append(
            f"note: --shuffle-buffer {config.shuffle_buffer:,} ignored: the resumed run's data order "
            f"keeps the buffer it started with, {order[0]:,} samples, so each sample is trained once an "
            "epoch (start a new run for another)"
        )
    # (a stream's buffer capped, chunks read in slices)
    notes.extend(f"note: {note}" for note in reading.notes)
    local_batch = data.local_batch_size(config.batch_size, workers, worker) if worker is not None else 0
    # every item this rank will hold, against what it may hold, before any of it is allocated
    price, prefetch = None, True
    if priced:  # (the survivors of a lost rank hold the lost layout's memory still: no price holds)
        run = pricing.Run(
            info,
            reading,
            reads,
            local_batch,
            min(config.steps or steps * config.epochs, steps * config.epochs),
            resume,
        )
        price, prefetch = pricing.priced(config, cluster, model, run, strategy_class(config, workers))
    shards = {
        split: reading.open(
            info, split, w, n, model.input_shape, model.dtype, lanes=lanes if split == "train" else None
        )
        for split, w, n in reads.values()
    }
    train, test, val = (shards.get(split) for split in ("train", "test", "val"))
    resume, fit_notes = fit_to_model(config, resume, info, model)
    notes.extend(fit_notes)
    smallest = config.batch_size // workers  # the smallest worker's share of a global batch
    if config.accumulate > smallest:
        raise UsageError(
            f"--accumulate {config.accumulate} cuts each worker's share of --batch-size "
            f"{config.batch_size} into slices, but {workers} workers get as few as {smallest} "
            f"sample(s) each: use --accumulate {max(smallest, 1)} or less, or a larger batch"
        )
    strategy_class(config, workers).check_slice(config, smallest // config.accumulate)
    notes.extend(resume_notes(config, resume, info, cluster))
    if train is not None:  # (a stream reads its first windows now, as a shard in memory was read whole above)
        epoch, at = (0, 0) if resume is None else (resume.epoch, resume.epoch_step)
        epoch, at = (epoch + 1, 0) if at >= steps else (epoch, at)
        if epoch < config.epochs:
            train.prime(config.seed if resume is None else resume.seed, epoch, at)
    return Setup(
        info=info,
        model=model,
        train=train,
        test=test,
        val=val,
        local_batch=local_batch,
        steps_per_epoch=steps,
        reading=reading,
        resume=resume,
        skipped=list(skipped),
        notes=notes,
        price=price,
        prefetch=prefetch,
    )


def _reads(config, cluster, info, worker, workers):
    """``{split: (split, worker, workers)}``: the part of each split this rank reads (none: not in the dict);
    of the training split, the lanes of that worker of that many."""
    evaluated = ("test", "val") if "val" in info.sizes else ("test",)
    if config.replication == "in-graph":  # the chief is the one client that reads samples
        return {split: (split, 0, 1) for split in ("train",) + evaluated} if cluster.is_chief else {}
    if worker is None:
        return {}
    reads = {"train": ("train", worker, workers)}
    if strategy_class(config, workers).evaluation == "sharded":
        reads.update({split: (split, worker, workers) for split in evaluated})
    elif cluster.is_chief:
        reads.update({split: (split, 0, 1) for split in evaluated})
    return reads


def strategy_class(config, workers):
    """The class that runs ``config.strategy`` with ``workers`` workers (a mode may have a class of its
    own)."""
    return STRATEGIES[config.strategy].variant(config, workers)


def make_strategy(config, setup, cluster, xp, where=None, figures=None):
    """The strategy ``config`` names, with an optimizer factory sized by the strategy."""

    def make_optimizer(size):
        return nn.make_optimizer(
            config.optimizer,
            size,
            config.lr,
            config.momentum,
            xp,
            master_dtype(setup.model.dtype),  # (a 16-bit model's optimizer updates its float32 master)
            weight_decay=config.weight_decay,
        )

    cls = strategy_class(config, cluster.num_workers)
    recipe = recipe_for(config, total_steps(config, setup), setup.steps_per_epoch)
    return cls(
        setup.model,
        nn.loss_for(setup.info.num_classes, xp),
        make_optimizer,
        cluster,
        seed=config.seed,
        bucket_bytes=int(config.bucket_mb * (1 << 20)),
        where=where,
        figures=figures,
        recipe=recipe,
        **cls.arguments(config, setup),
    )


def test_delay(worker):
    """``(seconds, last step)``: worker ``worker`` sleeps that long before each step up to that step of the
    run.

    ``MPIDIST_TEST_DELAY=WORKER:SECONDS[:LAST_STEP]``: ``WORKER`` is a worker index, or ``*`` for every
    worker; without ``LAST_STEP``, before every step.  For tests only (a deliberately slow worker, or a slow
    run to signal or kill a rank at a chosen step, then at full speed to the end); unset in real runs."""
    spec = os.environ.get("MPIDIST_TEST_DELAY", "")
    if not spec or worker is None:
        return 0.0, 0
    index, seconds, *last = spec.split(":")
    if index != "*" and int(index) != worker:
        return 0.0, 0
    return float(seconds), int(last[0]) if last else sys.maxsize


def layout_text(config, cluster):
    """How the ranks are used, in words (the strategy says)."""
    return STRATEGIES[config.strategy].layout_text(config, cluster)
