"""Evaluating and predicting with a model no rank can hold: split across the ranks as training splits it, each
rank reading its part.

``eval --stages S`` (and ``--tensor T``, and ``predict`` with the same flags) builds the layout training
builds for ``--strategy pipeline --stages S --tensor T`` (or ``allreduce --tensor T``) from the checkpoint's
settings: every rank makes the buffers of its stage or part alone, checks its share of a sharded checkpoint's
parts, reads its slices into place (:meth:`~mpidist.parallel.saved_state.SavedState.restore`), and the
replicas (``ranks / (S x T)``) each evaluate a share of the test split through their pipeline.  With
``--shard parameters`` (``allreduce --shard parameters --tensor T``'s layout) every rank holds a shard of each
unit of its part and gathers a unit at a time, the ranks running their shares' batches in step.  No rank holds
the whole model."""

import dataclasses

from ..nn import loss_for
from ..parallel import STRATEGIES, AllreduceStrategy, FullyShardedStrategy, PipelineStrategy, holding
from ..parallel.mesh import MeshShape
from ..runtime.agreement import agreed
from ..runtime.errors import UsageError
from ..runtime.memory import check_fits


def layout_settings(settings, ranks, stages, tensor, model, shard="none"):
    """``settings`` (a checkpoint's) with the split ``stages`` x ``tensor`` (each part sharded over the
    replicas where ``shard`` is "parameters"), checked for ``ranks`` ranks and ``model`` (a map of shapes);
    :class:`UsageError` naming the flag where they do not fit."""
    for flag, value in (("--stages", stages), ("--tensor", tensor)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{flag} {value!r}: give a number of ranks, 1 or more")
    if shard not in ("none", "parameters"):
        raise UsageError(f"--shard {shard!r}: give none or parameters")
    if shard == "parameters" and stages > 1:
        raise UsageError(
            "--shard parameters shards the replicas of a data-parallel layout: not with --stages"
        )
    split = dataclasses.replace(
        settings,
        strategy="pipeline" if stages > 1 else "allreduce",
        stages=stages,
        tensor=tensor,
        micro_batches=1,
        schedule="gpipe",
        balance="",
        elastic=False,
        replication="between-graph",
        shard=shard,
        reshard_after_forward=True,
        compress="none",
        exchange="mpi",
        batch_size=max(settings.batch_size, ranks),
    )
    if not MeshShape.divides(ranks, stages, tensor):
        raise UsageError(
            f"--stages {stages} x --tensor {tensor} does not divide the {ranks} ranks (ranks = stages "
            "x tensor parts x replicas)"
        )
    STRATEGIES[split.strategy].check(split, ranks)
    STRATEGIES[split.strategy].check_model(split, model)
    return split


def check_holds(settings, rank, ranks, model):
    """Refuse, naming what it needs, a part of ``model`` (a map of shapes) whose parameters do not fit in what
    this rank may hold (evaluation holds no gradients and no optimizer state)."""
    share = holding.held(settings, Ranks(rank, ranks), model, 0)
    # (--shard parameters: its slots of gathered units too)
    held = share.params + (share.gathered if settings.shard == "parameters" else 0)
    check_fits(
        held * model.dtype.itemsize,
        f"evaluating {share.part} ({share.params:,} of the model's {model.num_params:,} parameters)",
    )


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where a rank sits, as :func:`~mpidist.parallel.holding.held` reads it, before the cluster exists."""

    rank: int
    size: int

    @property
    def is_chief(self):
        return self.rank == 0

    @property
    def num_workers(self):
        return self.size

    @property
    def worker_index(self):
        return self.rank

    @property
    def local_size(self):
        return 1  # (its node unknown: priced as holding its own copy of what a node may share)

    nodes_alike = True


def data_share(rank, ranks, stages, tensor):
    """``(replica, replicas)``: whose share of the test split this rank reads (a replica's ranks read the
    same)."""
    shape = MeshShape(ranks, stages, tensor)  # (the grid the strategy's mesh makes)
    return shape.coordinates(rank)[0], shape.size("replica")


def split_strategy(settings, model, info, cluster):
    """Collective: the strategy holding this rank's part of ``model`` under ``settings`` (no optimizer)."""
    loss = loss_for(info.num_classes, model.xp)
    if settings.strategy == "pipeline":
        return PipelineStrategy(
            model,
            loss,
            None,
            cluster,
            seed=settings.seed,
            stages=settings.stages,
            micro_batches=1,
            schedule_name="gpipe",
            global_batch=settings.batch_size,
            tensor=settings.tensor,
        )
    if settings.shard == "parameters":
        units = int(settings.bucket_mb * (1 << 20))
        return FullyShardedStrategy(
            model, loss, None, cluster, seed=settings.seed, bucket_bytes=units, tensor=settings.tensor
        )
    return AllreduceStrategy(
        model, loss, None, cluster, seed=settings.seed, exchange="mpi", tensor=settings.tensor
    )


def evaluate(strategy, saved, batches, world):
    """Collective: ``saved``'s (a checkpoint, its arrays not read) figures over ``batches``, through
    ``strategy`` (:func:`split_strategy`); the same on every rank."""
    with agreed(world):  # (every rank's share checked before any rank reads a part another checked)
        saved.check_parts((world.Get_rank(), world.Get_size()))
    strategy.restore(saved)
    figures = strategy.evaluate(batches)
    # (a pipeline's figures are the chief's: its last stage sent them there)
    chief = strategy.cluster.chief_rank
    return world.bcast(figures if world.Get_rank() == chief else None, root=chief)


def gives_outputs(strategy):
    """Whether this rank gives its replica's outputs (:func:`outputs`): the last stage's first tensor part."""
    return strategy.mesh.is_last("stage") and strategy.mesh.index("part") == 0


def outputs(strategy, x):
    """Collective over this rank's replica: the model's outputs on the batch ``x`` where this rank
    :func:`gives_outputs` them (a device or host array), else None."""
    if isinstance(strategy, PipelineStrategy):
        out = strategy.forward_only(x)
    else:  # (a tensor group's parts all end with the whole outputs)
        out = strategy.model.forward(strategy.model.xp.asarray(x), training=False)
    return out if gives_outputs(strategy) else None
