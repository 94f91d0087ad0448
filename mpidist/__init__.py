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

from .runtime.threads import limit_blas_threads

limit_blas_threads()  # before anything below imports numpy

from . import nn  # noqa: E402  (after the BLAS limit, on purpose)
from .api import Result, evaluate, train  # noqa: E402
from .data.arrays import ArrayData  # noqa: E402
from .loop.callbacks import Callback, EarlyStopping  # noqa: E402
from .runtime.errors import RunError, UsageError  # noqa: E402
from .settings.config import Settings  # noqa: E402
from .tools.predictions import Predictions, predict  # noqa: E402

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
