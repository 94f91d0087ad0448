"""Workspace slots for the micro-batches a pipeline stage holds in flight.

Each micro-batch computes into a slot of the stage model's workspace (see
:mod:`mpidist.nn.workspace`): its activations, the buffers it receives into
and the arrays it sends from.  A slot goes back to the pool once the
micro-batch's backward pass has run *and* every send from its arrays has
completed, so a stage holds one set of arrays per micro-batch in flight (at
most ``P`` under 1F1B, ``M`` under GPipe) plus those still leaving, and the
same arrays serve every step.
"""


class SlotPool:
    """Slot numbers ``0, 1, ...``, handed out lowest free first, returned when their requests are done.

    Requests are anything with ``Test() -> bool`` (mpi4py's ``Request``; a
    completed request tests true again).
    """

    def __init__(self):
        self.size = 0  # slots ever used: the sets of arrays the workspace holds
        self._free = []
        self._leaving = []  # (slot, requests) whose micro-batch is done but whose sends may not be

    def take(self):
        """A free slot: one whose sends have completed, else a new one."""
        still = []
        for slot, requests in self._leaving:
            if all(request.Test() for request in requests):
                self._free.append(slot)
            else:
                still.append((slot, requests))
        self._leaving = still
        if self._free:
            self._free.sort()
            return self._free.pop(0)
        self.size += 1
        return self.size - 1

    def release(self, slot, requests=()):
        """``slot``'s micro-batch is done; it is free once every one of ``requests`` has completed."""
        self._leaving.append((slot, list(requests)))

    def reset(self):
        """Every request has completed (the step's final wait): every slot is free."""
        self._free, self._leaving = list(range(self.size)), []
