"""``ps-async --elastic``: the watch for dead ranks, what a death means, and what the survivors let go of.

A ps-async rank is never in a collective while it trains, so nothing of
MPI's own reports a death: every rank polls for one (:class:`LostRanks`),
and a guard gets it out of a one-sided operation that a dead rank holds up.
"""

from ...runtime.errors import EXIT_FAILURE, error_line
from ...runtime.ulfm import (
    FailureWatch,
    ProcessLost,
    StuckGuard,
    cannot_go_on,
    describe_lost,
    end_the_job,
    end_this_process,
)
from .async_rounds import sort_lost
from .sharded import ShardsGathered


class LostRanks:
    """``--elastic``: the watch for dead ranks, what a death means, and the guard of the windows' operations.

    The first ps retires a dead worker's clock, so that the others never wait
    for it, and notes it in ``figures["dropped_workers"]``.  A dead ps or
    chief, where a ps is left and there are checkpoints (``rollback``),
    raises :class:`~mpidist.runtime.ulfm.ProcessLost` on every rank that
    sees it: they all recover together, back to the newest checkpoint, or,
    where there is none to go back to, end together with one line (exit 1).
    """

    def __init__(self, cluster, figures, elastic, rollback=False):
        self.cluster, self.figures, self.rollback = cluster, figures, rollback
        self.watch = FailureWatch(cluster.world) if elastic else None
        self.guard, self.guard_watch = (
            StuckGuard.on(cluster.world, end=self._held_for_good) if elastic else (None, None)
        )

    @property
    def watched(self):
        return self.watch is not None

    def look(self, serving, exchange):
        """Act on deaths since the last look (``serving``: the
        :class:`~mpidist.parallel.ps.async_rounds.Serving` that knows the run's step from the chief's
        clock)."""
        lost = self.watch.poll() if self.watch is not None else []
        if not lost:
            return
        cluster = self.cluster
        verdict = sort_lost(lost, cluster.roles, cluster.chief_rank, self.watch.known, self.rollback)
        # a ps or the chief: every survivor sees it and recovers together, back to a checkpoint or else to one
        # line and an agreed exit (an MPI_Abort left Open MPI's mpirun waiting for ever in ~1 run of 20)
        if verdict.recover or verdict.fatal:
            raise ProcessLost(describe_lost(verdict.fatal, cluster))
        if cluster.rank == exchange.ps_ranks[0]:
            step = serving.run_step(int(exchange.clocks()[0]))  # the chief's step is the run's
            for rank, worker in verdict.retired:
                exchange.retire(worker)  # its clock holds nobody back
                self.figures["dropped_workers"].append({"rank": cluster.origin[rank], "step": step})

    def _held_for_good(self, why):
        """The guard's end of this process, held for good in an operation at a dead target (from its thread).

        One more lost rank for the others (SIGKILL), unless the dead the guard
        knows of end the run anyway (a ps or the chief, and no checkpoint to go
        back to or no ps left): then the run's line and exit code 1, with which
        ``mpirun`` exits (every other rank held there ends itself alike).  A
        SIGKILL there left nobody to say it where every rank was held: the only
        ps killed while it held its inbox's lock held every worker at their next
        push, and ``mpirun`` exited 0 with no line.
        """
        cluster = self.cluster
        lost = sort_lost(sorted(self.guard_watch.known), cluster.roles, cluster.chief_rank, (), self.rollback)
        if not lost.fatal or lost.recover:
            end_this_process(why)
        end_the_job(error_line(cannot_go_on(describe_lost(lost.fatal, cluster))), EXIT_FAILURE)

    def abandon(self):
        """After a lost rank: stop the guard's thread; the watches' communicators are left to the broken
        world."""
        if self.guard is not None:
            self.guard.stop()

    def free(self):
        self.abandon()
        for watch in (self.watch, self.guard_watch):
            if watch is not None:
                watch.free()


class LostRanksLetGo(ShardsGathered):
    """ps-async's survivors: the ps shards, gathered; the guard's thread stopped when the strategy is left."""

    def abandon(self):
        # The windows (and the watches' communicators) are the broken world's: freeing one is collective over
        # it, a dead member never joins, and ULFM promises nothing of windows after a failure (Open MPI warns
        # that its shared-memory ones are untested there).  They are left: a few shard-sized segments, freed
        # at exit.
        self.strategy.lost.abandon()
