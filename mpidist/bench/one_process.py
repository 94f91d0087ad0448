"""The rows of one process (rank 0, while the other ranks sleep and leave the cores free).

* ``local``: mpidist's own step (``LocalStrategy.train_step``);
* ``hand-written``: :class:`~mpidist.bench.handwritten.HandwrittenMLP`, the
  floor for framework overhead (MLP models only);
* ``torch``: the same layers in PyTorch, where torch is installed (never a
  dependency);

all three alternating step by step from the same starting parameters, on
the BLAS threads of a rank's share of the node.  Where the process may use
more cores than that (one rank per node, as the others sleep here), ``local``
and ``torch`` again on every core: ``local, N threads`` and ``torch, N
threads``.
"""

import os

from threadpoolctl import threadpool_limits

from ..runtime.threads import limit_blas_threads
from . import reference
from .handwritten import handwritten_for
from .rows import _local, _row
from .timing import alternating, in_windows, release, sleep_until_released


def one_process_rows(world, name, batch, seconds, optimizer="sgd"):
    """``local``, ``hand-written`` and ``torch`` on rank 0 while the other ranks sleep (complete on rank
    0)."""
    rows = []
    if world.Get_rank() == 0:
        local, x, y, local_step = _local(name, batch, 0, optimizer)
        steps = {"local": local_step}
        hand = handwritten_for(local.model, batch) if optimizer == "sgd" else None
        if hand is not None:
            flat = x.reshape(batch, -1)
            steps["hand-written"] = lambda: hand.step(flat, y)
        torch_step = reference.torch_step(local.model, x, y) if optimizer == "sgd" else None
        if torch_step is not None:
            steps["torch"] = torch_step
        medians = alternating(steps, seconds)
        medians.update(_every_core(name, batch, seconds, optimizer))
        rows = [
            _row(name, label, 1, 1, batch, per_step, local.model.num_params)
            for label, per_step in medians.items()
        ]
        release(world)
    else:
        sleep_until_released(world)
    return rows


def _every_core(name, batch, seconds, optimizer):
    """``local, N threads`` and ``torch, N threads`` on all N cores of this process, alternating; nothing
    where a rank's share is every core already (one rank per node: the rows above are these)."""
    cores = len(os.sched_getaffinity(0))
    if cores <= limit_blas_threads():
        return {}
    local, x, y, local_step = _local(name, batch, 0, optimizer)
    steps = {f"local, {cores} threads": local_step}
    torch_step = reference.torch_step(local.model, x, y, threads=cores) if optimizer == "sgd" else None
    if torch_step is not None:
        steps[f"torch, {cores} threads"] = torch_step
    with threadpool_limits(limits=cores, user_api="blas"):
        medians = in_windows(steps, seconds)
    if torch_step is not None:  # (torch's pool back to a rank's share, for the rows that follow)
        reference.torch_threads(limit_blas_threads())
    return medians
