"""Why a rank leaves the loop: a signal, a callback's stop, a failed write, divergence -- and the agreement on
it."""

from ..runtime.phase import PhaseComm
from ..runtime.preempt import EARLY_STOP, WRITE_FAILED, StepAgreement


class Stops:
    """What this rank knows of stopping, and (lockstep strategies) the step agreement that spreads it.

    Args:
        signals: the process's :class:`~mpidist.runtime.preempt.StopSignals`.
    """

    def __init__(self, signals):
        self.signals = signals
        self.agreement = None  # lockstep strategies: the step agreement of the current loop
        self.phases = PhaseComm()  # what the ranks' evaluations agree on (freed after the loop's last one)
        self.early = False  # this rank left the loop on a stop request
        self.diverged = None  # the message, once --nan-patience ran out

    def agree_on(self, comm):
        """Collective: a new step agreement over ``comm`` (the loop is entered again after a recovery)."""
        self.agreement = StepAgreement(comm)
        return self.agreement

    def request(self, log):
        """What this rank asks of the others at a boundary: a failed write, else a signal, else a callback's
        stop."""
        if log.failure:
            return WRITE_FAILED
        # (EARLY_STOP is below every signal: a real one wins)
        return self.signals.received or (EARLY_STOP if log.stop_asked else 0)

    def free(self):
        """Complete and free the step agreement (before the run's last collectives)."""
        if self.agreement is not None:
            self.agreement.free()
