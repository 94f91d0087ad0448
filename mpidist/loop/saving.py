"""A training run's checkpoints as it goes: taken at a step (gathered, or each rank's slices), written behind
training or at once, logged when whole, and the best one kept (``--keep-best``)."""

import numpy as np

from ..runtime import recorder
from ..runtime.comm import bcast
from ..runtime.whereabouts import here
from .setup import data_layout

TRACER = recorder.tracer()


def save(training, state=(), gathered=False, behind=False):
    """Collective: a checkpoint of the current position (once per step), written by the chief, or where the
    strategy splits the model (:attr:`~mpidist.parallel.declared.Declared.placement`) by the ranks that hold
    it.

    ``gathered``: the caller gathered the strategy's ``state()`` already (``state``: None off the chief).
    ``behind``: the chief copies a gathered state and a thread writes it while training goes on; the
    ``checkpoint`` event comes once the file is whole (a split model's is written in this thread).
    """
    position, checkpointer = training.position, training.checkpointer
    if not checkpointer.enabled or (training.strategy.lockstep and checkpointer.taken_at == position.step):
        return  # (other strategies' ranks count steps apart: each call must be collective)
    here().enter("gather")
    began = recorder.now() if TRACER.on else None
    placement = training.strategy.placement  # (a split model: nothing is gathered)
    placed = training.strategy.placed_state() if placement is not None else None
    if placed is None and not gathered:
        state = training.strategy.state()  # collective: shards are gathered to the chief
    checkpointer.taken_at = position.step
    if behind:
        checkpointer.taken(position.step)
    where = (
        position.step,
        position.epoch,
        position.epoch_step,
        data_layout(training.config, training.cluster)[0],
    )
    here().enter("write")
    log_written(
        training,
        checkpointer.take(
            training.cluster, placement, placed, state, where, training.evaluations.best.record(), behind
        ),
    )
    if began is not None:
        TRACER.complete("checkpoint", "checkpoint", began, recorder.STEPS, step=position.step)


def finish_writes(training):
    """Chief: a checkpoint being written behind training is finished (and logged) before a rollback."""
    if training.chief:
        log_written(training, training.checkpointer.collect(wait=True))


def log_written(training, written):
    """Chief: the ``checkpoint`` event of each ``(path, step, epoch)`` written."""
    for path, step, epoch in written:
        training.outputs.log.write("checkpoint", step=step, epoch=epoch + 1, path=str(path))


def keep_if_best(training, value):
    """Collective: if the chief's ``value`` of the ``--keep-best`` figure improved, checkpoint and keep it as
    the best."""
    improved, step = np.zeros(1, dtype=np.int64), training.position.step
    if training.chief:
        improved[0] = training.evaluations.best.offer(value, step)
    bcast(training.cluster.world, improved, root=training.cluster.chief_rank)
    if improved[0] and training.checkpointer.enabled:
        save(training)  # (taken already where this step's checkpoint was due: then it may be under way)
        log_written(training, training.checkpointer.finish_writes())
        if training.chief:
            path = training.checkpointer.keep_best(step, training.setup.resume)
            training.outputs.log.write(
                "best",
                step=step,
                epoch=training.position.epoch + 1,
                figure=training.config.keep_best,
                value=value,
                path=str(path),
            )
