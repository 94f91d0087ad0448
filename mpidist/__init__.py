"""mpidist: train neural networks on many processes with MPI.

Parameter-server, allreduce and pipeline strategies on mpi4py, numpy/cupy and
h5py.  Launch a script that calls :func:`mpidist.train` (or ``python -m
mpidist``) with ``mpiexec -n N``::

    import mpidist
    from mpidist import nn

    def build(sample_shape, outputs):
        return [nn.Flatten(), nn.Dense(128), nn.ReLU(), nn.Dense(outputs)]

    result = mpidist.train(build, "digits", strategy="allreduce", epochs=5)
    if result.is_chief:
        print(result.test_accuracy)

Importing mpidist sizes the BLAS thread pool to this rank's share of the
node's cores (see :mod:`mpidist.runtime.threads`), whatever was imported before it.
"""

__version__ = "0.2.0"

try:
    from .runtime.threads import limit_blas_threads

    limit_blas_threads()  # before anything below imports numpy

    from . import nn  # (after the BLAS limit, on purpose)
    from .api import Result, evaluate, train
    from .data.arrays import ArrayData
    from .loop.callbacks import Callback, EarlyStopping
    from .runtime.errors import RunError, UsageError
    from .settings.config import Settings
    from .tools.predictions import Predictions, predict
except KeyboardInterrupt:
    import sys

    # Ctrl-C while MPI and the libraries load under ``python -m mpidist`` (argv[0] is "-m" until the module
    # is found): a stop, as in a run, not a traceback.  A program that imports mpidist keeps its interrupt.
    if sys.argv[:1] != ["-m"]:
        raise
    print("mpidist: stopped by SIGINT while starting", file=sys.stderr)
    raise SystemExit(3) from None  # (EXIT_PREEMPTED: mpidist.runtime.errors may not have loaded yet)

__all__ = [
    "train",
    "evaluate",
    "predict",
    "Predictions",
    "Settings",
    "Result",
    "ArrayData",
    "Callback",
    "EarlyStopping",
    "nn",
    "UsageError",
    "RunError",
    "limit_blas_threads",
    "__version__",
]
