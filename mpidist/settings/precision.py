"""Where ``--precision bf16|fp16`` runs, and the one message that says so elsewhere.

A 16-bit run keeps a float32 master copy of the parameters beside the
16-bit model (:mod:`mpidist.nn.precision`).  The data-parallel step of
``local`` and ``allreduce`` trains it so, its gradients summed in 16 bits by
MPI (``Iallreduce`` per bucket: a node's one shared copy of the model or of
its gradients would need a master of its own); the layouts that split the
model, its state or its exchange have no master copy yet, and are refused.
"""

from ..nn.precision import compute_dtype
from ..runtime.errors import UsageError

#: the strategies whose step keeps a master copy
STRATEGIES = ("local", "allreduce")


def check_precision(settings):
    """Raise :class:`UsageError` where ``settings`` (a strategy chosen) ask for a 16-bit run where none
    runs."""
    precision = settings.precision
    if precision == "float32":
        return
    compute_dtype(precision, settings.dtype)  # (--dtype float64, or bf16 without ml_dtypes)
    if settings.strategy not in STRATEGIES:
        raise UsageError(
            f"--precision {precision} trains with --strategy {' or '.join(STRATEGIES)}, "
            f"not {settings.strategy} (run it with --precision float32)"
        )
    others = {
        f"--shard {settings.shard}": settings.shard != "none",
        f"--tensor {settings.tensor}": settings.tensor > 1,
        f"--compress {settings.compress}": settings.compress != "none",
        f"--exchange {settings.exchange}": settings.exchange in ("node", "shared-memory"),
        "--elastic": settings.elastic,
    }
    refused = [flag for flag, given in others.items() if given]
    if refused:
        raise UsageError(
            f"--precision {precision} runs with the plain data-parallel step (every worker a whole model, "
            f"gradients summed by MPI in {precision}), not with {', '.join(refused)}"
        )
