"""What one rank builds before it trains: dataset, model, its shards, the strategy.

Everything here is local (no collectives) and may fail on bad input with a
:class:`~mpidist.errors.UsageError`, so the training loop runs it inside
:func:`mpidist.errors.agreed`.  It is built again, for the survivors'
layout, when an elastic run loses workers (see :mod:`mpidist.elastic`).
"""

import dataclasses
import os

from . import checkpoint, data, models, nn
from .errors import UsageError
from .parallel import STRATEGIES
from .parallel.backup import BackupWorkersStrategy


@dataclasses.dataclass
class Inputs:
    """What a run trains: its model (a :class:`~mpidist.models.ModelSource`) and its data.

    ``data`` is a dataset file's path, a bundled dataset's name, or an
    :class:`~mpidist.arrays.ArrayData`.
    """

    model: models.ModelSource
    data: object

    @classmethod
    def of(cls, config, model=None, data=None):
        """The inputs ``config`` names, or the objects given in Python in place of its strings."""
        return cls(models.resolve(config.model if model is None else model), config.data if data is None else data)


@dataclasses.dataclass
class Setup:
    """Everything the loop needs, built locally on each rank."""

    info: data.DatasetInfo
    model: nn.Sequential
    train: data.Shard       # None on ranks that read no training data (ps)
    test: data.Shard        # None on ranks that do not evaluate
    local_batch: int
    steps_per_epoch: int
    resume: checkpoint.Checkpoint = None
    skipped: list = dataclasses.field(default_factory=list)   # unreadable checkpoints passed over


def build_model_for(config, inputs, info, xp):
    """The model sized for dataset ``info``; a shape mismatch is a :class:`UsageError` naming the dataset."""
    try:
        return inputs.model.build(info.sample_shape, info.outputs, xp, config.dtype)
    except UsageError as err:
        raise UsageError(f"dataset {info.name!r} ({info.path}): {err}") from None


def find_resume(config):
    """``(checkpoint --resume names or None, [(path, reason) of unreadable newer ones skipped])``."""
    if not config.resume:
        return None, []
    if config.resume == "auto":
        return checkpoint.newest_valid(config.checkpoint_dir)   # empty directory: start afresh
    return checkpoint.load(config.resume), []


def data_layout(config, cluster):
    """``(data-parallel workers, this rank's index among them)``: whose shard this rank reads.

    A pipeline's ``P`` stages of one replica read the same shard (the first
    stage uses its samples, the last its labels).
    """
    if config.strategy == "pipeline":
        return cluster.size // config.stages, cluster.rank // config.stages
    return cluster.num_workers, cluster.worker_index


def parse_balance(config, model):
    """``--balance`` as layers per stage, checked against the model; None to balance by parameters."""
    names = ", ".join(repr(layer) for layer in model.layers)
    if len(model.layers) < config.stages:
        raise UsageError(f"--stages {config.stages} needs at least {config.stages} layers, but --model "
                         f"{config.model} has {len(model.layers)}: {names}")
    if not config.balance:
        return None
    try:
        sizes = [int(part) for part in config.balance.split(",")]
    except ValueError:
        raise UsageError(f"--balance {config.balance!r}: give layers per stage as integers, e.g. 3,3") from None
    if len(sizes) != config.stages or sum(sizes) != len(model.layers) or min(sizes) < 1:
        raise UsageError(f"--balance {config.balance} gives {len(sizes)} stages with {sum(sizes)} layers, but "
                         f"--stages is {config.stages} and --model {config.model} has {len(model.layers)} layers "
                         f"({names}); each stage needs at least one")
    return sizes


def prepare(config, cluster, xp, inputs, resume=None, skipped=()):
    """Local set-up of one rank (no collectives) for ``inputs``, to start from ``resume`` (a checkpoint, or None)."""
    info = data.inspect(data.resolve(inputs.data))
    model = build_model_for(config, inputs, info, xp)
    if config.strategy == "pipeline":
        parse_balance(config, model)
    workers, worker = data_layout(config, cluster)
    if model.running_entries() and not strategy_class(config, workers).running_statistics:
        raise UsageError(f"--model {config.model} keeps running statistics (BatchNorm), which --strategy "
                         f"{config.strategy}{' with --aggregate' if config.aggregate else ''} cannot carry: its "
                         "workers step independently; use allreduce, ps-sync or pipeline, or LayerNorm")
    in_graph = config.replication == "in-graph"
    if not in_graph and info.sizes["train"] < workers:
        raise UsageError(f"dataset {info.name!r} has {info.sizes['train']} training sample(s), fewer than the "
                         f"{workers} workers: worker {info.sizes['train']} would have an empty shard")
    # in-graph: global batches come from one reader, so an epoch is the whole split's worth of them
    steps = data.steps_per_epoch(info.sizes["train"], config.batch_size, workers)
    if in_graph:
        steps = data.steps_per_epoch(info.sizes["train"], config.batch_size, 1)
    if steps == 0:
        raise UsageError(f"dataset {info.name!r} has {info.sizes['train']} training samples: too few for "
                         f"--batch-size {config.batch_size} over {workers} workers")
    train = test = None
    if in_graph:
        if cluster.is_chief:  # the one client that reads samples
            train, test = (data.Shard(info, split, 0, 1, model.input_shape, model.dtype) for split in data.SPLITS)
    elif worker is not None:
        train = data.Shard(info, "train", worker, workers, model.input_shape, model.dtype)
        if strategy_class(config, workers).evaluation == "sharded":
            test = data.Shard(info, "test", worker, workers, model.input_shape, model.dtype)
        elif cluster.is_chief:
            test = data.Shard(info, "test", 0, 1, model.input_shape, model.dtype)
    if resume is not None and resume.params.size != model.num_params:
        raise UsageError(f"--resume {resume.path}: holds {resume.params.size} parameters, but --model "
                         f"{config.model} on {info.name!r} has {model.num_params} "
                         f"(it was written by --model {resume.config.get('model')} on {resume.config.get('data')!r})")
    local_batch = data.local_batch_size(config.batch_size, workers, worker) if worker is not None else 0
    return Setup(info=info, model=model, train=train, test=test, local_batch=local_batch, steps_per_epoch=steps,
                 resume=resume, skipped=list(skipped))


def total_steps(config, setup):
    """Steps the run takes: epochs of the data, or fewer with ``--steps``."""
    steps = setup.steps_per_epoch * config.epochs
    return min(steps, config.steps) if config.steps else steps


def strategy_class(config, workers):
    """The class that runs ``config.strategy`` (backup workers are a ps-sync mode of their own)."""
    if config.strategy == "ps-sync" and 0 < config.aggregate < workers:
        return BackupWorkersStrategy
    return STRATEGIES[config.strategy]


def make_strategy(config, setup, cluster, xp, where=None):
    """The strategy ``config`` names, with an optimizer factory sized by the strategy."""
    def make_optimizer(size):
        return nn.make_optimizer(config.optimizer, size, config.lr, config.momentum, xp, setup.model.dtype)

    cls = strategy_class(config, cluster.num_workers)
    options = {}
    if config.strategy == "ps-async":
        options.update(staleness=None if config.staleness < 0 else config.staleness, nan_patience=config.nan_patience,
                       elastic=config.elastic)
    if cls.name == "ps-sync" and cls is not BackupWorkersStrategy:
        options.update(elastic=config.elastic)
    if cls is BackupWorkersStrategy:
        options.update(aggregate=config.aggregate, total_steps=total_steps(config, setup),
                       nan_patience=config.nan_patience)
    if config.strategy == "pipeline":
        options.update(stages=config.stages, micro_batches=config.micro_batches, schedule_name=config.schedule,
                       balance=parse_balance(config, setup.model), global_batch=config.batch_size)
    return cls(setup.model, nn.loss_for(setup.info.num_classes, xp), make_optimizer, cluster, seed=config.seed,
               bucket_bytes=int(config.bucket_mb * (1 << 20)), where=where, **options)


def test_delay(worker):
    """Seconds worker ``worker`` sleeps before each step: ``MPIDIST_TEST_DELAY=WORKER:SECONDS``.

    ``WORKER`` is a worker index, or ``*`` for every worker.  For tests only
    (a deliberately slow worker, or a slow run to signal midway); unset in real runs.
    """
    spec = os.environ.get("MPIDIST_TEST_DELAY", "")
    if not spec or worker is None:
        return 0.0
    index, seconds = spec.split(":")
    return float(seconds) if index == "*" or int(index) == worker else 0.0


def layout_text(config, cluster):
    """How the ranks are used, in words."""
    if config.strategy == "pipeline":
        return f"{config.stages} stages x {cluster.size // config.stages} replica(s) ({config.schedule}, " \
               f"{config.micro_batches} micro-batches)"
    return f"{cluster.num_workers} worker(s)" + (f" and {config.ps} ps" if config.ps else "")
