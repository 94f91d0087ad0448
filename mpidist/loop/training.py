"""The training loop: one orchestrator over small state objects, the same on every rank.

Set-up that can fail on bad input (dataset, model shapes, checkpoint,
metrics file) runs inside :func:`mpidist.runtime.agreement.agreed`, before
any collective, so every rank exits together with the same code.

Workers feed their batches; parameter servers walk the same schedule with no
data (they take part in each step's collectives) or serve until the workers
are done.  Only the chief writes metrics, checkpoints and the terminal.  The
parts, one job each: :class:`~mpidist.loop.position.Position` (where the run
is), :class:`~mpidist.loop.window.StepWindow` (the figures of the steps since
the last line), :class:`~mpidist.loop.evaluations.Evaluations` (the latest
figures, the best so far), :class:`~mpidist.loop.outputs.Outputs` (what the
run writes), :class:`~mpidist.loop.stops.Stops` (why a rank leaves the loop),
:class:`~mpidist.loop.report.Report` (the end in words) and the elastic
:class:`~mpidist.loop.elastic.State`, which owns the position a recovery
agrees on.
"""

import collections
import functools
import sys
import time

import numpy as np

from .. import data
from ..nn import scores
from ..observe.stall import StallMonitor
from ..parallel.recipe import total_steps
from ..runtime import recorder
from ..runtime.agreement import agreed
from ..runtime.comm import bcast
from ..runtime.phase import PhaseAgreement
from ..runtime.preempt import stop_signals
from ..runtime.threads import node_cores
from ..runtime.whereabouts import here
from . import elastic, sharded_save, survival
from .checkpointer import Checkpointer
from .conclusion import conclude
from .evaluations import Evaluations, shown
from .feed import epoch_batches
from .outputs import Outputs
from .position import Position
from .report import header
from .resuming import continued
from .saving import finish_writes, keep_if_best, log_written, save
from .serving import ServerControl
from .setup import agreed_setup, data_layout, make_strategy, test_delay
from .stops import Stops
from .window import StepWindow

TRACER = recorder.tracer()

#: the array module this rank computes with and its device's label (``cpu``, ``gpu0``)
Device = collections.namedtuple("Device", "xp label")


def run(config, cluster, xp, device_label, inputs, callbacks=(), stream=sys.stdout):
    """Train ``inputs`` (:class:`~mpidist.loop.setup.Inputs`) as ``config`` says on this rank; returns the
    outcome.

    The outcome is a dict: the final figures on the chief, with ``params``
    (the trained flat parameters, host memory) where the run was not diverged.
    ``callbacks`` (:class:`~mpidist.loop.callbacks.Callback`) are called on the chief.

    A SIGTERM, SIGUSR1 or SIGINT on any rank stops every rank at the same
    step boundary, after a checkpoint; the outcome then names the signal
    (``stopped_by``) and the CLI exits with EXIT_PREEMPTED.  A run that
    diverged (``--nan-patience``) has ``failed`` set, and the CLI exits 1.
    """
    with stop_signals() as signals:
        training = Training(
            config,
            cluster,
            Device(xp, device_label),
            inputs,
            Stops(signals),
            Outputs(stream, cluster.is_chief),
        )
        try:
            training.start(callbacks)
            return elastic.run_with_recovery(training.state, training.run_to_end)
        finally:
            training.outputs.close()


class Training:
    """One training run on this rank: set-up, the loop, and the end.

    The position lives in the elastic :class:`~mpidist.loop.elastic.State`
    (``state.position``), so the loop can be entered again from where the
    survivors of a lost rank agree it is.
    """

    def __init__(self, config, cluster, device, inputs, stops, outputs):
        self.cluster, self.device, self.inputs = cluster, device, inputs
        self.stops, self.outputs = stops, outputs
        self.state = elastic.State(config, Position())
        for event, callback in (
            ("reset", survival.continue_from),
            ("give_up", survival.give_up),
            ("recovered", survival.recovered),
            ("finish_writes", finish_writes),
            ("leave", survival.leave),
        ):
            self.state.register(event, functools.partial(callback, self))

    @property
    def config(self):
        """The run's settings (the elastic state's: as the run goes on with them)."""
        return self.state.config

    @property
    def chief(self):
        return self.cluster.is_chief

    @property
    def position(self):
        return self.state.position

    # -- set-up --------------------------------------------------------------------------------------------
    def start(self, callbacks=()):
        """Agreed local set-up, the strategy, its initial state, the header; the position to start from."""
        config, cluster, outputs = self.config, self.cluster, self.outputs
        here().enter("setup", 0)
        self.setup, early_stopping = agreed_setup(
            config, cluster, self.device.xp, self.inputs, outputs, callbacks
        )
        here().enter("start")  # collectives from here on: a wait on the others
        setup, resume, asked = self.setup, self.setup.resume, config.seed
        config = self.state.config = continued(config, setup)  # the seed and buffer it goes on with
        outputs.begin(config)  # (settings.toml as the run goes on: `train --config` repeats its data order)
        lineages = self._share_lineage()
        outputs.start_trace(config, cluster)  # (the set-up's files and checks are not on the timeline)
        self.new_strategy()
        place = self.strategy.describe(cluster.rank)
        # (collective)
        table = cluster.table(self.device.label, setup.reading.why if setup.reading else "", place)
        # (local) a split model's ranks check a share of its parts and read their slices
        if resume is not None:
            with agreed(cluster.world):  # as the strategy restores them; other layouts read the whole
                resume = (
                    resume.check_parts((cluster.rank, cluster.size))
                    if self.strategy.placement is not None
                    else resume.whole()
                )
        self.strategy.initialize(resume)
        # (start-up)
        held = cluster.world.gather(
            (cluster.rank, self.strategy.held_bytes(), setup.price.total if setup.price else 0),
            root=cluster.chief_rank,
        )
        cores = node_cores(cluster.node)  # (plan --check tells a run whose ranks shared cores)
        if self.chief:
            header(
                self.config,
                cluster,
                self.setup,
                self.outputs,
                table,
                asked,
                held,
                imbalance=self.strategy.imbalance,
                watched=self.monitor.active,
                cores=cores,
            )
        outputs.show_progress(config, total_steps(config, setup), 0 if resume is None else resume.step)
        self.window = StepWindow(config.nan_patience)
        # (its clock is the run's: the metrics' time goes on from a resumed checkpoint's)
        self.checkpointer = Checkpointer(
            config,
            0 if resume is None else resume.step,
            *lineages,
            elapsed=0.0 if resume is None else resume.elapsed,
            dataset=setup.info,
            parameters=sharded_save.parameters(setup.model),
        )
        self.evaluations = Evaluations(
            setup.info.sizes, config.keep_best, resume.best if resume else None, early_stopping
        )
        self.move_to(resume)

    def _share_lineage(self):
        """Collective: ``(lineage, parent)`` the chief settled, on every rank (the first ps of ps-async writes
        too)."""
        codes = np.full(2, -1, dtype=np.int64)
        if self.chief:
            claim = self.outputs.claim
            codes[:] = [
                int(claim.lineage, 16) if claim.lineage else -1,
                int(claim.parent, 16) if claim.parent else -1,
            ]
        bcast(self.cluster.world, codes, root=self.cluster.chief_rank)
        return tuple(f"{int(code):08x}" if code >= 0 else "" for code in codes)

    def new_strategy(self):
        """Collective: the strategy for the current cluster and set-up, watched by a new stall monitor."""
        self.strategy = make_strategy(
            self.config, self.setup, self.cluster, self.device.xp, where=here(), figures=self.state.counts
        )
        self.monitor = StallMonitor(
            self.cluster.world, self.cluster.chief_rank, self.config.stall_timeout, here()
        ).start()
        self.state.bind(self.cluster, self.setup, self.strategy)

    def move_to(self, resume, on_disk=True):
        """Set the position to ``resume``'s (or the beginning); ``on_disk``: a checkpoint of it exists
        already."""
        self.position.move_to(Position.of(resume, self.setup.steps_per_epoch))
        self.checkpointer.taken_at = self.position.step if on_disk else None  # save() writes each step once

    # -- the loop ------------------------------------------------------------------------------------------
    def run_to_end(self):
        """The loop from the current position, then the end (evaluation, checkpoint, report): the outcome."""
        # NaN and overflow are detected and handled (--nan-patience): numpy need not warn on every rank
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            self.train()
        return conclude(self)

    def train(self):
        """The epochs from the current position, until the end, ``--steps``, a stop request or divergence."""
        config, cluster, position, stops = self.config, self.cluster, self.position, self.stops
        steps_to_run = total_steps(config, self.setup)
        if self.strategy.lockstep:
            self.state.revoked.append(stops.agree_on(cluster.world).comm)
        else:
            stops.agreement = None
        stops.early = False
        stop = bool(config.steps and position.step >= config.steps)
        if self.strategy.serves:  # ps-async and backup ps ranks: serve until the workers are done
            control = ServerControl(
                config,
                self.setup,
                stops.signals,
                data_layout(config, cluster)[0],
                position.step,
                (self.checkpointer.files.lineage, self.checkpointer.files.parent),
            )
            self.strategy.serve(control)
            control.finish_writes()
            stop = True
        start_epoch, start_in_epoch = position.epoch, position.epoch_step
        for epoch in range(start_epoch, config.epochs if not stop else start_epoch):
            position.epoch = epoch
            position.epoch_step = start_in_epoch if epoch == start_epoch else 0
            if self._train_epoch(steps_to_run):
                break  # (before the loop moves `epoch` on: the checkpoint must name this epoch)
            if config.eval_every and (epoch + 1) % config.eval_every == 0:
                # a signal cuts the validation short: a lockstep run stops now, with a checkpoint; the others'
                # next step boundary carries the signal as ever
                if (
                    self.evaluate(self.evaluations.monitored, together=self.strategy.lockstep)
                    and self.strategy.lockstep
                ):
                    stops.early = True
                    save(self)
                    break

    def _train_epoch(self, steps_to_run):
        """One epoch from the current position; True when the run stops in it."""
        config, setup, position, strategy = self.config, self.setup, self.position, self.strategy
        (delay, last_delayed), xp = test_delay(self.cluster.worker_index), self.device.xp
        batches = epoch_batches(config, self.cluster, setup, position.epoch, position.epoch_step)
        stop = False
        try:
            for x, y in batches:
                if x is not None:
                    x, y = xp.asarray(x), xp.asarray(y)
                here().enter("compute", position.step + 1)
                if delay and position.step < last_delayed:
                    time.sleep(delay)
                began = recorder.now() if TRACER.on else None
                result = strategy.step(x, y, setup.local_batch / config.batch_size, position.step)
                if began is not None:
                    TRACER.complete("step", "step", began, recorder.STEPS, step=position.step + 1)
                position.step, position.epoch_step = result.step, position.epoch_step + 1
                self._account(result.loss, result.skipped, result.clipped)
                if self._boundary(steps_to_run, result):
                    stop = True
                    break
        finally:
            batches.close()
        self.window.end_epoch()
        return stop

    def _account(self, loss, skipped, clipped=False):
        """Figures of the step just taken: the window's, the ``skipped`` and ``step`` events, NaN patience."""
        config, step, log = self.config, self.position.step, self.outputs.log
        if self.window.account(loss, skipped, clipped):
            self.stops.diverged = self.window.diverged(step)
        if skipped:
            log.write(
                "skipped", step=step, epoch=self.position.epoch + 1, reason="loss or gradients NaN or Inf"
            )
        if step % config.log_every == 0:
            mean, rate, clipped_steps, now = self.window.line(config.batch_size)
            # the learning rate of the update computed at step - 1
            scheduled = self.strategy.recipe.lr(step - 1)
            log.write(
                "step",
                step=step,
                epoch=self.position.epoch + 1,
                loss=mean,
                lr=config.lr if scheduled is None else scheduled,
                **self._training_figures(),
                **({"clipped": clipped_steps} if config.clip_norm and self.strategy.lockstep else {}),
                samples_per_s=rate,
                time=self.checkpointer.run_time(now),
            )
            self.outputs.progress.update(step, self.position.epoch, mean, rate)

    def _training_figures(self):
        """The chief's training accuracy (or mean absolute error) since the last call: its own share of the
        batches.

        Each worker sees a random part of every global batch, so the chief's
        part estimates the whole; it costs no communication.
        """
        right, seen = self.strategy.passes.take_counts()
        if not seen:
            return {}
        name = "train_accuracy" if self.setup.info.num_classes else "train_mae"
        return {name: right / seen}

    def _boundary(self, steps_to_run, result):
        """After each step: stop requests and checkpoints; True when this rank leaves the loop."""
        config, stops, position = self.config, self.stops, self.position
        requested = stops.request(self.outputs.log)
        if stops.agreement:
            here().enter("agree")
            checkpointer = self.checkpointer
            schedule = checkpointer.schedule  # the time is the chief's, agreed at the boundary
            flags = stops.agreement.boundary(
                requested,
                self.chief and schedule.timed(checkpointer.clock()),
                checkpointer.busy,
                checkpointer.writing,
            )
            stops.early = bool(flags["signal"]) and position.step < steps_to_run
            log_written(self, checkpointer.at_boundary(position.step, flags))
            due = schedule.crossed(position.step) or flags["due"]
            if not config.checkpoint_wait:  # (a checkpoint due while one is written waits for the writer)
                due = checkpointer.starts_at(position.step, due, flags["busy"])
            if (due or stops.early) and not self.window.skipped_in_row:
                # (never a state that is going wrong: it could push good ones out of --keep); a stopping job
                # waits for its checkpoint
                save(self, behind=not stops.early)
        else:  # the strategy carries the request to the others; the checkpoint comes after finish()
            if requested:
                self.strategy.request_stop(requested)
            stops.early = result.stop and position.step < steps_to_run
        return bool(
            stops.early
            or stops.diverged
            or (config.steps and position.step >= config.steps)
            or result.finished
        )

    def evaluate(self, split="test", together=True):
        """Collective over the evaluating ranks: the task's figures on ``split`` (:mod:`~mpidist.nn.scores`).

        The chief reports them (``test_*`` or ``val_*``).  After a validation,
        ``--keep-best`` keeps a checkpoint of an improved state (collective over
        every rank of a lockstep strategy).  A stop signal cuts the evaluation
        short (on every rank, ``together``; else on this one): nothing is
        reported and the agreed ``{"signal", "rank"}`` is returned (else None).
        """
        position, shard = self.position, self.setup.val if split == "val" else self.setup.test
        batches = data.eval_batches(shard) if shard else []
        if self.chief and shard:
            batches = shown(batches, len(shard), split, self.outputs.say)
        # (a survivor of a lost rank may be waiting in the phases' communicator: a recovery revokes it)
        comm = self.stops.phases.over(self.cluster.world, self.state.revoked.append) if together else None
        with PhaseAgreement(comm, self.stops.signals) as phase:
            items = phase.items(batches)
            with TRACER.span(f"evaluate {split}", "eval", recorder.STEPS, step=position.step):
                figures = self.strategy.evaluate(items)
            for _ in items:  # (a rank that evaluates nothing, a ps, still takes part in the agreement)
                pass
        if phase.cut:
            return phase.cut
        self.evaluations.record(split, figures, position.step)
        self.outputs.progress.evaluated(position.step, position.epoch, self.window.last_loss, figures, split)
        self.outputs.log.write(
            "eval",
            step=position.step,
            epoch=position.epoch + 1,
            **scores.headline(figures, prefix=split + "_"),
        )
        if split == "val" and self.config.keep_best:
            keep_if_best(
                self, scores.headline(figures, prefix="val_").get(self.config.keep_best, float("nan"))
            )
