"""What ``--strategy allreduce`` is, whichever class runs it: its name, its settings and their checks, and
whose data each rank reads.

Replicated workers (:class:`~mpidist.parallel.data.allreduce.AllreduceStrategy`)
and fully sharded ones (``--shard parameters``,
:class:`~mpidist.parallel.data.fully_sharded.FullyShardedStrategy`) are one
strategy to the settings: these declarations are theirs alike.
"""

from ...runtime.errors import UsageError
from ..declared import Declared
from ..mesh import MeshShape
from ..parts import TENSOR, check_split, check_tensor
from ..registry import Option


class AllreduceDeclared(Declared):
    """What ``allreduce`` is, in each of its layouts: its settings and their checks, and whose data each rank
    reads (the replicated strategy and ``--shard parameters``'s share them)."""

    name = "allreduce"
    elastic_recovery = True
    chief_replaceable = True  # (--elastic refuses --shard: every worker holds the whole state)
    options = (
        Option(
            "compress",
            "none",
            "allreduce: send gradients as 16-bit floats, with error feedback "
            "(half the bytes; see the performance docs)",
            choices=("none", "fp16", "bf16"),
        ),
        Option(
            "exchange",
            "auto",
            "allreduce: how gradients are summed: 'node' (one copy of the model per "
            "node in shared memory, each rank summing and updating 1/L of it, "
            "a ring between nodes), 'shared-memory' (every worker on one node "
            "and its own copy: the gradients in one shared window, summed in "
            "place), 'mpi' (Iallreduce per bucket, overlapped with backward), "
            "'auto' (on GPUs a GPU each: NCCL's sums where every worker has NCCL; else the first of "
            "these that can serve; mpi with --compress). With --shard "
            "parameters: 'node' gathers each unit once per node, in shared memory, between "
            "nodes by each local rank's slice; 'mpi' on every worker; 'auto' the first that serves",
            choices=("auto", "node", "shared-memory", "mpi"),
        ),
        Option(
            "shard",
            "none",
            "allreduce: 'optimizer' keeps each worker's optimizer state for its slice "
            "of the model alone (ZeRO stage 1: the state per worker / W; each worker "
            "updates its slice, then an Allgatherv shares them); 'parameters' keeps 1/W "
            "of every unit's parameters, gradients and optimizer state on each worker, a "
            "unit gathered just before it runs (ZeRO stage 3, FSDP); 'none': every worker "
            "holds and updates all of it",
            choices=("none", "optimizer", "parameters"),
        ),
        Option(
            "reshard_after_forward",
            True,
            "allreduce --shard parameters: let each unit's gathered parameters go after its "
            "forward and gather them again for its backward (two units gathered at most); "
            "--no-reshard-after-forward keeps every unit from forward to backward (one "
            "gather a step, the whole model's parameters held while it runs)",
        ),
        TENSOR,
    )

    @classmethod
    def auto_rank(cls, settings, world_size):
        return 3  # what auto runs when nothing asks for another

    @classmethod
    def check(cls, settings, world_size):
        check_exchange(settings.exchange, settings.compress, settings.elastic)
        if settings.shard != "none" and settings.elastic:
            held = "optimizer state" if settings.shard == "optimizer" else "parameters and optimizer state"
            raise UsageError(
                f"--shard {settings.shard} keeps a slice of the {held} on one worker alone, which a lost "
                "worker would take with it: not with --elastic"
            )
        if not settings.reshard_after_forward and settings.shard != "parameters":
            raise UsageError("--no-reshard-after-forward applies to --shard parameters alone")
        if settings.shard == "parameters":
            check_fully_sharded(settings)
        check_tensor(settings, world_size)

    @classmethod
    def check_model(cls, settings, model):
        if settings.shard == "parameters" and model.running_entries():
            raise UsageError(
                f"--shard parameters: --model {settings.model} keeps running statistics (BatchNorm), "
                "which each worker updates in its forward pass and a shard would drop; use a layer "
                "norm, or --shard optimizer"
            )
        return (
            check_split(model.layers, settings.tensor, f"--model {settings.model}")
            if settings.tensor > 1
            else []
        )

    @classmethod
    def data_layout(cls, settings, cluster):
        """The ``T`` parts of a tensor group read the same shard: the groups are the data-parallel workers."""
        if cluster.worker_index is None:
            return super().data_layout(settings, cluster)
        shape = MeshShape(cluster.num_workers, parts=settings.tensor)
        return shape.size("replica"), shape.coordinates(cluster.worker_index)[0]

    @classmethod
    def layout_text(cls, settings, cluster):
        replicas = MeshShape(cluster.num_workers, parts=settings.tensor).size("replica")
        text = (
            super().layout_text(settings, cluster)
            if settings.tensor == 1
            else f"{replicas} worker(s) x {settings.tensor} tensor parts"
        )
        held = f", each rank holding 1/{replicas * settings.tensor} of the model"
        return text + (held if settings.shard == "parameters" else "")

    @classmethod
    def arguments(cls, settings, setup):
        # elastic: a lost worker must surface as MPI's process-failure error, which only MPI's collectives
        # give (a tensor run's gradients are summed by MPI: the node's shared windows hold whole models)
        return {
            "compress": settings.compress,
            "exchange": "mpi" if settings.elastic or settings.tensor > 1 else settings.exchange,
            "shard": settings.shard,
            "tensor": settings.tensor,
        }


def check_exchange(exchange, compress, elastic=False):
    """Refuse ``--exchange node`` or ``shared-memory`` where it cannot serve (a UsageError naming the
    conflict)."""
    if exchange not in ("node", "shared-memory"):
        return
    if compress != "none":
        raise UsageError(
            f"--exchange {exchange} sums in shared memory, so there is nothing for "
            f"--compress {compress} to compress: use --exchange mpi (or auto) with --compress"
        )
    if elastic:
        raise UsageError(
            f"--exchange {exchange} does not survive a lost worker (MPI's shared-memory windows "
            "are not fault tolerant): use --exchange mpi or auto with --elastic"
        )


def check_fully_sharded(settings):
    """Refuse what ``--shard parameters`` cannot run with (a UsageError naming it)."""
    refused = [
        (
            settings.compress != "none",
            f"--compress {settings.compress}",
            "its shards are summed by a Reduce_scatter of full-precision gradients",
        ),
        (
            settings.exchange == "shared-memory",
            "--exchange shared-memory",
            "its workers hold no whole copy of the gradients to sum in one window: use --exchange node "
            "(each unit gathered once per node), mpi or auto",
        ),
        (
            settings.replication == "in-graph",
            "--replication in-graph",
            "its workers gather each unit together at every step, on batches of their own",
        ),
    ]
    for refused_it, what, why in refused:
        if refused_it:
            raise UsageError(f"--shard parameters does not combine with {what}: {why}")
