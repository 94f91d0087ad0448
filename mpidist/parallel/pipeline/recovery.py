"""A pipeline's survivors of a lost rank (``--elastic``): the replicas a lost rank left whole go on.

A lost rank breaks its replica (its layers are in no other rank of it):
that replica's survivors wait idle for the end, and the other replicas,
which hold every stage's state, agree on one step (a death may break a
step's collective on some ranks only, so a stage may be one update ahead:
it takes it back) and carry on.
"""

import numpy as np

from ...runtime import comm as mpi
from ..recovery import Recovery


class ReplicasLeftWhole(Recovery):
    """The survivors' side of a :class:`~mpidist.parallel.pipeline.strategy.PipelineStrategy`."""

    def communicators(self):
        """The mesh's splits (the pipe and the replicas' groups), and the IPC links' communicators."""
        return self.strategy.mesh.owned() + self.strategy.links.owned()

    def abandon(self):
        """The base's, and the IPC links' device memory let go (without MPI)."""
        super().abandon()
        self.strategy.links.abandon()

    def left_idle(self, lost):
        """The survivors in a replica that lost a stage: its layers are in no rank of it any more."""
        replica_of, ranks = self.strategy.layout.replica_of, self.strategy.cluster.size
        broken = {replica_of(rank) for rank in lost}
        return [rank for rank in range(ranks) if replica_of(rank) in broken and rank not in lost]

    def survivors_step(self, cluster, step):
        """Collective over the replicas left whole: the least step any of their stages is at.

        A death may break a step's collective on some ranks only, so a stage
        may be one update ahead of another (or of the chief's position); the
        ones ahead take it back (:meth:`survivor_state`).
        """
        steps = np.array([self.strategy.ledger.step], dtype=np.int64)
        mpi.allreduce_min(cluster.world, steps)
        return int(steps[0])

    def survivor_state(self, cluster, step):
        """Collective over the replicas left whole: every stage at ``step``; the new replica 0's slices,
        whole, on the chief."""
        strategy = self.strategy
        strategy.ledger.rewind_to(step, strategy.model.params, strategy.optimizer)
        return strategy.gathered(cluster)
