"""The training loop: ties a strategy, this worker's data, metrics and checkpoints.

Set-up that can fail on bad input (dataset, model shapes, checkpoint,
metrics file) runs inside :func:`mpidist.errors.agreed`, before any
collective, so every rank exits together with the same code.

The loop is the same on every rank: workers feed their batches, parameter
servers walk the same schedule with no data (they take part in each step's
collectives).  Only the chief writes metrics, checkpoints and the terminal.
"""

import dataclasses
import itertools
import os
import sys
import time

from . import checkpoint, data, nn
from .errors import UsageError, agreed
from .metrics import MetricsLog, Progress, format_summary
from .preempt import StepAgreement, StopSignals, settle, signal_name
from .parallel import STRATEGIES
from .parallel.backup import BackupWorkersStrategy


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


def build_model_for(config, info, xp):
    """The zoo model sized for ``info``; a shape mismatch is a :class:`UsageError`."""
    try:
        return nn.build_model(config.model, info.sample_shape, info.outputs, xp, config.dtype)
    except nn.ShapeError as err:
        raise UsageError(f"--model {config.model} does not fit dataset {info.name!r} ({info.path}): {err}") from None


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


def prepare(config, cluster, xp):
    """Local set-up of one rank (no collectives)."""
    info = data.inspect(data.resolve(config.data))
    model = build_model_for(config, info, xp)
    if config.strategy == "pipeline":
        parse_balance(config, model)
    workers, worker = data_layout(config, cluster)
    in_graph = config.replication == "in-graph"
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
    resume, skipped = find_resume(config)
    if resume is not None and resume.params.size != model.num_params:
        raise UsageError(f"--resume {resume.path}: holds {resume.params.size} parameters, but --model "
                         f"{config.model} on {info.name!r} has {model.num_params} "
                         f"(it was written by --model {resume.config.get('model')} on {resume.config.get('data')!r})")
    local_batch = data.local_batch_size(config.batch_size, workers, worker) if worker is not None else 0
    return Setup(info=info, model=model, train=train, test=test, local_batch=local_batch, steps_per_epoch=steps,
                 resume=resume, skipped=skipped)


def total_steps(config, setup):
    """Steps the run takes: epochs of the data, or fewer with ``--steps``."""
    steps = setup.steps_per_epoch * config.epochs
    return min(steps, config.steps) if config.steps else steps


def strategy_class(config, workers):
    """The class that runs ``config.strategy`` (backup workers are a ps-sync mode of their own)."""
    if config.strategy == "ps-sync" and 0 < config.aggregate < workers:
        return BackupWorkersStrategy
    return STRATEGIES[config.strategy]


def make_strategy(config, setup, cluster, xp):
    """The strategy ``config`` names, with an optimizer factory sized by the strategy."""
    def make_optimizer(size):
        return nn.make_optimizer(config.optimizer, size, config.lr, config.momentum, xp, setup.model.dtype)

    cls = strategy_class(config, cluster.num_workers)
    options = {}
    if config.strategy == "ps-async":
        options["staleness"] = None if config.staleness < 0 else config.staleness
    if cls is BackupWorkersStrategy:
        options.update(aggregate=config.aggregate, total_steps=total_steps(config, setup))
    if config.strategy == "pipeline":
        options.update(stages=config.stages, micro_batches=config.micro_batches, schedule_name=config.schedule,
                       balance=parse_balance(config, setup.model), global_batch=config.batch_size)
    return cls(setup.model, nn.loss_for(setup.info.num_classes, xp), make_optimizer, cluster, seed=config.seed,
               bucket_bytes=int(config.bucket_mb * (1 << 20)), **options)


def test_delay(worker):
    """Seconds worker ``worker`` sleeps before each step: ``MPIDIST_TEST_DELAY=WORKER:SECONDS``.

    For tests only (a deliberately slow worker); unset in real runs.
    """
    spec = os.environ.get("MPIDIST_TEST_DELAY", "")
    if not spec or worker is None:
        return 0.0
    index, seconds = spec.split(":")
    return float(seconds) if int(index) == worker else 0.0


def layout_text(config, cluster):
    """How the ranks are used, in words."""
    if config.strategy == "pipeline":
        return f"{config.stages} stages x {cluster.size // config.stages} replica(s) ({config.schedule}, " \
               f"{config.micro_batches} micro-batches)"
    return f"{cluster.num_workers} worker(s)" + (f" and {config.ps} ps" if config.ps else "")


class ServerControl:
    """What the ps ranks of ``ps-async`` and backup workers consult while they serve.

    Those workers are not in lockstep, so the train loop cannot agree on a
    step for them: a signal is passed on by the strategy, and mid-run
    checkpoints are decided and written by the first ps, which holds (or
    gathers) the whole state.  ``step`` here is the run's step: the chief's
    for ``ps-async``, the global version with backup workers.
    """

    def __init__(self, config, setup, signals, workers, start_step):
        self.config, self.setup, self.signals, self.workers = config, setup, signals, workers
        self.periodic = bool(config.checkpoint_dir and (config.checkpoint_every or config.checkpoint_seconds))
        self._last_step, self._timer = start_step, time.perf_counter()

    def signalled(self):
        return self.signals.received

    def checkpoint_due(self, step):
        """Whether ``step`` passed a multiple of ``--checkpoint-every``, or ``--checkpoint-seconds`` passed."""
        every, now = self.config.checkpoint_every, time.perf_counter()
        crossed = bool(every) and step // every > self._last_step // every
        timed = bool(self.config.checkpoint_seconds) and now - self._timer >= self.config.checkpoint_seconds
        self._last_step = step
        if crossed or timed:
            self._timer = now
        return crossed or timed

    def write(self, step, state):
        """First ps: write ``state`` as the checkpoint of ``step`` (its data position from the step)."""
        params, opt_state, opt_steps = state
        epoch, epoch_step = divmod(step, self.setup.steps_per_epoch)
        checkpoint.save(self.config.checkpoint_dir, params, opt_state, opt_steps, step, epoch, epoch_step,
                        self.config.to_json(), self.config.seed, self.workers)
        checkpoint.prune(self.config.checkpoint_dir, self.config.keep)


class _NoData:
    """The batches of a rank that reads no data: ``steps - skip`` empty ones."""

    def __init__(self, steps, skip):
        self._items = itertools.repeat((None, None), steps - skip)

    def __iter__(self):
        return self._items

    def close(self):
        pass


def run(config, cluster, xp, device_label, stream=sys.stdout):
    """Train as ``config`` says on this rank; returns the chief's final figures (others: None).

    A SIGTERM, SIGUSR1 or SIGINT on any rank stops every rank at the same
    step boundary, after a checkpoint; the figures then name the signal
    (``stopped_by``) and the CLI exits with EXIT_PREEMPTED.
    """
    with StopSignals() as signals:
        return _run(config, cluster, xp, device_label, stream, signals)


def _run(config, cluster, xp, device_label, stream, signals):
    chief = cluster.is_chief
    with agreed(cluster.world):
        setup = prepare(config, cluster, xp)
        log = MetricsLog(config.metrics if chief else "")
        if chief and config.checkpoint_dir:
            checkpoint.prepare_directory(config.checkpoint_dir)
    reseeded = setup.resume is not None and setup.resume.seed != config.seed
    if reseeded:   # the random streams continue where the checkpoint left them
        asked, config = config.seed, dataclasses.replace(config, seed=setup.resume.seed)

    strategy = make_strategy(config, setup, cluster, xp)
    shard = getattr(strategy, "shard_of", lambda rank: None)(cluster.rank)
    place = f" shard [{shard[0]}, {shard[1]})" if shard else ""
    if hasattr(strategy, "describe"):
        place = " " + strategy.describe(cluster.rank)
    table = cluster.table(device_label + place)
    resume = setup.resume
    strategy.initialize(resume)

    steps_to_run = total_steps(config, setup)
    delay = test_delay(cluster.worker_index)
    if chief:
        stream.write(f"mpidist: {setup.info.name} ({setup.info.sizes['train']} train / {setup.info.sizes['test']} "
                     f"test), model {config.model} ({setup.model.num_params:,} parameters), strategy "
                     f"{config.strategy} on {layout_text(config, cluster)}, global batch {config.batch_size}, "
                     f"{setup.steps_per_epoch} steps/epoch\n{table}\n")
        if hasattr(strategy, "imbalance"):
            stream.write(f"mpidist: parameter shards balanced to within {100 * strategy.imbalance:.2f}%\n")
        for path, reason in setup.skipped:
            stream.write(f"mpidist: warning: skipped unreadable checkpoint {path.name}: {reason}\n")
        if resume is not None:
            stream.write(f"mpidist: resumed from {resume.path} at step {resume.step}\n")
        if reseeded:
            stream.write(f"mpidist: note: --seed {asked} ignored: the checkpoint's data order and random "
                         f"streams continue with seed {config.seed}\n")
        stream.flush()
        log.write("start", config=dataclasses.asdict(config), ranks=cluster.size, workers=cluster.num_workers,
                  ps=config.ps, dataset=setup.info.name, params=setup.model.num_params,
                  steps_per_epoch=setup.steps_per_epoch,
                  resumed_from=None if resume is None else str(resume.path), step=0 if resume is None else resume.step)

    progress = Progress(config.progress if chief else "none", steps_to_run, config.epochs, stream=stream)
    weight = setup.local_batch / config.batch_size
    step = 0 if resume is None else resume.step
    start_epoch = 0 if resume is None else resume.epoch
    start_in_epoch = 0 if resume is None else resume.epoch_step
    if start_in_epoch >= setup.steps_per_epoch:
        start_epoch, start_in_epoch = start_epoch + 1, 0
    started = time.perf_counter()
    window_start, window_loss, window_steps, trained_steps = started, 0.0, 0, 0
    last_loss, result, evaluated_at = float("nan"), None, None
    saved_at, saved_path, timer = step, None, started   # a resumed run's checkpoint at `step` exists
    agreement = StepAgreement(cluster.world) if strategy.lockstep else None
    early = False   # this rank left the loop on a stop request

    def save(epoch, epoch_step):
        nonlocal saved_at, saved_path
        if not config.checkpoint_dir or (strategy.lockstep and saved_at == step):
            return   # (other strategies' ranks count steps apart: each call must be collective)
        state = strategy.state()  # collective: shards are gathered to the chief
        saved_at = step
        if chief:
            params, opt_state, opt_steps = state
            saved_path = checkpoint.save(config.checkpoint_dir, params, opt_state, opt_steps, step, epoch,
                                         epoch_step, config.to_json(), config.seed, data_layout(config, cluster)[0])
            checkpoint.prune(config.checkpoint_dir, config.keep)
            log.write("checkpoint", step=step, epoch=epoch + 1, path=str(saved_path))

    def timed_checkpoint_due():
        """Chief only: ``--checkpoint-seconds`` have passed since the last one was asked for."""
        nonlocal timer
        if not (chief and config.checkpoint_seconds) or time.perf_counter() - timer < config.checkpoint_seconds:
            return False
        timer = time.perf_counter()
        return True

    def evaluate(epoch):
        nonlocal result, evaluated_at
        test_loss, accuracy, _ = strategy.evaluate(data.eval_batches(setup.test) if setup.test else [])
        result, evaluated_at = (test_loss, accuracy), step
        progress.evaluated(step, epoch, last_loss, test_loss, accuracy)
        log.write("eval", step=step, epoch=epoch + 1, test_loss=test_loss, test_accuracy=accuracy)

    epoch, epoch_step = start_epoch, start_in_epoch
    stop = bool(config.steps and step >= config.steps)
    if getattr(strategy, "serves", False):   # ps-async ps ranks: serve until the workers are done
        strategy.serve(ServerControl(config, setup, signals, data_layout(config, cluster)[0], step))
        stop = True
    for epoch in range(start_epoch, config.epochs if not stop else start_epoch):
        skip = start_in_epoch if epoch == start_epoch else 0
        if config.replication == "in-graph" and cluster.worker_index is not None:
            source = None
            if chief:
                source = data.global_batches(setup.train, config.batch_size, setup.steps_per_epoch, config.seed,
                                             epoch, skip=skip)
            y_shape, y_dtype = ((), "int64") if setup.info.num_classes else ((setup.info.target_width,),
                                                                                setup.model.dtype)
            batches = data.ScatteredBatches(cluster.workers, source, config.batch_size, setup.model.input_shape,
                                            y_shape, setup.model.dtype, y_dtype, setup.steps_per_epoch - skip)
        elif setup.train is None:
            batches = _NoData(setup.steps_per_epoch, skip)
        else:
            batches = data.train_batches(setup.train, setup.local_batch, setup.steps_per_epoch, config.seed, epoch,
                                         data_layout(config, cluster)[1], skip=skip)
        epoch_step = skip
        try:
            for x, y in batches:
                if x is not None:
                    x, y = xp.asarray(x), xp.asarray(y)
                if delay:
                    time.sleep(delay)
                loss = strategy.train_step(x, y, weight, step)
                step, epoch_step, trained_steps = step + 1, epoch_step + 1, trained_steps + 1
                if hasattr(strategy, "version"):   # backup workers: the ps counts the global steps
                    step = strategy.version
                window_loss, window_steps = window_loss + loss, window_steps + 1
                if step % config.log_every == 0:
                    now = time.perf_counter()
                    rate = window_steps * config.batch_size / (now - window_start)
                    last_loss = window_loss / window_steps
                    log.write("step", step=step, epoch=epoch + 1, loss=last_loss, samples_per_s=rate,
                              time=now - started)
                    progress.update(step, epoch, last_loss, rate)
                    window_start, window_loss, window_steps = now, 0.0, 0
                if agreement:
                    flags = agreement.boundary(signals.received, timed_checkpoint_due())
                    early = bool(flags["signal"]) and step < steps_to_run
                    if (config.checkpoint_every and step % config.checkpoint_every == 0) or flags["due"] or early:
                        save(epoch, epoch_step)
                else:   # the strategy carries the request to the others; the checkpoint comes after finish()
                    if signals.received:
                        strategy.request_stop(signals.received)
                    early = strategy.stop_requested and step < steps_to_run
                if early or (config.steps and step >= config.steps) or getattr(strategy, "finished", False):
                    stop = True
                    break
        finally:
            batches.close()
        if window_steps:
            last_loss = window_loss / window_steps
        if stop:  # before the loop moves `epoch` on: the checkpoint must name this epoch
            break
        if config.eval_every and (epoch + 1) % config.eval_every == 0:
            evaluate(epoch)

    if agreement:
        agreement.close()
    strategy.finish()
    flags = settle(cluster.world, signals.received, early)
    stopped = flags if flags["signal"] and flags["early"] else {}
    elapsed = time.perf_counter() - started
    if not stopped and (evaluated_at != step or result is None):   # a stopping job has no time to spare
        evaluate(epoch)
    save(epoch, epoch_step)
    roles = cluster.world.gather((cluster.rank, cluster.role, strategy.stats()), root=cluster.chief_rank)
    strategy.close()
    if not chief:
        return {"stopped_by": signal_name(stopped["signal"])} if stopped else None
    if stopped:
        return _report_stop(stopped, step, epoch, saved_path, config, log, stream)
    test_loss, accuracy = result
    samples_per_s = trained_steps * config.batch_size / elapsed if elapsed > 0 else 0.0
    final = {"steps": step, "epochs": epoch + 1, "loss": last_loss, "test_loss": test_loss,
             "test_accuracy": accuracy, "train_time": elapsed, "samples_per_s": samples_per_s,
             "workers": cluster.num_workers, "ps": config.ps, "strategy": config.strategy,
             "roles": [{"rank": rank, "role": role, **stats} for rank, role, stats in roles if stats]}
    log.write("done", **final)
    log.close()
    rows = [("dataset", f"{setup.info.name} ({setup.info.path})"), ("model", config.model),
            ("strategy", f"{config.strategy} on {layout_text(config, cluster)}"),
            ("steps", f"{step} ({epoch + 1} epochs)"), ("final train loss", f"{last_loss:.4f}"),
            ("test loss", f"{test_loss:.4f}"), ("test accuracy", f"{100 * accuracy:.2f}%"),
            ("training time", f"{elapsed:.2f} s"), ("throughput", f"{samples_per_s:,.0f} samples/s")]
    if config.metrics:
        rows.append(("metrics", config.metrics))
    if config.checkpoint_dir:
        rows.append(("checkpoints", config.checkpoint_dir))
    stream.write("mpidist: done\n" + format_summary(rows) + "\n")
    stream.flush()
    return final


def _report_stop(flags, step, epoch, saved_path, config, log, stream):
    """Chief: say which signal stopped the run, and where to resume from."""
    name = signal_name(flags["signal"])
    log.write("stopped", step=step, epoch=epoch + 1, signal=name, rank=flags["rank"] - 1,
              checkpoint=None if saved_path is None else str(saved_path))
    log.close()
    if saved_path is not None:
        where = f"checkpoint {saved_path} written; continue with --resume auto --checkpoint-dir {config.checkpoint_dir}"
    else:
        where = "no checkpoint written (no --checkpoint-dir): the work done is lost"
    stream.write(f"mpidist: stopped by {name} (rank {flags['rank'] - 1}) at step {step}: {where}\n")
    stream.flush()
    return {"steps": step, "epochs": epoch + 1, "stopped_by": name, "checkpoint": saved_path}
