"""What every parameter-server strategy shares (:class:`ShardedStrategy`): which ps owns which slice of the
flat buffer, the chief's initial parameters broadcast to everyone, and optimizer shards loaded from and
gathered into whole-model checkpoints."""

import numpy as np

from ...runtime import comm as mpi
from ...runtime.cluster import PS
from ...runtime.errors import UsageError
from ...runtime.xp import is_device_array, to_host
from ..base import Strategy
from ..recovery import Recovery
from ..registry import Option
from ..saved_state import WholeState
from ..shards import imbalance, shard_bounds


class ShardsGathered(Recovery):
    """A ps strategy's survivors: the state is the ps shards, the parameters' only sure copy, gathered."""

    def survivor_state(self, cluster, step):
        """Collective over the survivors: the ps shards, gathered on the chief."""
        return self.strategy.gather_state(None, cluster)


class ShardedStrategy(Strategy):
    """Base of the parameter-server strategies: shard bookkeeping, initial state, checkpoints."""

    options = (Option("ps", 0, "parameter-server ranks, for the ps strategies"),)
    recovery_type = ShardsGathered

    @classmethod
    def layout_text(cls, settings, cluster):
        # (after a lost ps: those left)
        return f"{cluster.num_workers} worker(s) and {cluster.roles.count(PS)} ps"

    @classmethod
    def check(cls, settings, world_size):
        if settings.ps < 1:
            raise UsageError(f"--strategy {settings.strategy} needs parameter servers: add --ps K (K >= 1)")
        if world_size < settings.ps + 1:
            raise UsageError(
                f"--ps {settings.ps} needs at least {settings.ps + 1} ranks (the ps ranks and a "
                f"worker), got {world_size}"
            )
        if (
            settings.replication == "in-graph"
            and not cls.variant(settings, world_size - settings.ps).lockstep
        ):
            raise UsageError(
                "--replication in-graph feeds every worker at each step in lock-step; it does not "
                "combine with workers that run independently (ps-async, --aggregate below the "
                "worker count)"
            )

    def shard(self, count):
        """Cut ``count`` elements among the ps ranks; sets ``ps_ranks``, ``bounds`` and this rank's ``lo,
        hi``."""
        cluster = self.cluster
        self.ps_ranks = [rank for rank, role in enumerate(cluster.roles) if role == PS]
        if not self.ps_ranks:
            raise ValueError(f"{self.name} needs at least one ps rank")
        self.bounds = shard_bounds(count, len(self.ps_ranks))
        self.lo, self.hi = self.bounds[self.ps_ranks.index(cluster.rank)] if cluster.role == PS else (0, 0)

    @property
    def imbalance(self):
        """Largest shard over the mean, minus one."""
        return imbalance(self.bounds)

    def shard_of(self, rank):
        """``(lo, hi)`` of world rank ``rank``'s shard, or None for a worker."""
        return tuple(self.bounds[self.ps_ranks.index(rank)]) if rank in self.ps_ranks else None

    def describe(self, rank):
        """A ps rank's shard in the role table ('' for a worker)."""
        shard = self.shard_of(rank)
        return f"shard [{shard[0]}, {shard[1]})" if shard else ""

    def layout(self, clip=None, cluster=None):
        """Per world rank ``(counts, displs)`` of the ps shards (0 for workers), for v-collectives.

        ``clip`` cuts shards at that element (the parameters, without a trailing loss slot);
        ``cluster`` gives the ranks (default: this strategy's; after a lost rank, the survivors').
        """
        cluster = cluster or self.cluster
        ps_ranks = [rank for rank, role in enumerate(cluster.roles) if role == PS]
        counts = np.zeros(cluster.size, dtype=np.int64)
        displs = np.zeros(cluster.size, dtype=np.int64)
        for (lo, hi), rank in zip(self.bounds, ps_ranks):
            end = hi if clip is None else min(hi, clip)
            counts[rank], displs[rank] = max(end - lo, 0), lo
        return counts, displs

    def broadcast_initial(self, buffer, checkpoint=None):
        """Collective: the chief's initial (or ``checkpoint``'s) parameters in ``buffer[:n]`` on every rank.

        ``buffer`` is the model's own parameter buffer, or a host mirror of
        device parameters (then both are kept equal); optimizer shards are
        loaded from ``checkpoint`` too.
        """
        cluster, model = self.cluster, self.model
        n = model.num_params
        mirror = is_device_array(model.params) and not is_device_array(buffer)
        if cluster.is_chief:
            if checkpoint is None:
                model.init_params(self.passes.seed)
            else:
                model.params[...] = model.xp.asarray(checkpoint.params)
            if mirror:
                buffer[:n] = to_host(model.params)
        mpi.bcast(cluster.world, buffer, root=cluster.chief_rank)
        if mirror:
            model.params[...] = model.xp.asarray(buffer[:n])
        if checkpoint is not None and self.optimizer is not None:
            end = min(self.hi, n)
            state = {name: array[self.lo : end] for name, array in checkpoint.optimizer_state.items()}
            self.optimizer.load_state(state, checkpoint.optimizer_steps)

    def gather_on_first_ps(self, shard):
        """Collective over the ps ranks only: the first ps gets the
        :class:`~mpidist.parallel.saved_state.WholeState`.

        For checkpoints taken while the workers train on: ``shard`` is this
        ps's parameter slice.  The optimizer step count is the first ps's.
        """
        comm, n = self.cluster.role_comm, self.model.num_params
        counts = np.array([max(min(hi, n) - lo, 0) for lo, hi in self.bounds], dtype=np.int64)
        displs = np.array([lo for lo, _ in self.bounds], dtype=np.int64)
        arrays = self._gather_whole(
            comm, 0, counts, displs, {"params": shard, **self.optimizer.state_arrays()}
        )
        return (
            WholeState(arrays.pop("params"), arrays, int(self.optimizer.steps))
            if comm.Get_rank() == 0
            else None
        )

    def _gather_whole(self, comm, root, counts, displs, parts):
        """Collective over ``comm``: ``root`` gets each of ``parts`` (name -> this rank's slice) as a whole
        array.

        Rank ``r`` sends the first ``counts[r]`` elements of its slice; other ranks get an empty dict.
        """
        n, is_root = self.model.num_params, comm.Get_rank() == root
        mine = int(counts[comm.Get_rank()])
        whole = {
            name: mpi.gatherv(
                comm,
                to_host(part)[:mine],
                np.zeros(n, dtype=self.model.dtype) if is_root else None,
                counts,
                displs,
                root,
            )
            for name, part in parts.items()
        }
        return whole if is_root else {}

    def gather_state(self, params, cluster=None):
        """Collective over ``cluster`` (default: this strategy's): the
        :class:`~mpidist.parallel.saved_state.WholeState` on its chief.

        ``params``: the whole flat parameters as the chief holds them, or None
        to gather them from the ps shards too (:meth:`shard_params`) -- after a
        lost rank, when the chief's copy may be half-updated.
        """
        cluster = cluster or self.cluster
        # the loss slot is no parameter
        counts, displs = self.layout(clip=self.model.num_params, cluster=cluster)
        parts = dict(self.optimizer.state_arrays())
        if params is None:
            parts["params"] = self.shard_params()
        arrays = self._gather_whole(cluster.world, cluster.chief_rank, counts, displs, parts)
        steps = np.array([self.optimizer.steps], dtype=np.int64)
        mpi.bcast(cluster.world, steps, root=cluster.roles.index(PS))
        if not cluster.is_chief:
            return None
        params = arrays.pop("params") if params is None else to_host(params).copy()
        return WholeState(params, arrays, int(steps[0]))

    def shard_params(self):
        """This ps's parameter slice (empty on workers)."""
        raise NotImplementedError
