"""``--shard parameters``'s traffic in a pass: each unit's parameters gathered just before it runs, its
gradients reduce-scattered to their owners as soon as backward has made them.

A :class:`UnitGathers` is the model's gate (:attr:`mpidist.nn.Sequential.gate`):
the model calls it before each top-level layer's forward and backward, and
the strategy's backward calls :meth:`UnitGathers.ready` after each layer, as
an exchange's.  Unit ``u`` always lives in parameter slot ``u % slots`` and
gradient slot ``u % 2``, its layers bound there once: consecutive units
alternate slots, so the next unit's gather (started, non-blocking, as soon as
this one may run) never overwrites the unit running, and the last two units
of a forward pass are still gathered when backward begins.  Without
``prefetch`` there is one slot of each (a model whose two units in flight do
not fit): a unit is gathered when it is about to run, into the slot the unit
before has left, and its gradients' sum is waited for before the next
unit's backward writes there.  With
``keep`` every unit has a slot of its own, kept from forward to backward
(FSDP2's ``reshard_after_forward=False``): no second gather, and the whole
model's parameters held during a step.  A gathered unit is valid until the
parameters change (:meth:`UnitGathers.invalidate`, after each update).
"""

import numpy as np

from ...runtime import aligned
from ...runtime import comm as mpi
from ...runtime import recorder
from .units import slot_counts, slot_sizes

_TRACER = recorder.tracer()


class GatheredUnits:
    """The parameter slots: unit ``u`` gathered into slot ``u % slots`` from every worker's shard of it.

    Args:
        route: how the blocks travel (:mod:`~mpidist.parallel.data.unit_routes`: the slots are this
            rank's, or its node's).
        shards, params: as :class:`UnitGathers`'.
        slots: how many (two, or one per unit).
    """

    def __init__(self, route, shards, params, slots, xp):
        self.route, self.shards, self.params = route, shards, params
        self.slots = route.slots(slot_sizes(shards.units, slots, shards.ranks), params.dtype, xp)
        self.in_slot = [None] * slots  # the unit each slot holds (gathered, or on its way)
        # the gather into each slot not yet seen complete by every rank that shares it (None: none)
        self.pending = [None] * slots

    def start(self, unit):
        """Start gathering ``unit`` into its slot, unless it is there or on its way."""
        slot = unit % len(self.slots)
        if self.in_slot[slot] == unit:
            return
        if self.pending[slot] is not None:  # (a gather nobody waited for: complete it before reuse)
            self.pending[slot].wait()
        self.route.before_gathering()  # (a rank sharing the slot may still read the unit in it)
        shards, target = self.shards, self.slots[slot]
        lo, hi = shards.shard(unit)
        held_lo, held_hi = shards.held(unit)
        target[lo:hi] = self.params[held_lo:held_hi]
        self.pending[slot] = self.route.gather(target, shards.blocks[unit])
        self.in_slot[slot] = unit

    def have(self, unit):
        """Wait until ``unit`` is gathered in its slot."""
        self.start(unit)
        slot = unit % len(self.slots)
        if self.pending[slot] is not None:
            with _TRACER.span("gather", "exchange", unit=unit):
                mpi.yielding_wait(self.pending[slot])
                self.route.settle()
            self.pending[slot] = None

    def invalidate(self):
        """The parameters changed (an update): every gathered unit is stale."""
        for slot, pending in enumerate(self.pending):
            if pending is not None:
                pending.wait()
                self.pending[slot] = None
            self.in_slot[slot] = None


class SummedUnits:
    """The gradient slots: unit ``u``'s gradients made in slot ``u % 2``, then reduce-scattered into the
    workers' shards of them.

    Args:
        comm, shards, grads: as :class:`UnitGathers`'.
        slots: how many (two, or one where there is one unit).
    """

    def __init__(self, route, shards, grads, slots, xp):
        self.route, self.shards, self.grads, self.xp = route, shards, grads, xp
        self.slots = route.grad_slots(slot_sizes(shards.units, slots, shards.ranks), grads.dtype, xp)
        self.pending = [None] * slots  # (unit, pending, how it lands) of each slot's sum in flight
        self.adds = False  # this backward's sums are added to the shards' (a later --accumulate slice)
        # (where a block lands that cannot land in place: a later slice's sums, added once in; a shard shorter
        # than its block. Made when needed)
        self.arrivals = None
        self.next = len(shards.units) - 1  # the next unit whose sum starts

    def begin(self, adds):
        """Before a backward: ``adds`` True where its sums are added to the shards' (a later slice)."""
        self.adds, self.next = adds, len(self.shards.units) - 1

    def ready(self, lo):
        """Backward has finished the gradients above ``lo``: start the sums of the units wholly above it, and
        drive those in flight."""
        units = self.shards.units
        while self.next >= 0 and units[self.next].lo >= lo:
            self._start(self.next)
            self.next -= 1
        for slot, entry in enumerate(self.pending):
            if entry is not None and entry[1].test():
                self._arrived(slot)

    def finish(self):
        """After a backward: every unit's sum in this rank's shard of the gradients."""
        self.ready(-1)
        for slot in range(len(self.slots)):
            self._land(slot)

    def free(self, slot):
        """Before a backward writes slot ``slot``: the sum that reads it done, and (where the node's ranks
        read each other's slots) every rank of the node past its reads."""
        self._land(slot)
        self.route.before_backward()

    def _land(self, slot):
        """Wait for slot ``slot``'s sum, if one is in flight."""
        if self.pending[slot] is not None:
            with _TRACER.span("reduce-scatter", "exchange"):
                self._arrived(slot)

    def _start(self, unit):
        shards, slot = self.shards, unit % len(self.slots)
        block = shards.blocks[unit]
        lo, hi = shards.held(unit)
        lands = "add" if self.adds else "in place" if hi - lo == block else "copy"
        target = self.grads[lo:hi] if lands == "in place" else self._arrival(slot)[:block]
        with _TRACER.span("start the sum", "exchange", unit=unit):
            self.pending[slot] = (unit, self.route.sum(slot, target), lands)

    def _arrival(self, slot):
        """Where slot ``slot``'s block lands when it cannot land in this rank's shard (made on first use)."""
        if self.arrivals is None:
            largest = max(self.shards.blocks)
            self.arrivals = [aligned.zeros(self.xp, largest, self.grads.dtype) for _ in self.slots]
        return self.arrivals[slot]

    def _arrived(self, slot):
        """Slot ``slot``'s sum is in: into the shard, or added to it where its backward adds."""
        unit, pending, lands = self.pending[slot]
        mpi.yielding_wait(pending)
        lo, hi = self.shards.held(unit)
        if lands == "add":
            self.grads[lo:hi] += self.arrivals[slot][: hi - lo]
        elif lands == "copy":
            self.grads[lo:hi] = self.arrivals[slot][: hi - lo]
        self.pending[slot] = None


class UnitGathers:
    """The gate of this rank's model over ``comm``: its units gathered as they run, their gradients summed.

    Args:
        comm: the workers that share the shards (the mesh's replica axis).
        route: how the units' blocks travel between them
            (:func:`~mpidist.parallel.data.unit_routes.unit_route`).
        model: this rank's model (its layers are bound to the slots here; it never makes whole buffers).
        shards: the :class:`~mpidist.parallel.data.units.ShardedUnits` of this rank.
        params, grads: this rank's buffers of shards (parameters, and where its summed gradients go).
        keep: keep every gathered unit from forward to backward (a slot per unit).
        prefetch: gather the next unit while this one runs (two slots); False: one slot of each, a unit
            gathered only as it runs.
    """

    def __init__(self, comm, route, model, shards, params, grads, keep=False, prefetch=True):
        self.comm, self.route, self.model, self.shards = comm, route, model, shards
        param_slots, grad_slots = slot_counts(shards.units, keep, prefetch)
        #: whether the next unit's gather starts while this one runs (there is a slot for it: never where one
        #: slot holds every unit in turn)
        self.prefetches = param_slots > 1
        self.gathered = GatheredUnits(route, shards, params, param_slots, model.xp)
        self.summed = SummedUnits(route, shards, grads, grad_slots, model.xp)
        self.unit_of = [shards.unit_of(layer) for layer in range(len(model.layers))]
        self._bind()

    def _bind(self):
        """Bind each parameter of unit ``u`` to its place in its parameter slot, its gradient likewise."""
        units, params, grads = self.shards.units, self.gathered.slots, self.summed.slots
        for layer, name, lo, shape, _ in self.model.entries:
            index = max(i for i, unit in enumerate(units) if unit.lo <= lo)
            at, size = lo - units[index].lo, int(np.prod(shape, dtype=np.int64))
            layer.params[name] = params[index % len(params)][at : at + size].reshape(shape)
            layer.grads[name] = grads[index % len(grads)][at : at + size].reshape(shape)

    def own_slots(self):
        """Rebind the layers, where this rank shares its slots with its node, to read-only zeros that take no
        memory (before the route frees the windows): a gathered unit's values mean nothing once the strategy
        is gone, and private copies would count against a data limit the run was priced under."""
        if self.route.sharing > 1:
            for slots in (self.gathered.slots, self.summed.slots):
                slots[:] = [np.broadcast_to(slot.dtype.type(0), slot.shape) for slot in slots]
            self._bind()

    @property
    def nbytes(self):
        """Bytes of the slots: the gathered units' parameters and gradients (what a step holds beyond the
        shards), and where ``--accumulate``'s later slices receive their sums."""
        summed = self.summed
        shared = sum(int(slot.nbytes) for slot in self.gathered.slots) // self.route.sharing
        slots = (*summed.slots, *(summed.arrivals or ()))
        return shared + sum(int(slot.nbytes) for slot in slots)

    @property
    def sent(self):
        """Bytes this rank has sent, gathering and summing (counted as rings')."""
        return self.route.sent

    def forward(self, layer):
        """Before layer ``layer``'s forward: its unit gathered, and the next one's gather started."""
        unit, gathered = self.unit_of[layer], self.gathered
        if layer == self.shards.units[unit].first:
            gathered.have(unit)
            if unit + 1 < len(self.shards.units) and self.prefetches:
                gathered.start(unit + 1)
        self.route.params_read = True  # (the layer runs: it reads the slots)

    def backward(self, layer):
        """Before layer ``layer``'s backward: its unit gathered, its gradient slot free, the unit below's
        gather started."""
        unit, gathered = self.unit_of[layer], self.gathered
        if layer == self.shards.units[unit].end - 1:
            gathered.have(unit)
            self.summed.free(unit % len(self.summed.slots))
            if unit > 0 and self.prefetches:
                gathered.start(unit - 1)
        self.route.params_read = True

    def ready(self, lo):
        """Backward has finished the gradients above ``lo`` (:meth:`SummedUnits.ready`)."""
        self.summed.ready(lo)

    def in_step(self, items):
        """``items``, while the workers gather each unit together: a worker whose items have run out goes on
        gathering (one small ``Allreduce`` an item says whether any worker has one)."""
        comm, items = self.comm, iter(items)
        if comm.Get_size() == 1:
            yield from items
            return
        any_left = np.zeros(1, dtype=np.int64)
        while True:
            item = next(items, None)
            any_left[0] = item is not None
            mpi.allreduce_max(comm, any_left)
            if not any_left[0]:
                return
            if item is None:
                self.idle_pass()
            else:
                yield item

    def idle_pass(self):
        """Every unit gathered in turn, as a forward pass gathers them, with nothing computed: a worker with
        no batch left in an evaluation keeps the others' gathers (and its node's barriers) company."""
        for unit in self.shards.units:
            self.forward(unit.first)
