"""``python -m mpidist``: make failures end the whole job, size BLAS, run the CLI.

Order matters: BLAS thread counts must be set before anything imports numpy
(OpenBLAS reads them once, at load), to the cores available per rank on this
node, so ranks sharing a node do not fight over cores (measured: 2 ranks with
2 BLAS threads each on 2 cores trained 10x slower than with 1).  Under Slurm,
``--cpus-per-task`` says it (``SLURM_CPUS_PER_TASK``).  Set OMP_NUM_THREADS
yourself to override.  Then the abort hook, before any work
that could fail, so no failure can leave ranks waiting.
"""

import os


def _limit_blas_threads():
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = node.Get_size()
    node.Free()
    # a Slurm task may be bound to its own cores, so the node's share would undercount
    threads = os.environ.get("SLURM_CPUS_PER_TASK") or str(max(1, len(os.sched_getaffinity(0)) // ranks_here))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


def main():
    _limit_blas_threads()
    from .errors import install_abort_on_exception

    install_abort_on_exception()
    from . import cli, elastic

    try:
        code = cli.main()
    except SystemExit as done:
        code = done.code
    if elastic.failure_seen():   # after a lost rank, MPI_Finalize can hang: end as the survivors agree
        elastic.exit_after_failure(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
