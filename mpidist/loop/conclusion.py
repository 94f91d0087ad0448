"""The end of a training run: agree on how it ended, evaluate what is missing, checkpoint the result, and
what the run returns (and the chief reports)."""

import numpy as np

from ..runtime.comm import bcast
from ..runtime.memory import peak_memory
from ..runtime.preempt import EARLY_STOP, WRITE_FAILED, agree_on_stop, signal_name
from ..runtime.whereabouts import here
from .outputs import trace_file
from .report import Report
from .saving import log_written, save


def conclude(training):
    """Collective: agree on how the run ended, evaluate and checkpoint; the chief reports."""
    cluster, strategy, stops, outputs = training.cluster, training.strategy, training.stops, training.outputs
    here().enter("finish")
    outputs.progress.close()
    stops.free()
    strategy.finish()
    flags = agree_on_stop(cluster.world, stops.request(outputs.log), stops.early)
    # a callback's stop ends the run as a finished one; a signal's, as a preempted one; a failed write
    # (which stops the run wherever it is), as a failed one
    stopped_early = flags["early"] and flags["signal"] == EARLY_STOP
    write_failed = flags["signal"] == WRITE_FAILED
    stopped = flags if flags["signal"] and flags["early"] and not (stopped_early or write_failed) else {}
    # (a write behind in flight: its event before the end's)
    log_written(training, training.checkpointer.finish_writes())
    elapsed = training.window.elapsed()  # (training time: the final evaluation and checkpoint are not in it)
    if not (stopped or stops.diverged or write_failed):  # (a stopping job has no time to spare)
        for split in missing_splits(training):
            cut = training.evaluate(split)
            if cut:  # (a stopping job has no time for the rest of it either)
                stopped = {**cut, "early": 1}
                break
    state = None
    if not stops.diverged:  # a diverged state must not push a good checkpoint out of --keep
        here().enter("gather")
        if strategy.placement is None:  # (a split model is never gathered: its checkpoint holds the result)
            state = strategy.state()  # collective: the trained model, on the chief
        save(training, state, gathered=True)
    here().enter("finish")
    roles = cluster.world.gather(
        (cluster.rank, cluster.role, strategy.stats(), peak_memory()), root=cluster.chief_rank
    )
    if training.config.trace != "off":
        here().enter("gather")
        part = strategy.describe(cluster.rank)
        outputs.write_trace(
            cluster,
            trace_file(training.config, training.setup.resume),
            f"rank {cluster.rank} ({cluster.role}{', ' + part if part else ''})",
        )
        here().enter("finish")
    training.monitor.free()
    training.stops.phases.free()
    # (the result is the chief's state: no rank copies the model out of a node's window)
    strategy.free(keep=state.params if state is not None else False)
    return outcome(training, state, roles, elapsed, stopped, stopped_early, write_failed)


def missing_splits(training):
    """Collective: the splits the end of the run still evaluates, as the chief knows them.

    (Ranks out of lockstep validated at steps of their own, and a ps of
    ``ps-async`` never: only the chief's record counts, and every rank
    takes part in the evaluation's agreement on stopping.)
    """
    names = ("val", "test")
    wanted = np.zeros(len(names), dtype=np.int64)
    if training.chief:
        missing = training.evaluations.missing_at(training.position.step)
        wanted[:] = [missing.index(name) + 1 if name in missing else 0 for name in names]
    bcast(training.cluster.world, wanted, root=training.cluster.chief_rank)
    return [name for _, name in sorted((order, name) for order, name in zip(wanted, names) if order)]


def outcome(training, state, roles, elapsed, stopped, stopped_early, write_failed):
    """What the run returns (and the chief reports): failed, stopped, or done with its figures."""
    report = Report(
        training.config,
        training.cluster,
        training.setup,
        training.outputs,
        training.checkpointer,
        training.position,
    )
    log = training.outputs.log
    if training.stops.diverged:
        return report.failed(training.stops.diverged)
    if write_failed or log.failure:  # (the chief alone learns of a failure in its last writes)
        return report.failed(log.failure or "the chief could not write its metrics")
    if not training.chief:
        return {"stopped_by": signal_name(stopped["signal"])} if stopped else {}
    if stopped:
        outcome = report.stopped(stopped)
    else:
        config = training.config
        outcome = report.done(
            training.window,
            training.evaluations,
            roles,
            elapsed,
            clipped=clipped_total(training, roles) if config.clip_norm else None,
            stopped_early=stopped_early,
            recoveries=training.state.recoveries if config.elastic else None,
        )
    if log.failure:  # the last events could not be written: the run's record is incomplete
        outcome = report.failed(log.failure)
    outcome["params"] = state.params if state is not None else None
    outcome["dataset"] = training.setup.info  # (what the returned model is built for: not read again)
    outcome["checkpoints"] = training.checkpointer.kept()
    return outcome


def clipped_total(training, roles):
    """Steps clipped: the chief's count where it takes part in every step's decision, else the strategy's
    total of the ranks' own counts (:meth:`~mpidist.parallel.declared.Declared.clipped_steps`)."""
    if training.strategy.lockstep:
        return training.window.clipped_total
    return int(training.strategy.clipped_steps([stats.get("clipped", 0) for _, _, stats, _ in roles]))
