"""A pipeline stage running its schedule: one method per operation, one record per micro-batch in flight.

The schedule (:mod:`mpidist.parallel.pipeline.schedule`) lists a stage's operations;
:class:`ScheduleRunner` carries them out on a slice of the step's batch.  A
micro-batch is in flight on a stage from its first operation there (its
activations arrive, or the first stage starts its forward) to its last (its
gradient leaves, or the first stage's backward ends); meanwhile its
:class:`MicroBatch` holds its workspace slot, the arrays it received and will
send, and the layer caches its backward needs.  The slot goes back to the
pool (:mod:`mpidist.parallel.pipeline.slots`) with the requests of every send from it.

Each micro-batch's loss is weighted by its share of the global batch, so the
gradients added up over a step are the global batch's mean gradient.
"""

import dataclasses

import numpy as np

from ...runtime import recorder
from ...runtime.errors import RunError
from .slots import SlotPool

TRACER = recorder.tracer()


def split_sizes(total, parts):
    """``parts`` near-equal positive sizes adding up to ``total``."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch in flight on this stage: where it computes, and what it holds between operations."""

    index: int
    rows: slice  # its samples within the round's slice of the batch
    slot: int  # its workspace slot: the arrays it computes into, receives into and sends from
    inputs: object = None  # activations received from the previous stage, until the forward
    stash: object = None  # the layers' caches from the forward to the backward (the activations held)
    outputs: object = None  # activations for the next stage, until sent
    grad_in: object = None  # the gradient received from the next stage, until the backward
    grad_out: object = None  # the gradient for the previous stage, until sent
    sends: list = dataclasses.field(default_factory=list)  # requests of the sends from its slot's arrays

    @property
    def size(self):
        return self.rows.stop - self.rows.start


@dataclasses.dataclass
class Round:
    """One run of the schedule over a slice of the step's batch (``--accumulate K`` runs ``K`` a step)."""

    x: object
    y: object
    step: int
    index: int  # the slice's index in its step: seeds dropout, tells trace arrows apart
    parts: list  # each micro-batch's rows of the slice
    gradients: object  # where each backward adds its gradients
    flight: dict = dataclasses.field(default_factory=dict)  # micro-batch index -> its MicroBatch
    # (request, buffer) of every send, waited at the end
    sends: list = dataclasses.field(default_factory=list)
    loss: float = 0.0  # the micro-batches' weighted losses (the last stage's)

    @property
    def flow(self):
        """What tells this round's trace arrows apart from other rounds'."""
        return self.step, self.index


class ScheduleRunner:
    """Carries out one stage's schedule; see the module text.

    Args:
        model: the stage's model (its workspace holds each slot's arrays).
        loss: the training loss (the last stage computes it).
        layout: the stage's :class:`~mpidist.parallel.pipeline.stage.StageLayout`.
        links: the stage's :class:`~mpidist.parallel.pipeline.stage.StageLinks`.
        plan: the stage's ``(op, micro-batch)`` actions (:func:`mpidist.parallel.pipeline.schedule.schedule`).
        micro_batches: ``M``, micro-batches per round.
        global_batch: the global batch size (each micro-batch's loss weight is its share of it).
        seed: the run seed (dropout streams).
        figures: the strategy's figures (``peak_activations`` is counted here).
        count_training: ``(outputs, labels)`` -> None, the strategy's training figures (last stage).
    """

    #: the method that carries out each operation of a schedule
    OPERATIONS = {
        "recv_fwd": "receive_activations",
        "fwd": "forward",
        "send_fwd": "send_activations",
        "recv_bwd": "receive_gradient",
        "bwd": "backward",
        "send_bwd": "send_gradient",
    }

    def __init__(
        self, model, loss, layout, links, plan, micro_batches, global_batch, seed, figures, count_training
    ):
        unknown = sorted({op for op, _ in plan} - set(self.OPERATIONS))
        if unknown:
            raise ValueError(
                f"schedule operations {unknown} have no method; known: {sorted(self.OPERATIONS)}"
            )
        self.model, self.loss, self.layout, self.links = model, loss, layout, links
        self.plan, self.micro_batches, self.global_batch, self.seed = plan, micro_batches, global_batch, seed
        self.figures, self.count_training = figures, count_training
        self.slots = SlotPool()
        self.round = None  # the round being run

    def run(self, x, y, step, round_index, gradients):
        """The schedule over ``x``, ``y`` (one slice of the step's batch); adds into ``gradients``; the
        weighted loss."""
        sizes = split_sizes(len(x), self.micro_batches)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        parts = [slice(int(offsets[i]), int(offsets[i + 1])) for i in range(self.micro_batches)]
        self.round = Round(x, y, step, round_index, parts, gradients)
        self.links.track("compute")
        for op, micro in self.plan:
            getattr(self, self.OPERATIONS[op])(micro)
        self.links.wait([request for request, _ in self.round.sends])
        self.slots.reset()
        loss, self.round = self.round.loss, None
        return loss

    def _in_flight(self, micro):
        """``micro``'s record, made with a free slot at its first operation on this stage."""
        flight = self.round.flight
        if micro not in flight:
            flight[micro] = MicroBatch(micro, self.round.parts[micro], self.slots.take())
        return flight[micro]

    def _slot_array(self, batch, name, shape):
        """A receive buffer kept in ``batch``'s workspace slot (the same array every step)."""
        workspace = self.model.workspace
        workspace.slot = batch.slot
        return workspace.array(self, name, (batch.size,) + tuple(shape), self.model.dtype)

    def _send(self, batch, array, dest, tag):
        """Start sending ``array`` (from ``batch``'s slot) to stage ``dest``."""
        boundary = self.layout.out_shape if dest > self.layout.stage else self.layout.in_shape
        check_boundary(array, (batch.size,) + tuple(boundary), self.layout.stage, dest)
        request, buffer = self.links.isend(array, dest, tag, flow=self.round.flow)
        self.round.sends.append((request, buffer))
        batch.sends.append(request)

    def _land(self, batch):
        """``batch`` is done here: its slot's arrays are free again once what was sent from them has left."""
        self.slots.release(batch.slot, batch.sends)
        del self.round.flight[batch.index]

    def receive_activations(self, micro):
        """``recv_fwd``: the previous stage's activations, into the micro-batch's slot."""
        batch = self._in_flight(micro)
        buffer = self._slot_array(batch, "input", self.layout.in_shape)
        batch.inputs = self.links.recv(buffer, self.layout.stage - 1, 2 * micro, flow=self.round.flow)

    def forward(self, micro):
        """``fwd``: the stage's layers (and the loss, on the last stage); the caches stashed for the
        backward."""
        batch, model, layout, current = self._in_flight(micro), self.model, self.layout, self.round
        model.workspace.slot = batch.slot
        model.reseed(self.seed, layout.replica, current.step, current.index * self.micro_batches + micro)
        inputs, batch.inputs = batch.inputs, None
        with TRACER.span("forward", "compute", micro_batch=micro):
            out = model.forward(current.x[batch.rows] if layout.is_first else inputs, training=True)
        if layout.is_last:
            labels = current.y[batch.rows]
            current.loss += float(self.loss.forward(out, labels)) * batch.size / self.global_batch
            self.count_training(out, labels)
            batch.stash = model.stash([self.loss])
        else:
            batch.stash = model.stash()
            batch.outputs = model.xp.ascontiguousarray(out)
        stashed = sum(1 for each in current.flight.values() if each.stash is not None)
        self.figures["peak_activations"] = max(self.figures["peak_activations"], stashed)

    def send_activations(self, micro):
        """``send_fwd``: the activations on to the next stage."""
        batch = self.round.flight[micro]
        outputs, batch.outputs = batch.outputs, None
        self._send(batch, outputs, self.layout.stage + 1, 2 * micro)

    def receive_gradient(self, micro):
        """``recv_bwd``: the next stage's gradient of this stage's outputs, into the micro-batch's slot."""
        batch = self.round.flight[micro]
        buffer = self._slot_array(batch, "grad_in", self.layout.out_shape)
        batch.grad_in = self.links.recv(buffer, self.layout.stage + 1, 2 * micro + 1, flow=self.round.flow)

    def backward(self, micro):
        """``bwd``: the caches restored, the gradients added into the round's; the first stage is then
        done."""
        batch, model, layout = self.round.flight[micro], self.model, self.layout
        model.workspace.slot = batch.slot
        if layout.is_last:
            model.restore(batch.stash, [self.loss])
            dy = self.loss.backward(scale=batch.size / self.global_batch)
        else:
            model.restore(batch.stash)
            dy = batch.grad_in
        batch.stash = batch.grad_in = None
        with TRACER.span("backward", "compute", micro_batch=micro):
            dx = model.backward(dy, input_grad=not layout.is_first)
        self.round.gradients += model.grads
        if layout.is_first:
            self._land(batch)
        else:
            batch.grad_out = model.xp.ascontiguousarray(dx)

    def send_gradient(self, micro):
        """``send_bwd``: the gradient back to the previous stage; the micro-batch is then done here."""
        batch = self.round.flight[micro]
        grad_out, batch.grad_out = batch.grad_out, None
        self._send(batch, grad_out, self.layout.stage - 1, 2 * micro + 1)
        self._land(batch)


def check_boundary(array, expected, stage, dest):
    """Refuse ``array``, sent from ``stage`` to ``dest``, unless it is of the ``expected`` shape: the receiver
    takes a buffer of that shape, and a message of fewer values would leave the rest of it as an earlier
    micro-batch left it (training on, silently wrong)."""
    if tuple(array.shape) != tuple(expected):
        what = "activations" if dest > stage else "input gradients"
        raise RunError(
            f"pipeline stage {stage}'s layers gave {what} of shape {tuple(array.shape)} to send to stage "
            f"{dest}, which takes {tuple(expected)} (a layer at the boundary changed the batch or the "
            "sample's shape)"
        )
