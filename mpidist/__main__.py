"""``python -m mpidist``: make failures end the whole job, size BLAS, run the CLI.

Order matters: the abort hook comes first so no later failure can leave ranks
waiting; BLAS thread counts are set before numpy is imported, to the cores
available per rank on this node, so oversubscribed ranks do not fight over
cores (set OMP_NUM_THREADS yourself to override).
"""

import os


def _limit_blas_threads():
    from mpi4py import MPI

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = node.Get_size()
    node.Free()
    threads = str(max(1, len(os.sched_getaffinity(0)) // ranks_here))
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, threads)


def main():
    from .errors import install_abort_on_exception

    install_abort_on_exception()
    _limit_blas_threads()
    from . import cli

    return cli.main()


if __name__ == "__main__":
    raise SystemExit(main())
