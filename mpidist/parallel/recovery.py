"""What a strategy does for the survivors of a lost rank (``--elastic``): an object of its own.

Horovod's elastic ``State`` is a few methods around the training objects
(commit, restore, sync); the elastic wrapper (:mod:`mpidist.loop.elastic`)
plays that part here, and asks the strategy's :class:`Recovery` what only
the strategy knows: which communicators of its own to revoke, which
survivors cannot train on, the step the survivors' state is taken at, and
that state.  A strategy whose ranks recover otherwise returns its own
subclass from :meth:`~mpidist.parallel.base.Strategy.recovery`, beside the
code it calls back into.
"""


class Recovery:
    """The survivors' side of a strategy after a lost rank: by default, a strategy whose chief holds the
    whole state and whose communicators are the cluster's.

    Args:
        strategy: the strategy that lost a rank (its MPI objects are the broken world's).
    """

    def __init__(self, strategy):
        self.strategy = strategy

    def communicators(self):
        """Communicators of the strategy's own its ranks may block in: a recovery revokes them too."""
        return []

    def left_idle(self, lost):
        """Ranks of the strategy's cluster that survive ``lost`` but cannot train on (a pipeline's broken
        replica)."""
        return []

    def survivors_step(self, cluster, step):
        """Collective over the survivors: the step their state is taken at (the chief's ``step``, by
        default)."""
        return step

    def survivor_state(self, cluster, step):
        """Collective over the survivors (``cluster``): the state at the chief's ``step``.

        A :class:`~mpidist.parallel.saved_state.WholeState` on the chief, else
        None.  By default the strategy's own :meth:`state`: its chief holds it
        all already.
        """
        return self.strategy.state()

    def abandon(self):
        """Stop the strategy's threads, without MPI: its MPI objects are the broken world's, where a
        collective free would wait for the dead."""
