"""Training on after workers die (``--elastic``): the recovery wrapper around the loop and its state.

All of the recovery lives here, around the loop, in the shape of Horovod's
elastic ``run_fn`` and ``State``: :func:`run_with_recovery` runs the loop
and, when a process dies, :func:`recover` makes the survivors agree on a
:class:`State` (commit, restore, sync) and enters the loop again from it.
Strategies take part only through ``survivor_state`` (restore: a ps-sync ps
takes back the one update the chief never saw, kept by its
:class:`~mpidist.parallel.ps_sync.PreviousShard`, the commit); the figures
they count live in a dict the loop owns, which outlives them.

When a blocking call reports a dead process (:mod:`mpidist.runtime.ulfm`),
the survivors recover:

1. :func:`~mpidist.runtime.ulfm.shrink`: revoke every communicator in use,
   so survivors blocked on each other are released too, and shrink the
   world to the survivors.
2. If the chief or a parameter server died, the run cannot go on (their
   state is not held anywhere else): every survivor ends with exit code 1
   and the message says to resume from the last checkpoint.
3. Otherwise the survivors rebuild the cluster (same roles), take the state
   the strategy holds at the chief's step (:func:`share`: an in-memory
   checkpoint, with the same layout as a file), re-divide the data, and go
   on; a checkpoint resumes on any number of workers, so this is the same,
   tested, path as ``--resume`` with fewer ranks.

``ps-async`` workers never block on each other: there the ranks watch for
deaths (:class:`~mpidist.runtime.ulfm.FailureWatch`), the first ps drops a
dead worker from the staleness bound, and the others never notice; the
survivors shrink at the end.  A dead ps or chief seen by a watcher ends the
job through the abort hook (a :class:`~mpidist.runtime.errors.RunError`).
"""

import dataclasses
import sys
import time

import numpy as np
from mpi4py import MPI

from ..runtime import comm as mpi
from ..store.checkpoint import Checkpoint
from ..runtime.errors import EXIT_FAILURE, RunError, error_line
from ..store.lineage import newest_checkpoint
from ..runtime.ulfm import cannot_go_on, describe_lost, exit_after_failure, is_failure, shrink


@dataclasses.dataclass
class Position:
    """Where the chief is: the run's step, its epoch and the step within it."""

    step: int
    epoch: int
    epoch_step: int

    def as_array(self):
        return np.array([self.step, self.epoch, self.epoch_step], dtype=np.int64)


def share_position(comm, root, position):
    """Collective: the chief's :class:`Position` on every rank."""
    values = position.as_array() if comm.Get_rank() == root else np.zeros(3, dtype=np.int64)
    mpi.bcast(comm, values, root=root)
    return Position(*(int(v) for v in values))


def share(comm, root, state, position, names, count, dtype, config, seed):
    """Collective: ``root``'s ``(params, optimizer arrays, optimizer steps)`` as a :class:`Checkpoint` on every rank.

    The same object a checkpoint file loads as, so the survivors resume
    through the path ``--resume`` takes (and tests) for any rank count.
    """
    def broadcast(array):
        buffer = np.ascontiguousarray(array, dtype=dtype) if comm.Get_rank() == root else np.empty(count, dtype)
        mpi.bcast(comm, buffer, root=root)
        return buffer

    params, arrays, steps = state if comm.Get_rank() == root else (None, {}, 0)
    shared_steps = np.array([steps], dtype=np.int64)
    mpi.bcast(comm, shared_steps, root=root)
    return Checkpoint(path="(memory: the survivors' state)", params=broadcast(params),
                      optimizer_state={name: broadcast(arrays.get(name)) for name in names},
                      optimizer_steps=int(shared_steps[0]), step=position.step, epoch=position.epoch,
                      epoch_step=position.epoch_step, config=config, seed=seed)


class State:
    """The run's state as the survivors of a lost rank agree on it (Horovod's elastic ``State``).

    * commit: made as the run goes, by the strategies (:class:`PreviousShard`),
      so that no recovery needs a file;
    * :meth:`restore`: each survivor's part of the state at the chief's step;
    * :meth:`sync`: the chief's state on every survivor, as an in-memory
      :class:`~mpidist.store.checkpoint.Checkpoint`, which the loop resumes from
      exactly as ``--resume`` resumes a file on another number of ranks.
    """

    def __init__(self, training, world, cluster):
        self.training, self.world, self.cluster = training, world, cluster

    def restore(self):
        """Collective: ``(the chief's Position, the strategy's state at that step on the chief)``."""
        training = self.training
        here = Position(training.step, training.epoch, training.epoch_step)
        position = share_position(self.world, self.cluster.chief_rank, here)
        return position, training.strategy.survivor_state(self.cluster, position.step)

    def sync(self, position, state):
        """Collective: the chief's ``state`` as a checkpoint on every survivor."""
        training = self.training
        model, config = training.setup.model, training.config
        names = list(training.strategy.optimizer.state_arrays())
        return share(self.world, self.cluster.chief_rank, state, position, names, model.num_params, model.dtype,
                     dataclasses.asdict(config), config.seed)


def run_with_recovery(training):
    """Run ``training`` to its end; with ``--elastic``, recover from lost workers and go on (Horovod's ``run_fn``)."""
    while True:
        try:
            return training.run_to_end()
        except MPI.Exception as err:
            if not is_failure(err, training.cluster.world):
                raise
            if not training.config.elastic:   # an MPI that reports deaths, but no --elastic: say so, end
                raise RunError(f"a process of the job died ({err.Get_error_string()}); without --elastic the "
                               "run cannot go on: resume from the last checkpoint with --resume auto") from None
            try:
                recover(training)
            except MPI.Exception as again:   # within the recovery's few milliseconds: give up, clearly
                if not is_failure(again):
                    raise
                raise RunError("another process died while the survivors recovered from a loss: resume from "
                               "the last checkpoint with --resume auto") from None


def recover(training):
    """Collective over the survivors of a lost rank: shrink, agree on the state at the chief's step, go on.

    A lost chief or ps ends every survivor with exit code 1 (their state is
    held nowhere else); the message names the newest checkpoint.
    """
    from .setup import data_layout
    from ..runtime.cluster import PS
    from ..data import local_batch_size

    began = time.perf_counter()
    old, config = training.cluster, training.config
    in_use = [old.role_comm] + ([training.agreement.comm] if training.agreement else [])
    world, lost = shrink(old.world, in_use)
    lost_text = describe_lost(lost, old)
    if any(old.roles[rank] == PS or rank == old.chief_rank for rank in lost):
        message = cannot_go_on(lost_text, newest_checkpoint(config.checkpoint_dir))
        training.give_up(message)
        if world.Get_rank() == 0:
            sys.stderr.write(error_line(message) + "\n")
        exit_after_failure(EXIT_FAILURE)
    cluster = old.survivors(world, lost)
    state = State(training, world, cluster)
    position, held = state.restore()
    training.continue_from(cluster, state.sync(position, held))
    workers = data_layout(config, cluster)[0]
    record = {"step": position.step, "epoch": position.epoch + 1, "lost": lost_text,
              "lost_ranks": [old.origin[rank] for rank in lost], "workers": workers, "ps": config.ps,
              "global_batch": config.batch_size,
              "local_batches": [local_batch_size(config.batch_size, workers, w) for w in range(workers)],
              "steps_per_epoch": training.setup.steps_per_epoch, "seconds": time.perf_counter() - began}
    training.recoveries.append(record)
    if training.chief:
        training.log.write("recovered", **record)
        split = "/".join(map(str, record["local_batches"]))
        training.say(f"mpidist: lost {lost_text}; continuing from step {position.step} with {workers} "
                     f"worker(s): global batch {config.batch_size} split {split}, "
                     f"{training.setup.steps_per_epoch} steps/epoch (recovered in {record['seconds']:.2f} s)")
