"""BatchNorm statistics summed over the workers (``BatchNorm(sync=True)``): one Allreduce each."""

from ..nn import BatchNorm
from ..nn.sequential import walk
from ..runtime import comm as mpi


def synchronise_batch_norms(model, comm):
    """Make every ``BatchNorm(sync=True)`` of ``model`` sum its statistics over ``comm`` (one Allreduce each).

    With ``comm`` None (one worker) they keep their local statistics, which then are the global ones.
    """
    for _, layer in walk(model.layers):
        if isinstance(layer, BatchNorm) and layer.sync and comm is not None:
            layer.reduce = lambda array, comm=comm: mpi.allreduce_sum(comm, array)
