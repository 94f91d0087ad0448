"""Training on after workers die (``--elastic``): the recovery wrapper around the loop and its state.

All of the recovery lives here, around the loop, in the shape of Horovod's elastic ``run_fn`` and ``State``:
:func:`run_with_recovery` runs the loop and, when a process dies, the :class:`State` recovers: the survivors
agree on the state (restore, sync) and the state's reset callbacks build the loop again from it.  The state
owns the run's position (the loop moves it step by step: the commit) and knows what the run is made of now
(``bind``); it uses nothing else of the loop. Strategies take part through their
:class:`~mpidist.parallel.recovery.Recovery` (``strategy.recovery()``), an object of a few hooks:
``communicators`` (theirs, to revoke), ``left_idle`` (survivors that cannot train on), ``survivors_step`` (the
step the survivors agree on, the chief's by default) and ``survivor_state`` (the state at that step: a ps-sync
ps or a pipeline stage takes back an update the others never saw, kept by its
:class:`~mpidist.parallel.rewind.PreviousSlice`); the figures they count live in the state (``counts``), which
outlives them.

When a blocking call reports a dead process (:mod:`mpidist.runtime.ulfm`),
or a watcher saw one die where the survivors must recover together
(:class:`~mpidist.runtime.ulfm.ProcessLost`), the survivors recover:

1. :func:`~mpidist.runtime.ulfm.shrink`: revoke every communicator in use,
   so survivors blocked on each other are released too, and shrink the
   world to the survivors.  Survivors that cannot train on (the other stages
   of a pipeline replica that lost one) are set aside: they let go of what
   they hold and wait, asleep, for the others' end.
2. If a parameter server died, its shard is in no survivor, nor is the
   chief's state where the others do not hold all it holds
   (:attr:`~mpidist.parallel.declared.Declared.chief_replaceable`) and it died.
   Where the strategy allows it (:attr:`~mpidist.parallel.declared.Declared.ps_rollback`:
   ``ps-sync``, ``ps-async``), a ps is left and the run writes checkpoints,
   every survivor goes back to the newest checkpoint of the run's lineage
   (the chief first finishes a write behind training, then names it): the
   rollback.  Otherwise, or where no worker can train on, the run cannot go
   on: every survivor ends with exit code 1 and the message says to resume
   from the last checkpoint.
3. The survivors rebuild the cluster (same roles; a lost chief's place goes
   to the lowest surviving worker, which then writes the metrics, the log
   and the checkpoints; after a rollback the shards are re-divided among the
   ps left), take the state the strategy holds at the agreed step
   (:func:`share`: an in-memory checkpoint, with the same layout as a file)
   or the checkpoint rolled back to, re-divide the global batch's lanes, and
   go on, every lane at that step (each sample of the epoch once:
   :mod:`mpidist.data.lanes`); a
   checkpoint resumes on any number of workers and ps ranks, so this is the
   same, tested, path as ``--resume`` with fewer ranks.  The strategy built
   for the broken world is abandoned (:meth:`~mpidist.parallel.recovery.Recovery.abandon`):
   its threads stop, and its windows and communicators are left unfreed, as
   freeing them is collective over a world with a dead member.

``ps-async`` workers never block on each other: there the ranks watch for
deaths (:class:`~mpidist.runtime.ulfm.FailureWatch`, as they step, while the
staleness bound holds them, as they serve), the first ps drops a dead worker
from the staleness bound, and the others never notice (nobody takes up its
lanes: their samples are left out for the rest of the run); the survivors
shrink at the end.  A dead ps or chief that a rollback can replace is a
:class:`~mpidist.runtime.ulfm.ProcessLost` on every rank that sees it, which
enters the recovery above as a failed call would (a rank held up in a
one-sided operation at the dead ps ends itself, see
:class:`~mpidist.runtime.ulfm.StuckGuard`: one more lost rank).  Any other
dead ps or chief seen by a watcher ends the job through the abort hook (a
:class:`~mpidist.runtime.errors.RunError`).  A second death during
a recovery ends the job too (exit code 1, one line).
"""

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from .. import data
from ..runtime import comm as mpi
from ..runtime.cluster import PS, WORKER
from ..runtime.errors import EXIT_FAILURE, EXIT_OK, RunError, error_line
from ..runtime.ulfm import ProcessLost, cannot_go_on, describe_lost, exit_after_failure, is_failure, shrink
from ..store import checkpoint
from ..store.checkpoint import Checkpoint
from ..store.lineage import newest_checkpoint
from .position import Position
from .setup import data_layout


def share_position(comm, root, position):
    """Collective: the chief's :class:`~mpidist.loop.position.Position` on every rank."""
    values = position.as_array() if comm.Get_rank() == root else np.zeros(3, dtype=np.int64)
    mpi.bcast(comm, values, root=root)
    return Position(*(int(v) for v in values))


def share(comm, root, state, position, names, count, dtype, config, seed):
    """Collective: ``root``'s :class:`~mpidist.parallel.saved_state.WholeState` as a :class:`Checkpoint` on
    every rank.

    The same object a checkpoint file loads as, so the survivors resume
    through the path ``--resume`` takes (and tests) for any rank count.
    """

    def broadcast(array):
        buffer = (
            np.ascontiguousarray(array, dtype=dtype) if comm.Get_rank() == root else np.empty(count, dtype)
        )
        mpi.bcast(comm, buffer, root=root)
        return buffer

    params, arrays, steps = (
        (state.params, state.optimizer, state.steps) if comm.Get_rank() == root else (None, {}, 0)
    )
    shared_steps = np.array([steps], dtype=np.int64)
    mpi.bcast(comm, shared_steps, root=root)
    return Checkpoint(
        path="(memory: the survivors' state)",
        params=broadcast(params),
        optimizer_state={name: broadcast(arrays.get(name)) for name in names},
        optimizer_steps=int(shared_steps[0]),
        step=position.step,
        epoch=position.epoch,
        epoch_step=position.epoch_step,
        config=config,
        seed=seed,
    )


class State:
    """The run's state as the survivors of a lost rank agree on it (Horovod's elastic ``State``).

    * commit: the loop moves :attr:`position` after every step, and the
      strategies keep what only they hold as they go (a ps-sync ps's previous
      shard), so that no recovery needs a file;
    * :meth:`restore`: the chief's position, and each survivor's part of the
      state at the chief's step (the strategy's ``survivor_state``);
    * :meth:`sync`: the chief's state on every survivor, as an in-memory
      :class:`~mpidist.store.checkpoint.Checkpoint`, which the reset
      callbacks resume from exactly as ``--resume`` resumes a file on
      another number of ranks.

    Args:
        config: the run's settings.
        position: the run's :class:`~mpidist.loop.position.Position` (the loop's own object).
    """

    def __init__(self, config, position):
        self.config, self.position = config, position
        self.cluster = self.setup = self.strategy = None
        self.revoked = []  # communicators besides the cluster's that survivors may be blocked in
        self.recoveries = []  # each loss survived ("recovered" events)
        # what the strategies count (their stats()): outlives a recovery, as the position does
        self.counts = {}
        self.callbacks = {"reset": [], "give_up": [], "recovered": [], "finish_writes": [], "leave": []}

    def bind(self, cluster, setup, strategy):
        """What the run is made of now: its ranks, its set-up (data, model) and its strategy."""
        self.cluster, self.setup, self.strategy = cluster, setup, strategy

    def register(self, event, callback):
        """Call ``callback`` on ``event``: ``reset(cluster, checkpoint)`` (build the loop again for the
        survivors), ``give_up(message)`` (a lost chief or ps ends the run), ``recovered(record)``,
        ``finish_writes()`` (before a rollback or giving up: finish the checkpoint being written), ``leave()``
        (this rank survived but cannot train on: let go of what it holds)."""
        self.callbacks[event].append(callback)

    def _fire(self, event, *args):
        for callback in self.callbacks[event]:
            callback(*args)

    def restore(self, world, cluster):
        """Collective: ``(the agreed Position, the strategy's state at that step on the chief)``.

        The chief's position, unless the strategy's ranks agree on a step one
        away from it (:meth:`~mpidist.parallel.recovery.Recovery.survivors_step`).
        """
        position = share_position(world, cluster.chief_rank, self.position)
        recovery = self.strategy.recovery()
        step = recovery.survivors_step(cluster, position.step)
        position = position.shifted(step - position.step, self.setup.steps_per_epoch)
        return position, recovery.survivor_state(cluster, step)

    def sync(self, world, cluster, position, held):
        """Collective: the chief's ``held`` state as a checkpoint on every survivor."""
        model, config = self.setup.model, self.config
        names = list(self.strategy.optimizer.state_arrays())
        return share(
            world,
            cluster.chief_rank,
            held,
            position,
            names,
            model.num_params,
            model.dtype,
            dataclasses.asdict(config),
            config.seed,
        )

    def recover(self):
        """Collective over the survivors of a lost rank: shrink, agree on the state at the chief's step, go
        on.

        A lost ps, or a chief the others cannot replace, is replaced by a
        rollback to the newest checkpoint where :meth:`_rollback_point` finds
        one; otherwise it ends every survivor with exit code 1 (their state
        is held nowhere else); the message names the newest checkpoint.
        """
        began, old, config = time.perf_counter(), self.cluster, self.config
        world, lost = shrink(
            old.world, [old.role_comm] + self.revoked + self.strategy.recovery().communicators()
        )
        lost_text = describe_lost(lost, old)
        chief_lost = old.chief_rank in lost and not self.strategy.chief_replaceable
        ps_lost = any(old.roles[rank] == PS for rank in lost)
        # survivors that cannot train on (a pipeline replica's other stages)
        idle = self.strategy.recovery().left_idle(lost)
        gone = sorted(set(lost) | set(idle))
        trains_on = any(old.roles[rank] == WORKER and rank not in gone for rank in range(old.size))
        if idle and trains_on:
            world = self._set_aside(world, old.rank in idle)
        cluster = old.survivors(world, gone) if trains_on else None
        held_nowhere = ps_lost or chief_lost  # (only going back to a checkpoint replaces what they held)
        if held_nowhere or cluster is None:
            # the chief's checkpoint written behind training is finished first: it is the newest to go back or
            # resume from (giving up would drop it, gathered and half written, and name the one before)
            self._fire("finish_writes")
            world.Barrier()
        rollback = self._rollback_point(world, cluster) if held_nowhere and cluster is not None else None
        if (held_nowhere and rollback is None) or cluster is None:
            why = (
                f"every replica lost a rank, and the others ({describe_lost(idle, old)}) hold only part of "
                "the model"
                if idle
                else None
            )
            message = cannot_go_on(lost_text, newest_checkpoint(config.checkpoint_dir), why)
            self._fire("give_up", message)
            if world.Get_rank() == 0:
                sys.stderr.write(error_line(message) + "\n")
            exit_after_failure(EXIT_FAILURE)
        self.revoked = []
        if rollback is None:
            position, held = self.restore(world, cluster)
            self._fire("reset", cluster, self.sync(world, cluster, position, held))
            rolled_back = {}
        else:  # what was lost is in no survivor: every rank goes back to the newest checkpoint
            resume = checkpoint.load(rollback)
            position = Position(resume.step, resume.epoch, resume.epoch_step)
            rolled_back = {"rolled_back_to": str(rollback), "steps_lost": self.position.step - resume.step}
            self._fire("reset", cluster, resume)
        workers = data_layout(config, cluster)[0]
        record = {
            "step": position.step,
            "epoch": position.epoch + 1,
            "lost": lost_text,
            "lost_ranks": [old.origin[rank] for rank in lost],
            "workers": workers,
            **rolled_back,
            **(
                {"idle": describe_lost(idle, old), "idle_ranks": [old.origin[rank] for rank in idle]}
                if idle
                else {}
            ),
            "ps": cluster.roles.count(PS),
            "global_batch": config.batch_size,
            "local_batches": [data.local_batch_size(config.batch_size, workers, w) for w in range(workers)],
            "steps_per_epoch": self.setup.steps_per_epoch,
            "seconds": time.perf_counter() - began,
            # (the chief's data now: a larger share may stream where it was in memory, in the same order)
            "data": self.setup.reading.why if self.setup.reading else "",
        }
        self.recoveries.append(record)
        self._fire("recovered", record)

    def _set_aside(self, world, idle):
        """Collective over the survivors: the world of those that train on; an ``idle`` survivor never
        returns.

        It lets go of what it holds (``leave``: a chief its files and lock,
        before the new chief opens them) and waits, asleep, for the others'
        end (:func:`~mpidist.runtime.ulfm.exit_after_failure`).
        """
        if idle:
            self._fire("leave")
        kept = world.Split(MPI.UNDEFINED if idle else 0, key=world.Get_rank())
        if idle:
            exit_after_failure(EXIT_OK)
        return kept

    def _rollback_point(self, world, cluster):
        """Collective: the checkpoint every survivor goes back to after a lost ps (or a chief the others
        cannot replace), or None where there is none.

        Only where the strategy can (:attr:`~mpidist.parallel.declared.Declared.ps_rollback`), a ps is left to
        take the lost shard, and the run writes checkpoints: the chief (a new one, where it was lost) names
        the newest of the run's lineage, once the write in flight is finished (``finish_writes``, in
        :meth:`recover`)."""
        if not self.strategy.ps_rollback or PS not in cluster.roles or not self.config.checkpoint_dir:
            return None
        newest = newest_checkpoint(self.config.checkpoint_dir) if cluster.is_chief else None
        named = mpi.bcast_text(world, str(newest) if newest else "", root=cluster.chief_rank)
        return Path(named) if named else None


def run_with_recovery(state, run):
    """``run()`` to its end; with ``--elastic``, recover ``state`` from lost workers and run again (Horovod's
    ``run_fn``)."""
    while True:
        try:
            return run()
        except (MPI.Exception, ProcessLost) as err:  # (ProcessLost: a watcher's, where no call failed)
            if not is_failure(err, state.cluster.world):
                raise
            if not state.config.elastic:  # an MPI that reports deaths, but no --elastic: say so, end
                said = err.Get_error_string() if isinstance(err, MPI.Exception) else str(err)
                raise RunError(
                    f"a process of the job died ({said}); without --elastic the "
                    "run cannot go on: resume from the last checkpoint with --resume auto"
                ) from None
            try:
                state.recover()
            except MPI.Exception as again:  # within the recovery's few milliseconds: give up, clearly
                if not is_failure(again):
                    raise
                raise RunError(
                    "another process died while the survivors recovered from a loss: resume from "
                    "the last checkpoint with --resume auto"
                ) from None
