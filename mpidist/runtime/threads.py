"""One BLAS thread pool per rank's share of the node's cores, however mpidist was imported.

Ranks sharing a node must not fight over its cores: measured here, 2 ranks
with 2 BLAS threads each on 2 cores trained 10x slower than with 1 each.
OpenBLAS and MKL read ``OMP_NUM_THREADS`` (and their own variables) once, when
numpy loads them, so:

* where numpy is not imported yet (``python -m mpidist``, or a script whose
  first import is ``mpidist``), the variables are set and the libraries start
  with the right size;
* where the user's script imported numpy first, its BLAS already runs its own
  pool: :mod:`threadpoolctl` (the standard library for this) shrinks it at run
  time; without threadpoolctl, one warning line says what to do.

The share is the cores this process may run on divided by the ranks on its
node; under Slurm ``--cpus-per-task`` says it (``SLURM_CPUS_PER_TASK``), since a
task may be bound to cores of its own.  Setting ``OMP_NUM_THREADS`` yourself
overrides it.
"""

import os
import sys

_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_threads = None  # the count chosen, once chosen
_inherited = {}  # the variables as this process found them, before it sized its own pool


def share_of_node():
    """BLAS threads for this rank: ``SLURM_CPUS_PER_TASK``, else its cores / ranks on its node."""
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, int(os.environ["SLURM_CPUS_PER_TASK"]))
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = node.Get_size()
    node.Free()
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def node_cores(node):
    """Collective over ``node`` (the ranks of one node): the cores its ranks may use between them (the union
    of their affinities), the same on each; more ranks than these share cores (oversubscribed)."""
    seen = set()
    for cores in node.allgather(sorted(os.sched_getaffinity(0))):  # (start-up: a few short lists)
        seen.update(cores)
    return len(seen)


def limit_blas_threads():
    """Size the BLAS pool of this process once (later calls do nothing); returns the thread count."""
    global _threads
    if _threads is None:
        chosen = os.environ.get("OMP_NUM_THREADS", "")
        _threads = int(chosen) if chosen.isdigit() and int(chosen) > 0 else share_of_node()
        if "numpy" in sys.modules:  # its BLAS is loaded and sized already: resize it in place
            _resize_loaded_pools(_threads)
        else:  # (not both: the environment is inherited by every process this one starts)
            for name in _VARIABLES:
                _inherited[name] = os.environ.get(name)
                if not os.environ.get(name):  # (one set by the user stays)
                    os.environ[name] = str(_threads)
    return _threads


def launch_environment(**extra):
    """This process's environment for ranks it launches (``mpiexec`` from a driver): the BLAS variables as
    this process found them, so that each rank sizes its own pool for its share of the node, not this
    process's (one process owning every core would give each of N ranks every core: N times too many
    threads)."""
    environ = dict(os.environ)
    for name, value in _inherited.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    environ.update(extra)  # (what the caller sets wins)
    return environ


def _resize_loaded_pools(threads):
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        sys.stderr.write(
            f"mpidist: warning: numpy was imported before mpidist, so its BLAS may run more threads "
            f"than this rank's {threads} core(s), which slows training many times over: import "
            "mpidist first, set OMP_NUM_THREADS, or pip install threadpoolctl\n"
        )
        return
    threadpool_limits(limits=threads, user_api="blas")
    threadpool_limits(limits=threads, user_api="openmp")
