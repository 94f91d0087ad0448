"""The training loop: ties a strategy, this worker's data, metrics and checkpoints.

Set-up that can fail on bad input (dataset, model shapes, checkpoint,
metrics file) runs inside :func:`mpidist.runtime.agreement.agreed`, before any
collective, so every rank exits together with the same code.

The loop is the same on every rank: workers feed their batches, parameter
servers walk the same schedule with no data (they take part in each step's
collectives).  Only the chief writes metrics, checkpoints and the terminal.
"""

import dataclasses
import itertools
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..store import checkpoint, lineage, rundir
from .. import data
from . import elastic, tensorboard
from ..runtime import recorder
from ..nn import scores
from ..observe import trace
from .setup import data_layout, find_resume, layout_text, make_strategy, prepare, test_delay
from ..parallel.recipe import total_steps
from ..parallel.scatter import ScatteredBatches
from ..runtime.agreement import agreed
from ..runtime.errors import error_line
from .callbacks import EarlyStopping, Reporter, lower_is_better
from ..runtime.comm import bcast
from .checkpointer import Checkpointer
from .metrics import MetricsLog, Progress, format_summary
from ..runtime.memory import peak_memory
from ..runtime.preempt import EARLY_STOP, WRITE_FAILED, StepAgreement, settle, signal_name, stop_signals
from ..observe.stall import StallMonitor
from ..runtime.whereabouts import here

TRACER = recorder.tracer()


class ServerControl:
    """What the ps ranks of ``ps-async`` and backup workers consult while they serve.

    Those workers are not in lockstep, so the train loop cannot agree on a
    step for them: a signal is passed on by the strategy, and mid-run
    checkpoints are decided and written by the first ps, which holds (or
    gathers) the whole state.  ``step`` here is the run's step: the chief's
    for ``ps-async``, the global version with backup workers.
    """

    def __init__(self, config, setup, signals, workers, start_step, lineages):
        self.setup, self.signals, self.workers = setup, signals, workers
        self.checkpointer = Checkpointer(config, start_step, *lineages,
                                         elapsed=setup.resume.elapsed if setup.resume is not None else 0.0)
        self.periodic = self.checkpointer.enabled and self.checkpointer.schedule.periodic

    def signalled(self):
        return self.signals.received

    def checkpoint_due(self, step):
        """Whether a checkpoint is due at ``step`` (the rule the training loop follows too)."""
        return self.checkpointer.schedule.due(step, self.checkpointer.clock())

    def write(self, step, state):
        """First ps: write ``state`` as the checkpoint of ``step`` (its data position from the step)."""
        epoch, epoch_step = divmod(step, self.setup.steps_per_epoch)
        self.checkpointer.write(state, step, epoch, epoch_step, self.workers)


class BestSoFar:
    """The best value of a validation figure so far (``--keep-best``): lower is better for losses and errors."""

    def __init__(self, figure, stored=None):
        self.figure = figure
        self.lower = lower_is_better(figure)   # (the rule --early-stop follows too)
        self.value, self.step = None, None
        if stored and stored.get("figure") == figure:   # a resumed run's checkpoint: the best it had seen
            self.value, self.step = stored["value"], stored["step"]

    def record(self):
        """What a checkpoint stores of it (None before the first value, or without ``--keep-best``)."""
        if not self.figure or self.value is None:
            return None
        return {"figure": self.figure, "value": self.value, "step": self.step}

    def offer(self, value, step):
        """Whether ``value`` (at ``step``) beats the best so far; it becomes the best if so.  NaN never does."""
        if not math.isfinite(value):
            return False
        if self.value is not None and (value >= self.value if self.lower else value <= self.value):
            return False
        self.value, self.step = value, step
        return True


class _NoData:
    """The batches of a rank that reads no data: ``steps - skip`` empty ones."""

    def __init__(self, steps, skip):
        self._items = itertools.repeat((None, None), steps - skip)

    def __iter__(self):
        return self._items

    def close(self):
        pass


def trace_file(config, resume):
    """Where ``--trace`` writes: the run directory's trace.json, or ``trace-from-step-N.json`` beside an earlier part's."""
    path = Path(config.run_dir or ".") / rundir.TRACE
    if resume is not None and path.exists():
        path = path.with_name(f"trace-from-step-{resume.step}.json")
    return path


def run(config, cluster, xp, device_label, inputs, callbacks=(), stream=sys.stdout):
    """Train ``inputs`` (:class:`~mpidist.loop.setup.Inputs`) as ``config`` says on this rank; returns the outcome.

    The outcome is a dict: the final figures on the chief, with ``params``
    (the trained flat parameters, host memory) where the run was not diverged.
    ``callbacks`` (:class:`~mpidist.loop.callbacks.Callback`) are called on the chief.

    A SIGTERM, SIGUSR1 or SIGINT on any rank stops every rank at the same
    step boundary, after a checkpoint; the outcome then names the signal
    (``stopped_by``) and the CLI exits with EXIT_PREEMPTED.  A run that
    diverged (``--nan-patience``) has ``failed`` set, and the CLI exits 1.
    """
    with stop_signals() as signals:
        training = Training(config, cluster, xp, device_label, stream, signals, inputs, callbacks)
        try:
            training.start()
            return elastic.run_with_recovery(training)
        finally:
            training.release()


class Training:
    """One training run on this rank: set-up, the loop, and the end.

    The position (``step``, ``epoch``, ``epoch_step``) and the figures live
    on the object, so the loop can be entered again from where it left.
    """

    def __init__(self, config, cluster, xp, device_label, stream, signals, inputs, callbacks=()):
        self.config, self.cluster, self.xp, self.device_label = config, cluster, xp, device_label
        self.stream, self.signals, self.inputs, self.callbacks = stream, signals, inputs, list(callbacks)
        self.diverged = None   # the message, once --nan-patience ran out
        self.agreement = None  # lockstep strategies: the step agreement of the current loop
        self.recoveries = []   # --elastic: each loss survived ("recovered" events)
        self.where = here()          # what the stall watches report (--stall-timeout)
        self.figures = {}            # what the strategies count (their stats()): outlives a recovery
        self.claim = None            # the chief's hold on --checkpoint-dir: its lock, this run's lineage
        self.log_copy = None         # the chief's output copied to the run directory's log.txt
        self.board = None            # --tensorboard: the chief's event-file writer

    @property
    def chief(self):
        return self.cluster.is_chief

    # -- set-up --------------------------------------------------------------------------------------------
    def start(self):
        """Agreed local set-up, the strategy, its initial state, the header; the position to start from."""
        config, cluster = self.config, self.cluster
        self.where.enter("setup", 0)
        with agreed(cluster.world):
            self.setup = prepare(config, cluster, self.xp, self.inputs, *find_resume(config))
            self.early_stopping = EarlyStopping(config.early_stop, monitor=config.keep_best or "val_loss") \
                if config.early_stop else None
            own = [self.early_stopping] if self.early_stopping else []
            if config.tensorboard:
                tensorboard.require()   # on every rank: without the package, all exit with its name (code 2)
                if self.chief:
                    self.board = tensorboard.TensorBoard(config.run_dir or os.path.dirname(config.metrics) or ".")
                    own.append(self.board)
            self.log = Reporter(MetricsLog(config.metrics if self.chief else ""), self.callbacks + own, self.chief)
            if self.chief:
                if config.run_dir:
                    self.log_copy = self.stream = rundir.LogCopy(self.stream, Path(config.run_dir) / rundir.LOG)
                if config.trace != "off":
                    trace.check_writable(trace_file(config, self.setup.resume))
                if config.checkpoint_dir:
                    checkpoint.prepare_directory(config.checkpoint_dir)
                self.claim = lineage.claim(config, self.setup.resume)
        self.where.enter("start")   # collectives from here on: a wait on the others
        if self.chief and config.run_dir:   # once every rank's checks passed: a refused run changes nothing
            rundir.write_settings(config, config.run_dir)
        self.lineages = self._share_lineage()
        self.trace_offset, self.trace_path = 0.0, None
        if config.trace != "off":    # (from here: the set-up's files and checks are not on the timeline)
            TRACER.enable(detail=config.trace == "detail")
            self.trace_offset = trace.clock_offset(cluster.world, cluster.chief_rank)
        setup, resume = self.setup, self.setup.resume
        reseeded = resume is not None and resume.seed != config.seed
        if reseeded:   # the random streams continue where the checkpoint left them
            asked, config = config.seed, dataclasses.replace(config, seed=resume.seed)
            self.config = config
        self._make_strategy()
        table = cluster.table(self.device_label + self._place(), setup.reading.why if setup.reading else "")
        self.strategy.initialize(resume)
        if self.chief:
            self.say(f"mpidist: {setup.info.name} ({setup.info.sizes['train']} train / {setup.info.sizes['test']} "
                      f"test), model {config.model} ({setup.model.num_params:,} parameters), strategy "
                      f"{config.strategy} on {layout_text(config, cluster)}, global batch {config.batch_size}, "
                      f"{setup.steps_per_epoch} steps/epoch\n{table}")
            if self.strategy.imbalance is not None:
                self.say(f"mpidist: parameter shards balanced to within {100 * self.strategy.imbalance:.2f}%")
            for path, reason in setup.skipped:
                self.say(f"mpidist: warning: skipped unreadable checkpoint {path.name}: {reason}")
            for note in setup.notes + self.claim.notes:
                self.say(f"mpidist: {note}")
            if resume is not None:
                self.say(f"mpidist: resumed from {resume.path} at step {resume.step}")
            if config.stall_timeout and cluster.size > 1 and not self.monitor.active:
                self.say("mpidist: warning: --stall-timeout needs MPI_THREAD_MULTIPLE, which this MPI does not "
                          "give: a hang will not be diagnosed")
            if reseeded:
                self.say(f"mpidist: note: --seed {asked} ignored: the checkpoint's data order and random "
                          f"streams continue with seed {config.seed}")
            self.log.write("start", config=dataclasses.asdict(config), ranks=cluster.size,
                           workers=cluster.num_workers, ps=config.ps, dataset=setup.info.name,
                           params=setup.model.num_params, steps_per_epoch=setup.steps_per_epoch,
                           resumed_from=None if resume is None else str(resume.path),
                           step=0 if resume is None else resume.step)
        self.progress = Progress(config.progress if self.chief else "none", total_steps(config, setup),
                                 config.epochs, stream=self.stream, start_step=0 if resume is None else resume.step)
        self.started = time.perf_counter()
        # (its clock is the run's: the metrics' time goes on from a resumed checkpoint's)
        self.checkpointer = Checkpointer(config, 0 if resume is None else resume.step, *self.lineages,
                                         elapsed=0.0 if resume is None else resume.elapsed)
        self.window_start, self.window_loss, self.window_steps, self.window_good = self.started, 0.0, 0, 0
        self.trained_steps, self.skipped_in_row = 0, 0
        self.window_clipped = self.clipped_steps = 0   # steps clipped to --clip-norm (where the chief knows it)
        self.last_loss, self.result, self.evaluated_at = math.nan, None, None
        self.val_result = self.validated_at = None
        self.best = BestSoFar(config.keep_best, resume.best if resume is not None else None)
        if self.early_stopping is not None and self.best.value is not None:
            self.early_stopping.best = self.best.value   # a resumed run judges against the best so far, not afresh
        self._move_to(resume)

    def _share_lineage(self):
        """Collective: ``(lineage, parent)`` the chief settled, on every rank (the first ps of ps-async writes too)."""
        codes = np.full(2, -1, dtype=np.int64)
        if self.chief:
            codes[:] = [int(self.claim.lineage, 16) if self.claim.lineage else -1,
                        int(self.claim.parent, 16) if self.claim.parent else -1]
        bcast(self.cluster.world, codes, root=self.cluster.chief_rank)
        return tuple(f"{int(code):08x}" if code >= 0 else "" for code in codes)

    def release(self):
        """Let go of ``--checkpoint-dir`` (the chief's lock): the run writes no more."""
        if self.claim is not None:
            self.claim.release()
        if getattr(self, "progress", None) is not None:
            self.progress.close()
        if self.log_copy is not None:
            self.log_copy.close()
        if self.board is not None:
            self.board.close()

    def _make_strategy(self):
        """Collective: the strategy for the current cluster and set-up, watched by a new stall monitor."""
        self.strategy = make_strategy(self.config, self.setup, self.cluster, self.xp, where=self.where,
                                      figures=self.figures)
        self.monitor = StallMonitor(self.cluster.world, self.cluster.chief_rank, self.config.stall_timeout,
                                    self.where).start()

    def _place(self):
        """This rank's part in the role table beyond its device: a ps shard or a pipeline stage."""
        text = self.strategy.describe(self.cluster.rank)
        return " " + text if text else ""

    def _move_to(self, resume, on_disk=True):
        """Set the position to ``resume``'s (or the beginning); ``on_disk``: a checkpoint of it exists already."""
        self.step = 0 if resume is None else resume.step
        self.epoch = 0 if resume is None else resume.epoch
        self.epoch_step = 0 if resume is None else resume.epoch_step
        if self.epoch_step >= self.setup.steps_per_epoch:
            self.epoch, self.epoch_step = self.epoch + 1, 0
        self.saved_at = self.step if on_disk else None   # save() writes each step once

    def say(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()

    # -- the loop ------------------------------------------------------------------------------------------
    def run_to_end(self):
        """The loop from the current position, then the end (evaluation, checkpoint, report): the outcome."""
        # NaN and overflow are detected and handled (--nan-patience): numpy need not warn on every rank
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            self.train()
        return self.conclude()

    def continue_from(self, cluster, resume):
        """Collective: go on from checkpoint ``resume`` on ``cluster`` (the survivors of a lost rank).

        The set-up is built again for the new layout; the figures, the metrics
        and the position's bookkeeping carry on.  The state resumed from is in
        memory, so the next save writes it.
        """
        self.monitor.close(abandon=True)
        self.cluster = cluster
        with agreed(cluster.world):
            self.setup = prepare(self.config, cluster, self.xp, self.inputs, resume)
        self._make_strategy()
        self.strategy.initialize(resume)
        self._move_to(resume, on_disk=False)

    def give_up(self, message):
        """The run cannot go on (a lost chief or ps): record why; the caller ends the process."""
        if self.chief:
            self.log.write("failed", step=self.step, epoch=self.epoch + 1, reason=message)
            self.log.close()

    def train(self):
        """The epochs from the current position, until the end, ``--steps``, a stop request or divergence."""
        config, cluster, setup, strategy = self.config, self.cluster, self.setup, self.strategy
        steps_to_run = total_steps(config, setup)
        delay = test_delay(cluster.worker_index)
        self.agreement = StepAgreement(cluster.world) if strategy.lockstep else None
        self.early = False   # this rank left the loop on a stop request
        stop = bool(config.steps and self.step >= config.steps)
        if strategy.serves:   # ps-async and backup ps ranks: serve until the workers are done
            strategy.serve(ServerControl(config, setup, self.signals, data_layout(config, cluster)[0], self.step,
                                         self.lineages))
            stop = True
        start_epoch, start_in_epoch = self.epoch, self.epoch_step
        for epoch in range(start_epoch, config.epochs if not stop else start_epoch):
            self.epoch = epoch
            skip = start_in_epoch if epoch == start_epoch else 0
            batches = self._batches(epoch, skip)
            self.epoch_step = skip
            try:
                for x, y in batches:
                    if x is not None:
                        x, y = self.xp.asarray(x), self.xp.asarray(y)
                    self.where.enter("compute", self.step + 1)
                    if delay:
                        time.sleep(delay)
                    began = recorder.now() if TRACER.on else None
                    result = strategy.step(x, y, setup.local_batch / config.batch_size, self.step)
                    if began is not None:
                        TRACER.complete("step", "step", began, recorder.STEPS, step=self.step + 1)
                    self.step, self.epoch_step, self.trained_steps = result.step, self.epoch_step + 1, \
                        self.trained_steps + 1
                    self._account(result.loss, result.skipped, result.clipped)
                    if self._boundary(steps_to_run, result):
                        stop = True
                        break
            finally:
                batches.close()
            if self.window_good:
                self.last_loss = self.window_loss / self.window_good
            if stop:  # before the loop moves `epoch` on: the checkpoint must name this epoch
                break
            if config.eval_every and (epoch + 1) % config.eval_every == 0:
                self.evaluate(self.monitored_split)

    def _batches(self, epoch, skip):
        """This rank's batches of ``epoch`` from step ``skip`` on."""
        config, cluster, setup = self.config, self.cluster, self.setup
        if config.replication == "in-graph" and cluster.worker_index is not None:
            source = None
            if self.chief:
                source = data.global_batches(setup.train, config.batch_size, setup.steps_per_epoch, config.seed,
                                             epoch, skip=skip)
            y_shape, y_dtype = ((), "int64") if setup.info.num_classes else ((setup.info.target_width,),
                                                                                setup.model.dtype)
            return ScatteredBatches(cluster.workers, source, config.batch_size, setup.model.input_shape,
                                         y_shape, setup.model.dtype, y_dtype, setup.steps_per_epoch - skip)
        if setup.train is None:
            return _NoData(setup.steps_per_epoch, skip)
        # the run ends in this epoch: a stream need not read the next one's first window
        last_epoch = (epoch + 1) * setup.steps_per_epoch >= total_steps(config, setup)
        return data.train_batches(setup.train, setup.local_batch, setup.steps_per_epoch, config.seed, epoch,
                                  data_layout(config, cluster)[1], skip=skip, last_epoch=last_epoch)

    def _account(self, loss, skipped, clipped=False):
        """Figures of the step just taken: the interval's loss, metrics, progress, and NaN patience."""
        config, step = self.config, self.step
        self.window_steps += 1
        self.window_clipped += bool(clipped)
        self.clipped_steps += bool(clipped)
        if skipped:   # the same on every rank of a lockstep strategy, so all count alike
            self.skipped_in_row += 1
            self.log.write("skipped", step=step, epoch=self.epoch + 1, reason="loss or gradients NaN or Inf")
            if self.skipped_in_row > config.nan_patience:
                self.diverged = (f"the loss or gradients were NaN or Inf {self.skipped_in_row} step(s) in a row "
                                 f"(--nan-patience {config.nan_patience}), the last at step {step}: training "
                                 "diverged; lower --lr, or check the data")
        else:
            self.skipped_in_row = 0
            self.window_loss, self.window_good = self.window_loss + loss, self.window_good + 1
        if step % config.log_every == 0:
            now = time.perf_counter()
            rate = self.window_steps * config.batch_size / (now - self.window_start)
            self.last_loss = self.window_loss / self.window_good if self.window_good else math.nan
            self.log.write("step", step=step, epoch=self.epoch + 1, loss=self.last_loss,
                           lr=self._learning_rate(step - 1), **self._training_figures(),
                           **({"clipped": self.window_clipped} if config.clip_norm and self.strategy.lockstep
                              else {}),
                           samples_per_s=rate, time=self.checkpointer.run_time(now))
            self.window_clipped = 0
            self.progress.update(step, self.epoch, self.last_loss, rate)
            self.window_start, self.window_loss, self.window_steps, self.window_good = now, 0.0, 0, 0

    def _learning_rate(self, step):
        """The learning rate of the update computed at ``step`` (the schedule's)."""
        rate = self.strategy.recipe.lr(step)
        return self.config.lr if rate is None else rate

    def _training_figures(self):
        """The chief's training accuracy (or mean absolute error) since the last call: its own share of the batches.

        Each worker sees a random part of every global batch, so the chief's
        part estimates the whole; it costs no communication.
        """
        right, seen = self.strategy.take_train_counts()
        if not seen:
            return {}
        name = "train_accuracy" if self.setup.info.num_classes else "train_mae"
        return {name: right / seen}

    def _boundary(self, steps_to_run, result):
        """After each step: stop requests and checkpoints; True when this rank leaves the loop."""
        config, strategy = self.config, self.strategy
        requested = self._stop_request()
        if self.agreement:
            self.where.enter("agree")
            schedule = self.checkpointer.schedule   # the time is the chief's, agreed at the boundary
            flags = self.agreement.boundary(requested, self.chief and schedule.timed(self.checkpointer.clock()))
            self.early = bool(flags["signal"]) and self.step < steps_to_run
            if (schedule.crossed(self.step) or flags["due"] or self.early) and not self.skipped_in_row:
                self.save()   # (never a state that is going wrong: it could push good ones out of --keep)
        else:   # the strategy carries the request to the others; the checkpoint comes after finish()
            if requested:
                strategy.request_stop(requested)
            self.early = result.stop and self.step < steps_to_run
        return bool(self.early or self.diverged or (config.steps and self.step >= config.steps) or result.finished)

    def _stop_request(self):
        """What this rank asks of the others at a boundary: a failed write, else a signal, else a callback's stop."""
        if self.log.failure:
            return WRITE_FAILED
        # (EARLY_STOP is below every signal: a real one wins)
        return self.signals.received or (EARLY_STOP if self.log.stop_asked else 0)

    def save(self, state=(), gathered=False):
        """Collective: the chief writes a checkpoint of the current position (once per step).

        ``gathered``: the caller gathered the strategy's ``state()`` already (``state``: None off the chief).
        """
        strategy = self.strategy
        if not self.checkpointer.enabled or (strategy.lockstep and self.saved_at == self.step):
            return   # (other strategies' ranks count steps apart: each call must be collective)
        self.where.enter("gather")
        began = recorder.now() if TRACER.on else None
        if not gathered:
            state = strategy.state()  # collective: shards are gathered to the chief
        self.saved_at = self.step
        if self.chief:
            self.where.enter("write")
            path = self.checkpointer.write(state, self.step, self.epoch, self.epoch_step,
                                           data_layout(self.config, self.cluster)[0], best=self.best.record())
            self.log.write("checkpoint", step=self.step, epoch=self.epoch + 1, path=str(path))
        if began is not None:
            TRACER.complete("checkpoint", "checkpoint", began, recorder.STEPS, step=self.step)

    @property
    def monitored_split(self):
        """The split evaluated every ``--eval-every`` epochs: validation where there is one, else test."""
        return "val" if "val" in self.setup.info.sizes else "test"

    def evaluate(self, split="test"):
        """Collective over the evaluating ranks: the task's figures on ``split`` (:mod:`~mpidist.nn.scores`).

        The chief reports them (``test_*`` or ``val_*``).  After a validation,
        ``--keep-best`` keeps a checkpoint of an improved state (collective over
        every rank of a lockstep strategy).
        """
        setup = self.setup
        shard = setup.val if split == "val" else setup.test
        with TRACER.span(f"evaluate {split}", "eval", recorder.STEPS, step=self.step):
            figures = self.strategy.evaluate(data.eval_batches(shard) if shard else [])
        if split == "test":
            self.result, self.evaluated_at = figures, self.step
        else:
            self.val_result, self.validated_at = figures, self.step
        self.progress.evaluated(self.step, self.epoch, self.last_loss, figures, split)
        self.log.write("eval", step=self.step, epoch=self.epoch + 1, **scores.headline(figures, prefix=split + "_"))
        if split == "val" and self.config.keep_best:
            self._keep_if_best(scores.headline(figures, prefix="val_").get(self.config.keep_best, math.nan))

    def _keep_if_best(self, value):
        """Collective: if the chief's ``value`` of the ``--keep-best`` figure improved, checkpoint and keep it as the best."""
        improved = np.zeros(1, dtype=np.int64)
        if self.chief:
            improved[0] = self.best.offer(value, self.step)
        bcast(self.cluster.world, improved, root=self.cluster.chief_rank)
        if improved[0] and self.checkpointer.enabled:
            self.save()
            if self.chief:
                path = self.checkpointer.keep_best(self.step)
                self.log.write("best", step=self.step, epoch=self.epoch + 1, figure=self.config.keep_best,
                               value=value, path=str(path))

    # -- the end -------------------------------------------------------------------------------------------
    def conclude(self):
        """Collective: settle, evaluate and checkpoint as the run ended; the chief reports."""
        cluster, strategy = self.cluster, self.strategy
        self.where.enter("finish")
        self.progress.close()
        if self.agreement:
            self.agreement.close()
        strategy.finish()
        flags = settle(cluster.world, self._stop_request(), self.early)
        # a callback's stop ends the run as a finished one; a signal's, as a preempted one; a failed write
        # (which stops the run wherever it is), as a failed one
        self.stopped_early = flags["early"] and flags["signal"] == EARLY_STOP
        write_failed = flags["signal"] == WRITE_FAILED
        stopped = flags if flags["signal"] and flags["early"] and not (self.stopped_early or write_failed) else {}
        elapsed = time.perf_counter() - self.started
        if not (stopped or self.diverged or write_failed) and (self.evaluated_at != self.step or self.result is None):
            if self.monitored_split == "val" and self.validated_at != self.step:
                self.evaluate("val")   # (the validation of the state the run ends with, as of every epoch's)
            self.evaluate()   # (a stopping job has no time to spare; a diverged one nothing to show)
        state = None
        if not self.diverged:   # a diverged state must not push a good checkpoint out of --keep
            self.where.enter("gather")
            state = strategy.state()   # collective: the trained model, on the chief
            self.save(state, gathered=True)
        self.where.enter("finish")
        roles = cluster.world.gather((cluster.rank, cluster.role, strategy.stats(), peak_memory()),
                                     root=cluster.chief_rank)
        if self.config.trace != "off":
            self._write_trace()
        self.monitor.close()
        strategy.close()
        if self.diverged:
            return self._report_failure(self.diverged)
        if write_failed or self.log.failure:   # (the chief alone learns of a failure in its last writes)
            return self._report_failure(self.log.failure or "the chief could not write its metrics")
        if not self.chief:
            return {"stopped_by": signal_name(stopped["signal"])} if stopped else {}
        outcome = self._report_stop(stopped) if stopped else self._report_done(roles, elapsed)
        if self.log.failure:   # the last events could not be written: the run's record is incomplete
            outcome = self._report_failure(self.log.failure)
        outcome["params"] = state[0]
        outcome["checkpoints"] = self.checkpointer.kept()
        return outcome

    def _write_trace(self):
        """Collective: the chief gathers every rank's timeline into ``trace.json`` (the run directory's)."""
        cluster, config = self.cluster, self.config
        self.where.enter("gather")
        path = trace_file(config, self.setup.resume)
        part = self.strategy.describe(cluster.rank)
        label = f"rank {cluster.rank} ({cluster.role}{', ' + part if part else ''})"
        problem = trace.gather_and_write(cluster.world, cluster.chief_rank, self.trace_offset, label, path)
        if self.chief and problem is None:
            self.trace_path = path
        elif self.chief:      # the run itself went well: say so, and what was lost
            self.say(f"mpidist: warning: the timeline could not be written to {path} ({problem})")
        self.where.enter("finish")

    def _report_done(self, roles, elapsed):
        config, cluster, setup = self.config, self.cluster, self.setup
        # the scalar test figures first; the per-class ones and the confusion matrix (long) last
        headline = scores.headline(self.result)
        names = getattr(setup.info, "class_names", None)
        detail = {name: value for name, value in scores.report(self.result, names).items() if name not in headline}
        samples_per_s = self.trained_steps * config.batch_size / elapsed if elapsed > 0 else 0.0
        epochs = min(self.epoch + 1, config.epochs)   # (resumed or recovered at the end: past the last epoch)
        final = {"steps": self.step, "epochs": epochs, "loss": self.last_loss, **headline, "train_time": elapsed,
                 "samples_per_s": samples_per_s, "workers": cluster.num_workers, "ps": config.ps,
                 "strategy": config.strategy,
                 **({"clipped_steps": self._clipped_total(roles)} if config.clip_norm else {}),
                 **(scores.headline(self.val_result, prefix="val_") if self.val_result else {}),
                 **({"best": {"figure": config.keep_best, "value": self.best.value, "step": self.best.step,
                              "path": str(self.checkpointer.best) if self.checkpointer.best else None}}
                    if config.keep_best else {}),
                 **({"stopped_early": True} if self.stopped_early else {}),
                 **({"recoveries": self.recoveries} if config.elastic else {}),
                 "peak_rss_mib": max(peak for *_, peak in roles) / (1 << 20),
                 "roles": [{"rank": rank, "role": role, **stats} for rank, role, stats, _ in roles if stats], **detail}
        self.log.write("done", **final)
        self.log.close()
        rows = [("dataset", f"{setup.info.name} ({setup.info.path})"), ("model", config.model),
                ("strategy", f"{config.strategy} on {layout_text(config, cluster)}"),
                ("steps", f"{self.step} ({final['epochs']} epochs)"), ("final train loss", f"{self.last_loss:.4f}"),
                *scores.summary_rows(self.result), ("training time", f"{elapsed:.2f} s"),
                ("throughput", f"{samples_per_s:,.0f} samples/s"),
                ("peak memory", f"{final['peak_rss_mib']:,.0f} MiB (resident, the largest rank)")]
        if config.run_dir:
            rows.append(("run directory", config.run_dir))
        if config.metrics:
            rows.append(("metrics", config.metrics))
        if self.trace_path is not None:
            rows.append(("trace", f"{self.trace_path} (ui.perfetto.dev, chrome://tracing)"))
        if config.checkpoint_dir:
            rows.append(("checkpoints", config.checkpoint_dir))
        self.say("mpidist: done\n" + format_summary(rows))
        return final

    def _clipped_total(self, roles):
        """Steps clipped: the chief's count where it takes part in every step's decision, else the ranks' own.

        Under ps-async each worker clips its own gradients (their clipped pushes
        are summed; under local-sgd, the chief's own); with backup workers the
        ps ranks decide together (their count).
        """
        if self.strategy.lockstep:
            return self.clipped_steps
        counted = [stats.get("clipped", 0) for _, _, stats, _ in roles]
        return int(sum(counted) if self.config.strategy == "ps-async" else max(counted, default=0))

    def _report_stop(self, flags):
        """Chief: say which signal stopped the run, and where to resume from."""
        name, config = signal_name(flags["signal"]), self.config
        self.log.write("stopped", step=self.step, epoch=self.epoch + 1, signal=name, rank=flags["rank"] - 1,
                       checkpoint=None if self.checkpointer.last is None else str(self.checkpointer.last))
        self.log.close()
        if self.checkpointer.last is not None:
            where = (f"checkpoint {self.checkpointer.last} written; continue with "
                     f"{rundir.resume_flags(config)}")
        else:
            where = "no checkpoint written (no --checkpoint-dir): the work done is lost"
        self.say(f"mpidist: stopped by {name} (rank {flags['rank'] - 1}) at step {self.step}: {where}")
        return {"steps": self.step, "epochs": self.epoch + 1, "stopped_by": name, "checkpoint": self.checkpointer.last}

    def _report_failure(self, reason):
        """Every rank: the run failed at the same point everywhere; the chief says why (exit code 1)."""
        if self.chief:
            self.log.write("failed", step=self.step, epoch=self.epoch + 1, reason=reason)
            self.log.close()
            kept = f"; checkpoints already written are kept in {self.config.checkpoint_dir}" \
                if self.config.checkpoint_dir else ""
            if self.checkpointer.last is not None and self.checkpointer.last_step == self.step:
                kept = (f"; checkpoint {self.checkpointer.last} written at step {self.step}: continue with "
                        f"{rundir.resume_flags(self.config)}")
            sys.stderr.write(error_line(reason + kept) + "\n")
            sys.stderr.flush()
        return {"steps": self.step, "failed": reason}
