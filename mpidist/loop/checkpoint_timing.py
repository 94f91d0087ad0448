"""When a checkpoint is taken: the rule that says one is due (:class:`CheckpointSchedule`), and where ranks
step in lockstep, the decisions they take alike about a write behind training (:class:`CheckpointTiming`:
whether the one owed starts at a step, that it was taken, that the survivors of a lost rank start afresh).

The rule is pure (the clock is passed in) and tested without MPI; so are the
decisions, which read only each rank's own record of the boundaries it went
through (:class:`~mpidist.loop.writing_behind.Behind`).
"""


class CheckpointSchedule:
    """When a checkpoint is due.

    Args:
        every: steps between checkpoints (0: none by step count).
        seconds: seconds between checkpoints (0: none by time).
        step: the step the run starts at.
        now: the clock's reading at that start.
    """

    def __init__(self, every, seconds, step, now):
        self.every, self.seconds = int(every), float(seconds)
        self.last_step, self.last_time = int(step), float(now)

    @property
    def periodic(self):
        """Whether checkpoints come during the run at all (not only at its end)."""
        return bool(self.every or self.seconds)

    def crossed(self, step):
        """Whether ``step`` passed a multiple of ``every`` since the last step asked about."""
        passed = bool(self.every) and step // self.every > self.last_step // self.every
        self.last_step = max(self.last_step, step)
        return passed

    def timed(self, now):
        """Whether ``seconds`` passed since the last checkpoint that was due; restarts the wait if so."""
        if not self.seconds or now - self.last_time < self.seconds:
            return False
        self.last_time = now
        return True

    def due(self, step, now):
        """Either rule, as one ps decides for workers that are not in lockstep."""
        crossed, timed = self.crossed(step), self.timed(now)
        if crossed:
            self.last_time = now
        return crossed or timed


class CheckpointTiming:
    """The lockstep decisions about checkpoints written behind training (mixed into
    :class:`~mpidist.loop.checkpointer.Checkpointer`, whose ``config``, ``clock`` and ``behind`` they read,
    and whose ``schedule`` they start); whether the chief's writer is busy, which the step agreement spreads,
    is :attr:`~mpidist.loop.writing_behind.WritingBehind.busy`."""

    def start_schedule(self, step):
        """The schedule from ``step`` on, with the run's ``--checkpoint-every`` and ``--checkpoint-seconds``
        (at the start, and where the survivors of a lost rank go back to a checkpoint)."""
        self.schedule = CheckpointSchedule(
            self.config.checkpoint_every, self.config.checkpoint_seconds, step, self.clock()
        )

    def rolled_back(self, step):
        """Every rank, as the survivors of a lost rank go back to ``step``: the schedule goes on from there
        and nothing is owed or recently started.  These lockstep decisions are each rank's own record of the
        boundaries it went through, and a loss finds the ranks at different points of one (some past the
        boundary's agreement, some failed in it): one rank that still owed a checkpoint started it at the
        next boundary alone, its save waiting for good on ranks that stepped on."""
        self.start_schedule(step)
        self.behind.owed, self.behind.started_at = False, None

    def starts_at(self, step, due, busy):
        """Lockstep, alike on every rank: whether the checkpoint owed (``due`` now, or deferred) starts at
        ``step``.

        ``busy``: the chief's writer was busy at the step before (as the step
        agreement says, one step late); a write that started at the step
        before is busy whatever that said.  A checkpoint due meanwhile waits
        for the writer (several such become one), so training never waits for it.
        """
        behind = self.behind
        behind.owed = behind.owed or bool(due)
        return behind.owed and not busy and (behind.started_at is None or behind.started_at < step - 1)

    def taken(self, step):
        """Every rank: the checkpoint owed was taken at ``step`` (the chief writes it behind training)."""
        self.behind.owed, self.behind.started_at = False, step
