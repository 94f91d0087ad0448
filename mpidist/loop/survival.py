"""What a rank's training does when the survivors of a lost rank recover (``--elastic``).

The elastic :class:`~mpidist.loop.elastic.State` calls these back
(:class:`~mpidist.loop.training.Training` registers them): go on from the
survivors' state on the new cluster, give up, leave (a survivor that cannot
train on), and say how the run goes on.
"""

from ..parallel.recipe import total_steps
from ..runtime.agreement import agreed
from .saving import finish_writes
from .setup import prepare


def continue_from(training, cluster, resume):
    """Collective: go on from checkpoint ``resume`` on ``cluster`` (the survivors of a lost rank).

    The set-up is built again for the new layout; the figures, the metrics
    and the position's bookkeeping carry on.  The state resumed from is in
    memory, so the next save writes it.
    """
    training.monitor.free(abandon=True)
    # (its windows and communicators are the broken world's: left unfreed)
    training.strategy.recovery().abandon()
    training.cluster = cluster
    with agreed(cluster.world):
        # (its windows and buffers, the broken world's, are held still: a price taken now would count them)
        training.setup = prepare(
            training.config, cluster, training.device.xp, training.inputs, resume, priced=False
        )
        if cluster.is_chief and not training.outputs.chief:  # the chief died: this worker takes its place
            training.outputs.take_over(
                training.config, (training.checkpointer.files.lineage, training.checkpointer.files.parent)
            )
            training.outputs.show_progress(
                training.config, total_steps(training.config, training.setup), resume.step
            )
    training.new_strategy()
    training.strategy.initialize(resume)
    training.move_to(resume, on_disk=False)
    training.checkpointer.rolled_back(resume.step)


def give_up(training, message):
    """The run cannot go on (a lost chief or ps): record why; the caller ends the process."""
    if training.chief:
        training.outputs.log.write(
            "failed", step=training.position.step, epoch=training.position.epoch + 1, reason=message
        )
        training.outputs.log.close()


def leave(training):
    """This rank survived a loss but cannot train on (its pipeline replica lost a stage): let go of all it
    holds (a chief: the checkpoint being written, its files and the directory's lock, for the new chief)."""
    training.monitor.free(abandon=True)
    finish_writes(training)
    if training.chief:
        training.outputs.log.close()
    training.outputs.close()


def recovered(training, record):
    """Chief: the ``recovered`` event and a line saying who was lost and how the run goes on."""
    if training.chief:
        training.outputs.log.write("recovered", **record)
        split = "/".join(map(str, record["local_batches"]))
        back = (
            (
                f" (rolled back {record['steps_lost']} step(s) to {record['rolled_back_to']}: what was lost "
                "is in "
                "no survivor)"
            )
            if "rolled_back_to" in record
            else ""
        )
        back += f"; {record['idle']} idle (their replica lost a stage)" if "idle" in record else ""
        training.outputs.say(
            f"mpidist: lost {record['lost']}{back}; continuing from step {record['step']} with "
            f"{record['workers']} worker(s): global batch {record['global_batch']} split {split}, "
            f"{record['steps_per_epoch']} steps/epoch, the chief's data {record['data'] or 'none'} "
            f"(recovered in {record['seconds']:.2f} s)"
        )
