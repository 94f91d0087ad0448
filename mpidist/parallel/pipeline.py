"""``pipeline``: a model's layers split into stages on consecutive ranks.

With ``N = P x D`` ranks there are ``D`` replicas of a ``P``-stage pipeline:
rank ``r`` is stage ``r % P`` of replica ``r // P``.  Each step, the replica's
batch is cut into ``M`` micro-batches that flow forward as activations and
backward as gradients (``Isend``/``Recv`` of contiguous buffers, tagged with
the micro-batch and direction) in the order the schedule
(:mod:`mpidist.parallel.schedule`) gives each stage.  A stage keeps one
stash of layer caches per micro-batch in flight -- the activations it holds --
and adds each micro-batch's gradients into one buffer.  Then stage ``k``
sums its gradients with stage ``k`` of the other replicas (``Allreduce`` on a
per-stage communicator) and applies the optimizer to its own parameters.

Each micro-batch's loss is weighted by its share of the global batch, so the
summed gradients are the global-batch mean: a pipeline step equals a local
step on the same batch.  A stage's parameters are a contiguous slice of the
whole model's flat buffer, so initialisation and checkpoints stay whole.
"""

import math
import time

import numpy as np
from mpi4py import MPI

from ..runtime import comm as mpi
from ..runtime import recorder
from ..runtime.errors import UsageError
from ..nn import Sequential
from ..runtime.xp import to_host
from .base import Strategy
from .registry import Option, register
from .schedule import schedule
from .slots import SlotPool

TRACER = recorder.tracer()


def balance_by_parameters(costs, stages):
    """Layers per stage, contiguous and non-empty, minimising the largest stage's cost.

    >>> balance_by_parameters([1, 1, 1, 10], 2)
    [3, 1]
    """
    count = len(costs)
    if not 1 <= stages <= count:
        raise ValueError(f"{stages} stages need at least {stages} layers, the model has {count}")
    prefix = np.concatenate([[0], np.cumsum(costs)])
    # best[s][i]: smallest max-cost splitting the first i layers into s stages
    best = np.full((stages + 1, count + 1), np.inf)
    cut = np.zeros((stages + 1, count + 1), dtype=int)
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, count + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], count
    for s in range(stages, 0, -1):
        j = cut[s][i]
        sizes.append(int(i - j))
        i = j
    return sizes[::-1]


def layer_costs(model):
    """Cost of each layer for balancing: its parameters, plus one so no stage is empty of work."""
    return [model.layer_params(index) + 1 for index in range(len(model.layers))]


def split_sizes(total, parts):
    """``parts`` near-equal positive sizes adding up to ``total``."""
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def parse_balance(config, model):
    """``--balance`` as layers per stage, checked against the model; None to balance by parameters."""
    names = ", ".join(repr(layer) for layer in model.layers)
    if len(model.layers) < config.stages:
        raise UsageError(f"--stages {config.stages} needs at least {config.stages} layers, but --model "
                         f"{config.model} has {len(model.layers)}: {names}")
    if not config.balance:
        return None
    try:
        sizes = [int(part) for part in config.balance.split(",")]
    except ValueError:
        raise UsageError(f"--balance {config.balance!r}: give layers per stage as integers, e.g. 3,3") from None
    if len(sizes) != config.stages or sum(sizes) != len(model.layers) or min(sizes) < 1:
        raise UsageError(f"--balance {config.balance} gives {len(sizes)} stages with {sum(sizes)} layers, but "
                         f"--stages is {config.stages} and --model {config.model} has {len(model.layers)} layers "
                         f"({names}); each stage needs at least one")
    return sizes


@register
class PipelineStrategy(Strategy):
    """Pipeline parallelism, optionally replicated for data parallelism.

    Args:
        stages: ``P``, ranks per pipeline.
        micro_batches: ``M``, micro-batches per step.
        schedule_name: "gpipe" or "1f1b".
        balance: layers per stage, or None to balance by parameters.
        global_batch: the global batch size (micro-batch weights).
    """

    name = "pipeline"
    options = (
        Option("stages", 1, "pipeline: ranks per model replica, each holding consecutive layers"),
        Option("micro_batches", 4, "pipeline: micro-batches each replica's batch is cut into"),
        Option("schedule", "1f1b", "pipeline: 1f1b (at most P micro-batches in flight) or gpipe (all M)",
               ("1f1b", "gpipe")),
        Option("balance", "", "pipeline: layers per stage, e.g. 3,3 ('' = balance by parameters)"),
    )

    @classmethod
    def check(cls, settings, world_size):
        if settings.stages < 1 or settings.micro_batches < 1:
            raise UsageError(f"--stages and --micro-batches must be at least 1, got {settings.stages} and "
                             f"{settings.micro_batches}")
        if world_size % settings.stages:
            raise UsageError(f"--stages {settings.stages} does not divide the {world_size} ranks (ranks = stages x "
                             "data-parallel replicas)")
        replicas = world_size // settings.stages
        if settings.batch_size // replicas < settings.micro_batches:
            raise UsageError(f"--batch-size {settings.batch_size} over {replicas} replica(s) leaves "
                             f"{settings.batch_size // replicas} samples per replica, fewer than "
                             f"--micro-batches {settings.micro_batches}")
        if settings.replication == "in-graph":
            raise UsageError("--replication in-graph does not combine with --strategy pipeline (its first and "
                             "last stages read the data)")

    @classmethod
    def layout_text(cls, settings, cluster):
        return (f"{settings.stages} stages x {cluster.size // settings.stages} replica(s) ({settings.schedule}, "
                f"{settings.micro_batches} micro-batches)")

    @classmethod
    def data_layout(cls, settings, cluster):
        """A pipeline's ``P`` stages of one replica read the same shard (the first stage its samples, the last its labels)."""
        return cluster.size // settings.stages, cluster.rank // settings.stages

    @classmethod
    def check_model(cls, settings, model):
        parse_balance(settings, model)

    @classmethod
    def arguments(cls, settings, setup):
        return {"stages": settings.stages, "micro_batches": settings.micro_batches,
                "schedule_name": settings.schedule, "balance": parse_balance(settings, setup.model),
                "global_batch": settings.batch_size}

    def __init__(self, *args, stages, micro_batches, schedule_name, balance=None, global_batch, **kwargs):
        super().__init__(*args, **kwargs)
        full, cluster = self.model, self.cluster
        world = cluster.world
        self.full = full
        self.stages, self.micro_batches, self.schedule_name = int(stages), int(micro_batches), schedule_name
        self.global_batch = int(global_batch)
        self.replica, self.stage = divmod(cluster.rank, self.stages)
        self.replicas = cluster.size // self.stages
        self.balance = list(balance) if balance else balance_by_parameters(layer_costs(full), self.stages)
        starts = np.concatenate([[0], np.cumsum(self.balance)]).astype(int)
        self.first_layer, self.end_layer = int(starts[self.stage]), int(starts[self.stage + 1])
        self.param_lo = sum(full.layer_params(i) for i in range(self.first_layer))
        self.in_shape = full.shapes[self.first_layer]
        self.out_shape = full.shapes[self.end_layer] if self.end_layer < len(full.layers) else full.output_shape
        self.model = Sequential(full.layers[self.first_layer:self.end_layer], self.in_shape, xp=full.xp,
                                dtype=full.dtype)
        self.param_hi = self.param_lo + self.model.num_params
        self.is_first, self.is_last = self.stage == 0, self.stage == self.stages - 1
        self.pipe = world.Split(self.replica, key=self.stage)      # this replica's stages
        self.peers = world.Split(self.stage, key=self.replica)     # this stage in every replica
        self.accumulated = full.xp.zeros(self.model.num_params + 1, dtype=full.dtype)   # gradients, then loss
        self.optimizer = self.make_optimizer(self.model.num_params, self.param_lo)
        self.plan = schedule(schedule_name, self.stage, self.stages, self.micro_batches)
        self.model.use_workspace(self.loss)
        self.slots = SlotPool()
        self.count(steps=0, pipeline_s=0.0, idle_s=0.0, peak_activations=0)

    @property
    def worker_index(self):
        return self.replica

    def describe(self, rank):
        """Role-table text for this rank."""
        return (f"stage {self.stage}/{self.stages} layers {self.first_layer}-{self.end_layer - 1}"
                + (f" replica {self.replica}" if self.replicas > 1 else ""))

    def initialize(self, checkpoint=None):
        cluster = self.cluster
        whole = np.zeros(self.full.num_params, dtype=self.full.dtype)
        if cluster.is_chief:
            if checkpoint is None:
                self.full.init_params(self.seed)
                whole[...] = to_host(self.full.params)
            else:
                whole[...] = checkpoint.params
        mpi.bcast(cluster.world, whole, root=cluster.chief_rank)
        self.model.params[...] = self.model.xp.asarray(whole[self.param_lo:self.param_hi])
        if checkpoint is not None and self.optimizer is not None:
            state = {name: array[self.param_lo:self.param_hi] for name, array in checkpoint.optimizer_state.items()}
            self.optimizer.load_state(state, checkpoint.optimizer_steps)

    def _recv(self, buffer, source, tag, flow=None):
        """Receive ``buffer`` from stage ``source``; ``flow``: ``(step, round)`` to draw the sender's arrow (--trace)."""
        start = time.perf_counter()
        self.track("exchange")
        with TRACER.span("recv", "pipeline", source=source, tag=tag):
            mpi.recv(self.pipe, buffer, source, tag)
            if flow is not None and TRACER.on:
                TRACER.flow(False, recorder.flow_id(self.replica, *flow, source, tag), "activations" if tag % 2 == 0
                            else "gradients")
        self.track("compute")
        self.figures["idle_s"] += time.perf_counter() - start
        return buffer

    def _flow(self, step, round_index, tag, name):
        """--trace: an arrow starts here, to the receive of the same (step, round, stage, tag)."""
        if TRACER.on:
            TRACER.flow(True, recorder.flow_id(self.replica, step, round_index, self.stage, tag), name)

    def _slot_array(self, slot, name, shape):
        """A receive buffer kept in the micro-batch's workspace slot (the same array every step)."""
        workspace = self.model.workspace
        workspace.slot = slot
        return workspace.array(self, name, tuple(shape), self.model.dtype)

    def train_step(self, x, y, weight, step):
        """One step: the schedule runs once per ``--accumulate`` slice, adding into the same gradients."""
        self.accumulated[...] = 0
        start = time.perf_counter()
        # (every stage of a replica reads the same batch: the first uses its samples, the last its labels)
        bounds = np.linspace(0, len(x), self.recipe.accumulate + 1).round().astype(int)
        loss_sum = 0.0
        for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            loss_sum += self._run_schedule(x[lo:hi], y[lo:hi], hi - lo, step, index)
        self.figures["pipeline_s"] += time.perf_counter() - start
        self.figures["steps"] += 1
        self.accumulated[-1] = loss_sum
        if self.replicas > 1:
            mpi.allreduce_sum(self.peers, self.accumulated)
        # stages hold different gradients and only the last sees the loss: skip everywhere or nowhere.  One
        # Allreduce gives both the verdict and the global squared norm (each replica's stages hold the same)
        squares = np.array([float(self.accumulated[:-1].dot(self.accumulated[:-1])),
                            0.0 * float(self.accumulated[-1])])   # (0 x NaN or Inf is NaN: a broken loss shows)
        self.cluster.world.Allreduce(MPI.IN_PLACE, squares, op=MPI.SUM)
        self.track("compute")
        self.skipped = not np.isfinite(squares).all()
        self.clipped = False
        if not self.skipped:
            self.clip(self.accumulated[:-1], squared_norm=float(squares[0]) / self.replicas)
            self.optimizer.step(self.model.params, self.accumulated[:-1], self.recipe.lr(step))
        loss = self._to_chief(np.array([np.nan if self.skipped else float(self.accumulated[-1])]), tag=77)[0]
        if self.stages > 1:   # the chief reports the training figures replica 0's last stage counted
            sent = self.take_train_counts() if self.is_last and self.replica == 0 else [0.0, 0]
            counts = self._to_chief(np.array(sent, dtype=np.float64), tag=79)
            if self.cluster.is_chief:
                self.train_counts = [self.train_counts[0] + float(counts[0]), self.train_counts[1] + int(counts[1])]
        return float(loss) if self.cluster.is_chief or self.is_last else math.nan

    def _run_schedule(self, x, y, rows, step, round_index):
        """The schedule over one slice of ``rows`` samples; adds into :attr:`accumulated`; the weighted loss."""
        xp, model = self.model.xp, self.model
        sizes = split_sizes(rows, self.micro_batches)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        parts = [slice(int(offsets[i]), int(offsets[i + 1])) for i in range(self.micro_batches)]
        inputs, outputs, stashes, grads_in, grads_out, sends = {}, {}, {}, {}, {}, []
        slots, sent = {}, {}   # micro-batch -> its workspace slot; -> its send requests so far
        loss_sum, held = 0.0, 0
        self.track("compute")
        for op, i in self.plan:
            if op == "recv_fwd":
                slots[i] = self.slots.take()
                inputs[i] = self._recv(self._slot_array(slots[i], "input", (sizes[i],) + self.in_shape),
                                       self.stage - 1, 2 * i, flow=(step, round_index))
            elif op == "fwd":
                if i not in slots:
                    slots[i] = self.slots.take()
                model.workspace.slot = slots[i]
                model.reseed(self.seed, self.replica, step, round_index * self.micro_batches + i)
                with TRACER.span("forward", "compute", micro_batch=i):
                    out = model.forward(x[parts[i]] if self.is_first else inputs.pop(i), training=True)
                if self.is_last:
                    loss_sum += float(self.loss.forward(out, y[parts[i]])) * sizes[i] / self.global_batch
                    self.count_training(out, y[parts[i]])
                    stashes[i] = model.stash([self.loss])
                else:
                    stashes[i] = model.stash()
                    outputs[i] = xp.ascontiguousarray(out)
                held += 1
                self.figures["peak_activations"] = max(self.figures["peak_activations"], held)
            elif op == "send_fwd":
                with TRACER.span("send", "pipeline", to=self.stage + 1, tag=2 * i):
                    self._flow(step, round_index, 2 * i, "activations")
                    sends.append(mpi.isend(self.pipe, outputs.pop(i), self.stage + 1, 2 * i))
                sent.setdefault(i, []).append(sends[-1][0])
            elif op == "recv_bwd":
                grads_in[i] = self._recv(self._slot_array(slots[i], "grad_in", (sizes[i],) + self.out_shape),
                                         self.stage + 1, 2 * i + 1, flow=(step, round_index))
            elif op == "bwd":
                model.workspace.slot = slots[i]
                if self.is_last:
                    model.restore(stashes.pop(i), [self.loss])
                    dy = self.loss.backward(scale=sizes[i] / self.global_batch)
                else:
                    model.restore(stashes.pop(i))
                    dy = grads_in.pop(i)
                with TRACER.span("backward", "compute", micro_batch=i):
                    dx = model.backward(dy, input_grad=not self.is_first)
                self.accumulated[:-1] += model.grads
                held -= 1
                if self.is_first:
                    self.slots.release(slots.pop(i), sent.pop(i, []))
                else:
                    grads_out[i] = xp.ascontiguousarray(dx)
            elif op == "send_bwd":
                with TRACER.span("send", "pipeline", to=self.stage - 1, tag=2 * i + 1):
                    self._flow(step, round_index, 2 * i + 1, "gradients")
                    sends.append(mpi.isend(self.pipe, grads_out.pop(i), self.stage - 1, 2 * i + 1))
                # the slot's arrays are free again once what was sent from them has left
                self.slots.release(slots.pop(i), sent.pop(i, []) + [sends[-1][0]])
        waited = time.perf_counter()
        self.track("exchange")
        MPI.Request.Waitall([request for request, _ in sends])
        self.slots.reset()
        self.figures["idle_s"] += time.perf_counter() - waited
        return loss_sum

    def _to_chief(self, values, tag):
        """The last stage of replica 0 holds the global figures; the chief (rank 0) needs them.

        ``values`` is a float64 array, filled in place on the chief.
        """
        cluster, last = self.cluster, self.stages - 1
        if last == cluster.chief_rank:
            return values
        if cluster.rank == last:
            cluster.world.Send(values, dest=cluster.chief_rank, tag=tag)
        elif cluster.is_chief:
            cluster.world.Recv(values, source=last, tag=tag)
        return values

    def evaluate(self, batches):
        """Forward-only pipeline over this replica's test chunks; the chief gets the sums' figures (others: NaN)."""
        scoring = self.scoring   # (the whole model's outputs: the last stage's)
        totals = scoring.zeros()
        for x, y in batches:
            x = self.model.xp.asarray(x)
            inp = x if self.is_first else self._recv(self.model.xp.empty((len(x),) + self.in_shape, dtype=self.model.dtype),
                                                              self.stage - 1, 0)
            out = self.model.forward(inp, training=False)
            if self.is_last:
                y = self.model.xp.asarray(y)
                scoring.add(totals, out, y, float(self.loss.forward(out, y)), self.model.xp)
            else:
                request, _ = mpi.isend(self.pipe, self.model.xp.ascontiguousarray(out), self.stage + 1, 0)
                request.Wait()
        if self.is_last and self.replicas > 1:
            totals = mpi.sum_float64(self.peers, totals)
        return scoring.figures(self._to_chief(np.asarray(totals, dtype=np.float64), tag=78))

    def state(self):
        """Collective: replica 0's stages send their slices to the chief."""
        cluster, full = self.cluster, self.full
        counts = np.zeros(cluster.size, dtype=np.int64)
        displs = np.zeros(cluster.size, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(self.balance)]).astype(int)
        offsets = [sum(full.layer_params(i) for i in range(int(a))) for a in starts]
        for stage in range(self.stages):   # world ranks 0..P-1 are replica 0's stages
            counts[stage], displs[stage] = offsets[stage + 1] - offsets[stage], offsets[stage]
        arrays = {"params": to_host(self.model.params)}
        arrays.update({name: to_host(a) for name, a in self.optimizer.state_arrays().items()})
        whole = {}
        for name, part in arrays.items():
            target = np.zeros(full.num_params, dtype=full.dtype) if cluster.is_chief else None
            send = part if self.replica == 0 else part[:0]
            whole[name] = mpi.gatherv(cluster.world, send, target, counts, displs, cluster.chief_rank)
        if not cluster.is_chief:
            return None
        params = whole.pop("params")
        return params, whole, self.optimizer.steps

    def stats(self):
        f = self.figures
        return {"stage": self.stage, "replica": self.replica, "layers": [self.first_layer, self.end_layer],
                "peak_activations": f["peak_activations"],
                "bubble": f["idle_s"] / f["pipeline_s"] if f["pipeline_s"] else 0.0}

    def close(self):
        self.pipe.Free()
        self.peers.Free()
