"""``--shard parameters``'s traffic in a pass: each unit's parameters gathered just before it runs, its
gradients reduce-scattered to their owners as soon as backward has made them.

A :class:`UnitGathers` is the model's gate (:attr:`mpidist.nn.Sequential.gate`):
the model calls it before each top-level layer's forward and backward, and
the strategy's backward calls :meth:`UnitGathers.ready` after each layer, as
an exchange's.  Unit ``u`` always lives in parameter slot ``u % slots`` and
gradient slot ``u % 2``, its layers bound there once: consecutive units
alternate slots, so the next unit's gather (started, non-blocking, as soon as
this one may run) never overwrites the unit running, and the last two units
of a forward pass are still gathered when backward begins.  With
``keep`` every unit has a slot of its own, kept from forward to backward
(FSDP2's ``reshard_after_forward=False``): no second gather, and the whole
model's parameters held during a step.  A gathered unit is valid until the
parameters change (:meth:`UnitGathers.invalidate`, after each update).
"""

from ..runtime import comm as mpi
from ..runtime import recorder

_TRACER = recorder.tracer()


class UnitGathers:
    """The gathered units of this rank's model over ``comm``, and the sums of their gradients.

    Args:
        comm: the workers that share the shards (the mesh's replica axis).
        model: this rank's model (its layers are bound to the slots here; it never makes whole buffers).
        shards: the :class:`~mpidist.parallel.units.ShardedUnits` of this rank.
        params, grads: this rank's buffers of shards (parameters, and where its summed gradients go).
        keep: keep every gathered unit from forward to backward (a slot per unit).
    """

    def __init__(self, comm, model, shards, params, grads, keep=False):
        self.comm, self.model, self.shards = comm, model, shards
        self.params, self.grads = params, grads
        units = shards.units
        self.slots = max(1, len(units) if keep else min(2, len(units)))
        xp, dtype, largest = model.xp, model.dtype, shards.largest
        self.param_slots = [xp.zeros(largest, dtype=dtype) for _ in range(self.slots)]
        self.grad_slots = [xp.zeros(largest, dtype=dtype) for _ in range(min(2, len(units)) or 1)]
        # (the sums of a later slice of --accumulate, added to the shard once they arrive)
        self.arrivals = [
            xp.zeros(
                max(shards.counts[u][shards.rank] for u in range(len(units))) if units else 0, dtype=dtype
            )
            for _ in self.grad_slots
        ]
        self.unit_of = [shards.unit_of(layer) for layer in range(len(model.layers))]
        self._bind()
        self.in_slot = [None] * self.slots  # the unit each parameter slot holds (gathered or on its way)
        self.gathering = [None] * self.slots  # the gather in flight into each slot
        self.scattering = [None] * len(self.grad_slots)  # (unit, pending, added) of each gradient slot
        self.adds = False  # this backward's sums are added to the shards' (a later --accumulate slice)
        self._next_scatter = len(units) - 1
        self.sent = 0  # bytes this rank has sent (counted as a ring's)

    def _bind(self):
        """Bind each parameter of unit ``u`` to its place in slot ``u % slots``, its gradient likewise."""
        units = self.shards.units
        for layer, name, lo, shape, _ in self.model.entries:
            index = max(i for i, unit in enumerate(units) if unit.lo <= lo)
            unit = units[index]
            size = 1
            for axis in shape:
                size *= int(axis)
            at = lo - unit.lo
            layer.params[name] = self.param_slots[index % self.slots][at : at + size].reshape(shape)
            layer.grads[name] = self.grad_slots[index % len(self.grad_slots)][at : at + size].reshape(shape)

    @property
    def nbytes(self):
        """Bytes of the slots: the gathered units' parameters and gradients (what a step holds beyond the
        shards)."""
        return sum(int(slot.nbytes) for slot in (*self.param_slots, *self.grad_slots, *self.arrivals))

    def forward(self, layer):
        """Before layer ``layer``'s forward: its unit gathered, and the next one's gather started."""
        unit = self.unit_of[layer]
        if layer == self.shards.units[unit].first:
            self._have(unit)
            if unit + 1 < len(self.shards.units):
                self._start(unit + 1)

    def backward(self, layer):
        """Before layer ``layer``'s backward: its unit gathered, its gradient slot free, the unit below's
        gather started."""
        unit = self.unit_of[layer]
        if layer == self.shards.units[unit].end - 1:
            self._have(unit)
            self._free_grad_slot(unit % len(self.grad_slots))
            if unit > 0:
                self._start(unit - 1)

    def ready(self, lo):
        """Backward has finished the gradients above ``lo``: start the sums of the units wholly above it, and
        drive those in flight."""
        units = self.shards.units
        while self._next_scatter >= 0 and units[self._next_scatter].lo >= lo:
            self._scatter(self._next_scatter)
            self._next_scatter -= 1
        for slot, entry in enumerate(self.scattering):
            if entry is not None and entry[1].test():
                self._arrived(slot)

    def begin(self, adds):
        """Before a backward: ``adds`` True where its sums are added to the shards' (a later slice)."""
        self.adds = adds
        self._next_scatter = len(self.shards.units) - 1

    def finish(self):
        """After a backward: every unit's sum in this rank's shard of the gradients."""
        self.ready(-1)
        for slot in range(len(self.scattering)):
            self._free_grad_slot(slot)

    def idle_pass(self):
        """Every unit gathered in turn, as a forward pass gathers them, with nothing computed: a worker with
        no batch left in an evaluation keeps the others' gathers company."""
        for unit in range(len(self.shards.units)):
            self._have(unit)

    def invalidate(self):
        """The parameters changed (an update): every gathered unit is stale."""
        for slot in range(self.slots):
            if self.gathering[slot] is not None:
                self.gathering[slot].wait()
                self.gathering[slot] = None
            self.in_slot[slot] = None

    def _start(self, unit):
        """Start gathering ``unit`` into its slot, unless it is there or on its way."""
        slot = unit % self.slots
        if self.in_slot[slot] == unit:
            return
        if self.gathering[slot] is not None:  # (a gather nobody waited for: complete it before reuse)
            self.gathering[slot].wait()
        shards, size = self.shards, self.shards.units[unit].size
        lo, hi = shards.shard(unit)
        target = self.param_slots[slot]
        held_lo, held_hi = shards.held(unit)
        target[lo:hi] = self.params[held_lo:held_hi]
        self.gathering[slot] = mpi.iallgatherv_inplace(
            self.comm, target[:size], shards.counts[unit], shards.displs[unit]
        )
        self.in_slot[slot] = unit
        self.sent += (size - (hi - lo)) * target.itemsize  # (a ring: every other shard passed on once)

    def _have(self, unit):
        """Wait until ``unit`` is gathered in its slot."""
        self._start(unit)
        slot = unit % self.slots
        if self.gathering[slot] is not None:
            with _TRACER.span("gather", "exchange", unit=unit):
                self.gathering[slot].wait()
            self.gathering[slot] = None

    def _scatter(self, unit):
        """Start summing ``unit``'s gradients into their owners' shards."""
        shards, slot = self.shards, unit % len(self.grad_slots)
        size = shards.units[unit].size
        lo, hi = shards.held(unit)
        target = self.arrivals[slot][: hi - lo] if self.adds else self.grads[lo:hi]
        pending = mpi.ireduce_scatter_sum(
            self.comm, self.grad_slots[slot][:size], target, shards.counts[unit]
        )
        self.scattering[slot] = (unit, pending, self.adds)
        self.sent += (size - (hi - lo)) * target.itemsize

    def _arrived(self, slot):
        """Slot ``slot``'s sum is in: added to the shard where this backward adds."""
        unit, pending, adds = self.scattering[slot]
        pending.wait()
        if adds:
            lo, hi = self.shards.held(unit)
            self.grads[lo:hi] += self.arrivals[slot][: hi - lo]
        self.scattering[slot] = None

    def _free_grad_slot(self, slot):
        """Wait for the sum that still reads gradient slot ``slot``."""
        if self.scattering[slot] is not None:
            with _TRACER.span("reduce-scatter", "exchange"):
                self._arrived(slot)
