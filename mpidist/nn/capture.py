"""When a GPU step's passes replay a CUDA graph, when they capture one, and when they run as they are.

A graph replays the kernels of one capture with the same arrays: it holds
for passes of one shape on one set of buffers, with the host values it was
captured with (the loss's scale).  So a pass of a new shape runs eagerly
first (its workspace arrays are made and its kernels compiled: neither
belongs in a capture), is captured the next time it comes, and is replayed
after; a new shape (the epoch's last partial batch), buffers bound anew (an
exchange that holds the gradients, a checkpoint restored into new arrays) or
a new scale make a key of their own.  At most :data:`KEEP` graphs are kept
(each pins its workspace's memory); the one unused longest goes first.

:class:`Captures` is the rule, pure and tested by a table; the device code
that captures and replays (:mod:`mpidist.nn.graphs`) asks it.
"""

import collections
import dataclasses

#: graphs kept at most: a training shape, the epoch's last partial batch, an evaluation's two
KEEP = 4


@dataclasses.dataclass(frozen=True)
class PassKey:
    """What a graph of a pass is valid for.

    Attributes:
        what: ``"train"`` (forward, backward and the update) or ``"eval"`` (forward).
        shape: the batch's shape.
        dtype: the compute dtype's name.
        slot: the workspace slot (a pipeline's micro-batch in flight, ``--accumulate``'s uneven slice).
        buffers: the device addresses of the buffers the pass reads and writes (parameters, gradients).
    """

    what: str
    shape: tuple
    dtype: str
    slot: int = 0
    buffers: tuple = ()


class Captures:
    """Which passes run eagerly, capture a graph or replay one (the rule, no device)."""

    def __init__(self, keep=KEEP):
        self.keep = int(keep)
        self._warm = set()  # keys that ran eagerly once (their arrays exist)
        self._eager = set()  # keys whose capture failed: eager for good
        self._graphs = collections.OrderedDict()  # key -> True, least recently used first

    def decide(self, key):
        """``"eager"``, ``"capture"`` or ``"replay"`` for a pass of ``key`` about to run (recorded as run)."""
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return "replay"
        if key in self._eager:
            return "eager"
        if key not in self._warm:
            self._warm.add(key)
            return "eager"
        self._graphs[key] = True
        while len(self._graphs) > self.keep:
            self._graphs.popitem(
                last=False
            )  # (its arrays stay made: it is captured again when it comes back)
        return "capture"

    def failed(self, key):
        """The capture of ``key`` failed (a pass that reads a value on the host, a library that refuses
        capture): the pass runs eagerly from now on."""
        self._graphs.pop(key, None)
        self._eager.add(key)

    def forget(self):
        """Every graph is invalid (the buffers moved): passes run eagerly once more, then are captured."""
        self._graphs.clear()
        self._warm.clear()

    @property
    def held(self):
        """The keys whose graphs are kept, least recently used first."""
        return list(self._graphs)
