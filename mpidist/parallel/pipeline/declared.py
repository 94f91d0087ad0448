"""What the ``pipeline`` strategy *is*: its settings and the checks and layouts the set-up asks for before
any strategy exists (no MPI traffic); :mod:`mpidist.parallel.pipeline.strategy` is what it does."""

import numpy as np

from ...nn import Layer
from ...nn.sequential import walk
from ...nn.tensor import MASK_SOURCES
from ...runtime.errors import UsageError
from ..declared import Declared
from ..mesh import MeshShape
from ..parts import TENSOR, check_split, check_tensor
from ..registry import Option
from .balance import balance_by_parameters, layer_costs, parse_balance


def one_stage(settings, world_size):
    """Why ``--strategy pipeline`` is refused at ``--stages 1`` on several ranks: each rank a replica of
    the whole model, which is ``allreduce``; the stage counts that would make a pipeline of these ranks."""
    per_part = world_size // max(1, settings.tensor)
    counts = [str(count) for count in range(2, per_part + 1) if per_part % count == 0]
    parts = f" --tensor {settings.tensor}" if settings.tensor > 1 else ""
    choose = (
        f"give --stages {' or '.join(counts)}"
        if counts
        else f"run more ranks than --tensor {settings.tensor}"
    )
    return (
        f"--strategy pipeline on {world_size} ranks needs --stages P, the ranks that hold one replica's "
        "layers in turn: with --stages 1 every replica runs all its layers at once and no pipeline runs "
        f"(that is --strategy allreduce{parts}); {choose}"
    )


class PipelineDeclared(Declared):
    """The pipeline's declarations (:class:`~mpidist.parallel.declared.Declared`'s hooks, as a pipeline
    answers them)."""

    options = (
        Option("stages", 1, "pipeline: ranks per model replica, each holding consecutive layers"),
        Option("micro_batches", 4, "pipeline: micro-batches each replica's batch is cut into"),
        Option(
            "schedule",
            "1f1b",
            "pipeline: 1f1b (at most P micro-batches in flight) or gpipe (all M)",
            ("1f1b", "gpipe"),
        ),
        Option("balance", "", "pipeline: layers per stage, e.g. 3,3 ('' = balance by parameters)"),
        TENSOR,
    )

    @classmethod
    def check(cls, settings, world_size):
        if settings.stages < 1 or settings.micro_batches < 1:
            raise UsageError(
                f"--stages and --micro-batches must be at least 1, got {settings.stages} and "
                f"{settings.micro_batches}"
            )
        if settings.stages == 1 and world_size > 1:
            raise UsageError(one_stage(settings, world_size))
        if world_size % settings.stages:
            raise UsageError(
                f"--stages {settings.stages} does not divide the {world_size} ranks (ranks = stages x "
                "data-parallel replicas)"
            )
        check_tensor(settings, world_size, settings.stages)
        replicas = MeshShape(world_size, settings.stages, settings.tensor).size("replica")
        if settings.batch_size // replicas < settings.micro_batches:
            raise UsageError(
                f"--batch-size {settings.batch_size} over {replicas} replica(s) leaves "
                f"{settings.batch_size // replicas} samples per replica, fewer than "
                f"--micro-batches {settings.micro_batches}"
            )
        if settings.replication == "in-graph":
            raise UsageError(
                "--replication in-graph does not combine with --strategy pipeline (its first and "
                "last stages read the data)"
            )
        if settings.elastic and replicas < 2:
            raise UsageError(
                f"--elastic carries a pipeline on with the replicas a lost rank leaves whole, and "
                f"{world_size} ranks with --stages {settings.stages} make {replicas} replica: a lost "
                f"stage would end the run; run {2 * settings.stages} ranks or more (2+ replicas)"
            )

    @classmethod
    def layout_text(cls, settings, cluster):
        replicas = MeshShape(cluster.size, settings.stages, settings.tensor).size("replica")
        parts = f" x {settings.tensor} tensor parts" if settings.tensor > 1 else ""
        return (
            f"{settings.stages} stages{parts} x {replicas} replica(s) ({settings.schedule}, "
            f"{settings.micro_batches} micro-batches)"
        )

    @classmethod
    def data_layout(cls, settings, cluster):
        """A pipeline's ``P`` stages (and their parts) of one replica read the same shard (the first stage its
        samples, the last its labels)."""
        shape = MeshShape(cluster.size, settings.stages, settings.tensor)
        return shape.size("replica"), shape.coordinates(cluster.rank)[0]

    @classmethod
    def check_model(cls, settings, model):
        balance = parse_balance(settings, model) or balance_by_parameters(layer_costs(model), settings.stages)
        starts = np.concatenate([[0], np.cumsum(balance)]).astype(int)
        notes = []
        for stage, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            layers = model.layers[lo:hi]
            held = {id(node) for _, node in walk(layers)}
            for _, node in walk(layers):  # a mask source must run where its reader does
                for name in MASK_SOURCES:
                    source = getattr(node, name, None)
                    if isinstance(source, Layer) and id(source) not in held:
                        raise UsageError(
                            f"--stages {settings.stages}: {node!r} in stage {stage} reads its mask from "
                            f"{source!r}, which runs in another stage (layers {lo}-{hi - 1} here): put "
                            "them in one stage with --balance"
                        )
            if settings.tensor > 1:
                notes += check_split(layers, settings.tensor, f"stage {stage} (layers {lo}-{hi - 1})")
        return notes

    @classmethod
    def auto_rank(cls, settings, world_size):
        return 1 if settings.stages > 1 else None  # --stages asks for a pipeline

    @classmethod
    def check_slice(cls, settings, samples):
        if samples < settings.micro_batches:  # every micro-batch needs a sample
            raise UsageError(
                f"--accumulate {settings.accumulate} leaves slices of {samples} sample(s) per "
                f"replica, fewer than --micro-batches {settings.micro_batches}"
            )

    @classmethod
    def arguments(cls, settings, setup):
        return {
            "stages": settings.stages,
            "micro_batches": settings.micro_batches,
            "schedule_name": settings.schedule,
            "balance": parse_balance(settings, setup.model),
            "global_batch": settings.batch_size,
            "elastic": settings.elastic,
            "tensor": settings.tensor,
        }
