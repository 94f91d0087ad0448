"""``pipeline``: a model's layers split into stages on consecutive ranks.

With ``N = P x D`` ranks there are ``D`` replicas of a ``P``-stage pipeline:
rank ``r`` is stage ``r % P`` of replica ``r // P``.  Each step, the replica's
batch is cut into ``M`` micro-batches that flow forward as activations and
backward as gradients (``Isend``/``Recv`` of contiguous buffers, tagged with
the micro-batch and direction) in the order the schedule
(:mod:`mpidist.parallel.pipeline.schedule`) gives each stage.  A stage keeps one
stash of layer caches per micro-batch in flight -- the activations it holds --
and adds each micro-batch's gradients into one buffer.  Then stage ``k``
sums its gradients with stage ``k`` of the other replicas (``Allreduce`` on a
per-stage communicator) and applies the optimizer to its own parameters.

The parts: :mod:`mpidist.parallel.mesh` (the grid of replicas, stages and
parts, and a communicator per axis), :mod:`mpidist.parallel.pipeline.stage` (which
layers a stage holds, its transfers along the pipe),
:mod:`mpidist.parallel.pipeline.schedule_runner` (the schedule carried out, one method
per operation), :mod:`mpidist.parallel.pipeline.balance` (the layers balanced over the
stages), :mod:`mpidist.parallel.pipeline.declared` (its settings and checks)
and :mod:`mpidist.parallel.pipeline.recovery` (its survivors of a lost rank);
this module takes the step around the schedule.

Each micro-batch's loss is weighted by its share of the global batch, so the
summed gradients are the global-batch mean: a pipeline step equals a local
step on the same batch.  A stage's parameters are a contiguous slice of the
whole model's flat buffer: each stage draws its own slice of the initial
parameters (:meth:`mpidist.nn.placement.Placement.initial`), the same values
a whole draw gives, and no rank builds the whole model's buffers.
With ``--tensor T`` each stage is split over ``T`` ranks
(:mod:`mpidist.parallel.parts`); a rank's parameters are then slices of
its stage's (``placement``: their regions of the whole model's parameters).
"""

import math
import time

import numpy as np

from ...runtime import comm as mpi
from ...runtime.xp import to_host
from ..base import Strategy, start_counting
from ..mesh import Mesh
from ..parts import gather_placed, split_over
from ..registry import register
from ..rewind import PreviousSlice, StepLedger
from ..saved_state import WholeState
from ..verdict import agree
from .balance import balance_by_parameters, first_entry, layer_costs
from .declared import PipelineDeclared
from .recovery import ReplicasLeftWhole
from .schedule import schedule
from .schedule_runner import ScheduleRunner, check_boundary
from .stage import StageLayout, StageLinks


def _from_layout(name, doc):
    """A read-only attribute of the strategy that its :class:`~mpidist.parallel.pipeline.stage.StageLayout`
    holds."""
    return property(lambda self: getattr(self.layout, name), doc=doc)


@register
class PipelineStrategy(PipelineDeclared, Strategy):
    """Pipeline parallelism, optionally replicated for data parallelism.

    Args:
        stages: ``P``, ranks per pipeline.
        micro_batches: ``M``, micro-batches per step.
        schedule_name: "gpipe" or "1f1b".
        balance: layers per stage, or None to balance by parameters.
        global_batch: the global batch size (micro-batch weights).
    """

    name = "pipeline"
    # a lost rank breaks its replica: the other replicas hold every stage's state and go on (the broken one's
    # survivors wait idle for the end); every stage keeps its slice before the last update, so that the
    # survivors agree on one step (a death may break a step's collective on some ranks only)
    elastic_recovery = True
    chief_replaceable = True
    recovery_type = ReplicasLeftWhole

    def __init__(
        self,
        *args,
        stages,
        micro_batches,
        schedule_name,
        balance=None,
        global_batch,
        elastic=False,
        tensor=1,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        full, cluster = self.model, self.cluster
        self.full = full
        stages = int(stages)
        balance = list(balance) if balance else balance_by_parameters(layer_costs(full), stages)
        if len(balance) != stages:
            raise ValueError(f"balance {balance} gives {len(balance)} stages, not {stages}")
        self.layout = layout = StageLayout(full, balance, cluster.rank, cluster.size, tensor)
        #: the grid of replicas, stages and parts (made and freed here)
        # (the pipe a communicator of its own even with one replica: its tags are the micro-batches', which
        # the world's other messages between its ranks must never meet)
        self.mesh = Mesh(cluster.world, stages, tensor, private=("stage",))
        stage_model = layout.stage_model(full)
        full.shapes_only = True  # (its layers are bound to the stage's buffers now)
        #: this rank's part of its stage (the stage whole, with one part)
        self.tensor = split_over(stage_model, self.mesh, writes=True)
        self.model = self.tensor.model
        # this rank's regions of the whole model's parameters (its stage's, or its part of them), as a replica
        # that writes them would write (a gather among the survivors of a lost rank makes another one that)
        self._as_writer = self.tensor.within(full, first_entry(full, layout.first_layer))
        #: the regions, written by the first replica
        self.placement = self._as_writer.within(full, 0, writes=layout.replica == 0)
        self.links = StageLinks(
            self.mesh, layout, self.figures, self.track, device=full.xp is not np, node=cluster.node_index
        )
        self.accumulated = full.xp.zeros(self.model.num_params + 1, dtype=full.dtype)  # gradients, then loss
        self.optimizer = self.optimizers.make(self.model.num_params, layout.param_lo)
        if self.optimizer is not None:  # (a part is no slice of the whole: its own; a stage's are the same)
            self.optimizer.decay_ranges = self.model.decay_ranges()
        self.ledger = StepLedger(PreviousSlice(self.model.params, self.optimizer) if elastic else None)
        self.model.use_workspace(self.loss)
        start_counting(self.figures, steps=0, pipeline_s=0.0, idle_s=0.0, peak_activations=0)
        self.runner = ScheduleRunner(
            self.model,
            self.loss,
            layout,
            self.links,
            schedule(schedule_name, layout.stage, stages, int(micro_batches)),
            int(micro_batches),
            int(global_batch),
            self.passes.seed,
            self.figures,
            self.passes.count,
        )

    # where this rank sits, as callers and tests read it (the layout holds it)
    stage = _from_layout("stage", "This rank's stage, ``0 .. P-1``.")
    stages = _from_layout("stages", "``P``, stages per replica.")
    replica = _from_layout("replica", "This rank's replica, ``0 .. D-1``.")
    replicas = _from_layout("replicas", "``D``, replicas of the pipeline.")
    first_layer = _from_layout("first_layer", "The whole model's index of this stage's first layer.")
    end_layer = _from_layout("end_layer", "One past the whole model's index of this stage's last layer.")
    param_lo = _from_layout("param_lo", "This stage's first parameter in the whole model's flat buffer.")
    param_hi = _from_layout(
        "param_hi", "One past this stage's last parameter in the whole model's flat buffer."
    )

    @property
    def worker_index(self):
        return self.layout.replica

    def describe(self, rank):
        """Role-table text for this rank."""
        layout = self.layout
        words = (
            f"stage {layout.stage}/{layout.stages} layers {layout.first_layer}-{layout.end_layer - 1}",
            self.tensor.describe(),
            f"replica {layout.replica}" if layout.replicas > 1 else "",
            self.links.describe(),
        )
        return " ".join(word for word in words if word)

    def initialize(self, checkpoint=None):
        """Each rank draws its own slice of the whole model's start (no rank holds the whole, no traffic), or
        takes it from ``checkpoint``."""
        params, placement = self.model.params, self.placement
        if checkpoint is not None:  # (read into place: this rank's slices, one array at a time)
            self.restore(checkpoint)
        elif self.model.xp is np:  # (drawn into place: no second copy of the slice)
            placement.initial(self.passes.seed, params)
        else:
            params[...] = self.model.xp.asarray(
                placement.initial(self.passes.seed, np.empty(placement.size, params.dtype))
            )
        self.ledger.start_step = 0 if checkpoint is None else int(checkpoint.step)

    def train_step(self, x, y, weight, step):
        """One step: the schedule runs once per ``--accumulate`` slice, adding into the same gradients."""
        layout, gradients = self.layout, self.accumulated[:-1]
        self.accumulated[...] = 0
        start = time.perf_counter()
        # (every stage of a replica reads the same batch: the first uses its samples, the last its labels)
        bounds = np.linspace(0, len(x), self.recipe.accumulate + 1).round().astype(int)
        loss_sum = 0.0
        for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            loss_sum += self.runner.run(x[lo:hi], y[lo:hi], step, index, gradients)
        self.figures["pipeline_s"] += time.perf_counter() - start
        self.figures["steps"] += 1
        self.accumulated[-1] = loss_sum
        if layout.replicas > 1:
            mpi.allreduce_sum(self.links.peers, self.accumulated)
        # stages hold different gradients and only the last sees the loss: skip everywhere or nowhere.  One
        # Allreduce gives the verdict on the global squared norm (each replica's stages hold the same) and,
        # from replica 0's last stage, the global loss to every rank (any of them may become the chief)
        loss = float(self.accumulated[-1])
        verdict, (loss,) = agree(
            self.cluster.world,
            self.tensor.squares(gradients),  # (a part's parameters, its stage's shared ones once)
            loss,
            self.recipe.clip_norm,
            carry=[loss if layout.is_last and layout.replica == 0 and layout.part == 0 else 0.0],
            copies=layout.replicas,
        )
        self.track("compute")
        self.judge(verdict)
        self.ledger.keep(self.model.params, self.optimizer)
        if not verdict.skip:
            self.optimizer.step(self.model.params, verdict.scaled(gradients), self.recipe.lr(step))
        self.ledger.applied += 1
        loss = math.nan if verdict.skip else float(loss)
        if layout.stages > 1:  # the chief reports the training figures replica 0's last stage counted
            sent = (
                self.passes.take_counts()
                if self.cluster.rank == layout.rank_of(0, layout.stages - 1)
                else [0.0, 0]
            )
            counts = self._to_chief(np.array(sent, dtype=np.float64), tag=79)
            if self.cluster.is_chief:
                self.passes.counts = [
                    self.passes.counts[0] + float(counts[0]),
                    self.passes.counts[1] + int(counts[1]),
                ]
        return loss

    def _to_chief(self, values, tag):
        """The last stage of replica 0 (its first part) holds the global figures; the chief (rank 0) needs
        them.

        ``values`` is a float64 array, filled in place on the chief.
        """
        cluster, last = self.cluster, self.layout.rank_of(0, self.layout.stages - 1)
        if last == cluster.chief_rank:
            return values
        if cluster.rank == last:
            mpi.send(cluster.world, values, cluster.chief_rank, tag)
        elif cluster.is_chief:
            mpi.recv(cluster.world, values, last, tag)
        return values

    def forward_only(self, x):
        """Collective over this rank's replica: the whole model's outputs on the batch ``x`` (every stage is
        given the batch, of which the first reads the samples, the others the count), on the last stage's
        ranks; None on the others."""
        layout, model = self.layout, self.model
        inp = (
            model.xp.asarray(x)
            if layout.is_first
            else self.links.recv(
                model.xp.empty((len(x),) + layout.in_shape, dtype=model.dtype), layout.stage - 1, 0
            )
        )
        out = model.forward(inp, training=False)
        if layout.is_last:
            return out
        check_boundary(out, (len(x),) + tuple(layout.out_shape), layout.stage, layout.stage + 1)
        request, _ = self.links.isend(model.xp.ascontiguousarray(out), layout.stage + 1, 0)
        request.Wait()
        return None

    def evaluate(self, batches):
        """Forward-only pipeline over this replica's test chunks; the chief gets the sums' figures (others:
        NaN)."""
        # (the whole model's outputs: the last stage's)
        scoring, layout, model = self.scoring, self.layout, self.model
        totals = scoring.zeros()
        for x, y in batches:
            out = self.forward_only(x)
            if out is not None:
                y = model.xp.asarray(y)
                scoring.add(totals, out, y, float(self.loss.forward(out, y)), model.xp)
        if layout.is_last and layout.replicas > 1:
            totals = mpi.sum_float64(self.links.peers, totals)
        return scoring.figures(self._to_chief(np.asarray(totals, dtype=np.float64), tag=78))

    def state(self):
        """Collective: replica 0's stages send their slices to the chief."""
        return self.gathered(self.cluster)

    def gathered(self, cluster):
        """Collective over ``cluster``'s world, whose first ``P x T`` ranks are a replica's stages (and their
        parts): their slices, placed in the whole model's layout on its chief."""
        arrays = {"params": to_host(self.model.params)}
        arrays.update({name: to_host(a) for name, a in self.optimizer.state_arrays().items()})
        sends = cluster.rank < self.layout.rank_of(1, 0)  # (the first replica's ranks)
        whole = gather_placed(cluster.world, self._as_writer, arrays, cluster.chief_rank, sends)
        if not cluster.is_chief:
            return None
        params = whole.pop("params")
        return WholeState(params, whole, self.optimizer.steps)

    def held_bytes(self):
        """The stage's (or, with ``--tensor``, its part's) slice: the whole model is held by no rank.  Its
        gradients twice: a micro-batch's, and the step's sum they are added into."""
        state = sum(int(array.nbytes) for array in self.optimizer.state_arrays().values())
        return {
            "params": int(self.model.params.nbytes),
            "grads": int(self.accumulated.nbytes) + int(self.model.grads.nbytes),
            "optimizer_state": state,
        }

    def stats(self):
        f, layout = self.figures, self.layout
        return {
            "stage": layout.stage,
            "replica": layout.replica,
            "layers": [layout.first_layer, layout.end_layer],
            "peak_activations": f["peak_activations"],
            "bubble": f["idle_s"] / f["pipeline_s"] if f["pipeline_s"] else 0.0,
        }

    def free(self, keep=True):
        """Collective: free the stage's links and communicators (a second free does nothing)."""
        self.links.free()
        self.mesh.free()
