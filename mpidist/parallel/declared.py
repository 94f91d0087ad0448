"""What a strategy *is*: the declarations each strategy class makes once, and the classmethods the settings
and the set-up call before any strategy exists (no MPI traffic).

:class:`~mpidist.parallel.base.Strategy` (what a strategy *does*, step by
step) extends it; the registry (:mod:`mpidist.parallel.registry`) keeps the
classes by name, and :mod:`mpidist.settings` and the loop's set-up read
these, so neither names strategies one by one.
"""

from .recovery import Recovery


class Declared:
    """The class-level declarations and settings hooks of a strategy (each subclass overrides what
    differs)."""

    # -- What the strategy is: declared once by each subclass; the loop and the settings read them --
    #: The ``--strategy`` name (None: not registered).
    name = None
    #: The settings only this strategy (and its subclasses) uses: its
    #: :class:`~mpidist.parallel.registry.Option`\ s.
    options = ()
    #: "sharded": every worker evaluates its shard of the test split and the
    #: counts are summed; "chief": the chief alone evaluates the whole split
    #: (for strategies whose workers must never wait for each other).
    evaluation = "sharded"
    #: True where every rank takes each step together (so they can agree on
    #: when to stop or checkpoint at a step boundary, see mpidist.runtime.preempt).
    lockstep = True
    #: True on ranks that run :meth:`serve` instead of training steps (the ps
    #: ranks of ps-async and of backup workers).
    serves = False
    #: Whether the strategy carries running statistics (BatchNorm's, updated by the
    #: workers' forward passes, never by the optimizer) into the parameters it serves.
    running_statistics = True
    #: Whether survivors can carry on under ``--elastic`` when workers die.
    elastic_recovery = False
    #: Whether every worker holds all the chief holds (parameters, optimizer state, position), so that under
    #: ``--elastic`` a lost chief is replaced by the lowest surviving worker (as Horovod's elastic mode does).
    chief_replaceable = False
    #: Whether under ``--elastic`` a lost ps is survived by every rank going back to the newest checkpoint,
    #: its shard re-divided among the ps ranks left (the lost shard is in no survivor); so is a lost chief
    #: that is not :attr:`chief_replaceable` (the lowest surviving worker takes its place).
    ps_rollback = False
    #: What the strategy does for the survivors of a lost rank (``--elastic``): a
    #: :class:`~mpidist.parallel.recovery.Recovery` class, made around the strategy by :meth:`recovery`.
    recovery_type = Recovery
    #: This rank's regions of the whole model where the strategy splits it (a pipeline stage, a tensor part):
    #: its checkpoints are then sharded, each rank writing its own (:meth:`placed_state`); None elsewhere.
    placement = None

    # -- Before any strategy exists: classmethods the settings and the set-up call (no MPI traffic) --
    @classmethod
    def check(cls, settings, world_size):
        """Raise :class:`~mpidist.runtime.errors.UsageError` naming the first setting it cannot run with on
        ``world_size`` ranks."""

    @classmethod
    def variant(cls, settings, workers):
        """The class that runs ``settings`` with ``workers`` workers (a mode may have a class of its own)."""
        return cls

    @classmethod
    def data_layout(cls, settings, cluster):
        """``(data-parallel workers, this rank's index among them or None)``: whose shard each rank reads."""
        return cluster.num_workers, cluster.worker_index

    @classmethod
    def check_model(cls, settings, model):
        """Raise :class:`~mpidist.runtime.errors.UsageError` if ``model`` cannot run as ``settings`` say
        (local, no MPI); returns notes for the chief to say about how it runs (a list of lines)."""
        return []

    @classmethod
    def auto_rank(cls, settings, world_size):
        """Where ``--strategy auto`` ranks this strategy for ``settings`` on ``world_size`` ranks (the lowest
        rank is chosen), or None where auto never picks it."""
        return None

    @classmethod
    def title(cls, settings):
        """The strategy's name in messages, with the mode ``settings`` put it in (``ps-sync with
        --aggregate``)."""
        return cls.name

    @classmethod
    def clipped_steps(cls, counted):
        """The run's clipped steps from each rank's own count, where the strategy is not in lockstep: the
        largest (the ranks that decide count alike); strategies whose ranks clip apart add them up."""
        return max(counted, default=0)

    @classmethod
    def copies(cls, settings, cluster, arrays):
        """Arrays the size of the whole model this rank of ``cluster`` allocates beyond its training state
        (:mod:`~mpidist.parallel.holding`) and the chief's copies of a whole checkpoint, with an optimizer of
        ``arrays`` arrays: a server's windows, inboxes and the gradients it keeps, every worker's own state
        gathered.  What the start-up price adds (:mod:`mpidist.loop.pricing`); where a strategy's servers
        allocate as they serve, an upper bound measured on them (two model sizes, the slope rounded up)."""
        return 0

    @classmethod
    def check_slice(cls, settings, samples):
        """Raise :class:`~mpidist.runtime.errors.UsageError` if ``samples`` per ``--accumulate`` slice (the
        smallest worker's) are too few for this strategy (local, no MPI)."""

    @classmethod
    def layout_text(cls, settings, cluster):
        """How the ranks are used, in words, for the start-up line."""
        return f"{cluster.num_workers} worker(s)"

    @classmethod
    def arguments(cls, settings, setup):
        """Constructor keyword arguments from ``settings`` beyond those every strategy takes."""
        return {}
