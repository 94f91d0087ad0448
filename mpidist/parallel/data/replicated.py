"""The data-parallel step that ``local`` and ``allreduce`` share (and ``local-sgd`` builds on).

Every worker holds the whole model and computes gradients on its part of the
batch; an :class:`~mpidist.parallel.data.exchange.Exchange` (made by the subclass)
sums them over the workers while backward runs, and every worker applies the
same update to the same parameters.
"""

import numpy as np

from ...runtime import aligned
from ...nn.precision import is_low
from ...runtime import comm as mpi
from ..base import Strategy, synchronise_batch_norms
from ..mesh import Mesh, ReplicaWorkers
from ..parts import split_over
from .graphed_passes import GraphedPasses, why_eager
from .mixed import MixedPrecision
from .replica_state import ChiefHoldsAll, ReplicaState


def average_over(comm, array):
    """Collective over ``comm``: ``array`` (contiguous) becomes its mean over the ranks, or stays as it was.

    The sum is taken in a copy, written back once the collective succeeded: a
    collective that fails (a rank died in it) leaves its buffer undefined, and
    a local-sgd worker killed in an average left the survivors a partial sum
    of the parameters as theirs (the loss from 0.006 to 5.4 at the next step,
    2.6 points of test accuracy lost for good).  The copy is the size of what
    one call averages (a bucket of parameters, or the running statistics); a
    caller averaging a copy of its own calls :func:`mean_in_place`.
    """
    total = array.copy()
    mean_in_place(comm, total)
    array[...] = total


def mean_in_place(comm, array):
    """Collective over ``comm``: ``array`` (contiguous) becomes its mean over the ranks; undefined if it
    fails."""
    mpi.allreduce_sum(comm, array)
    array /= comm.Get_size()


def scale_of(mixed):
    """The loss scale of a step: a 16-bit model's (:class:`~mpidist.parallel.data.mixed.MixedPrecision`),
    or 1."""
    return 1.0 if mixed is None else mixed.loss_scale.value


class DataParallel(ReplicaWorkers, ReplicaState, Strategy):
    """Replicated model; gradients computed on each worker's shard, then exchanged.

    Gradients and the weighted batch loss share one buffer
    (``[grads..., loss]``), so a single exchange per step also yields the
    global loss.  Subclasses say how with :meth:`make_exchange`; the exchange
    starts during backward, as buckets of the buffer are filled.

    Running statistics (BatchNorm's) are each worker's own while it trains;
    they are averaged over the workers before each evaluation and checkpoint
    (with synchronised BatchNorm they are equal already).

    The workers are a :class:`~mpidist.parallel.mesh.Mesh` of replicas and
    tensor parts.  With ``T`` parts (``allreduce --tensor T``) the model is
    this rank's part of the whole (:attr:`tensor`), the workers it exchanges
    with are its replica axis (the same part of every tensor group), and the
    parts of a group agree on each step's skip and gradient norm.

    A model that computes in 16 bits (``--precision``) is trained through a
    float32 master copy (:attr:`mixed`): the exchange sums the 16-bit
    gradients, the optimizer updates the master from their float32 copy, and
    the 16-bit parameters are the master rounded; under fp16 the loss is
    scaled and the verdict takes the scale out.

    This class is the step; what a replica's state is (at the start, in a
    checkpoint, for survivors) is :class:`~mpidist.parallel.data.replica_state.ReplicaState`'s.
    """

    recovery_type = ChiefHoldsAll

    def __init__(self, model, loss, make_optimizer=None, cluster=None, *args, tensor=1, **kwargs):
        #: the workers' grid (made and freed here)
        self.mesh = Mesh(None if cluster is None else cluster.workers, parts=tensor)
        #: this rank's part of the model (the strategy trains it as it would the whole): a
        #: :class:`~mpidist.parallel.tensor.part.TensorPart`, or the model whole
        self.tensor = split_over(model, self.mesh, writes=self.mesh.index("replica") == 0)
        self.placement = self.tensor.placement
        super().__init__(self.tensor.model, loss, make_optimizer, cluster, *args, **kwargs)
        model = self.model
        self.buffer = aligned.zeros(model.xp, model.num_params + 1, model.dtype)
        model.bind_grads(self.buffer)
        self.running = model.running_entries()
        synchronise_batch_norms(model, self.worker_comm)
        self.exchange = self.make_exchange()
        if self.exchange.holds_buffer:  # the buffer moved into the exchange (shared memory)
            self._bind_buffer(self.exchange.buffer)
        if self.exchange.holds_params:  # one copy of the model per node
            model.bind_params(self.exchange.params, copy=False)
        self.part = self.optimizer_part()  # the slice this worker's optimizer updates (None: all of it)
        self.optimizer = (
            self.optimizers.make(model.num_params)
            if self.part is None
            else self.optimizers.make(self.part.size, self.part.lo)
        )
        #: where the model computes in 16 bits, its float32 master and loss scale; else None
        self.mixed = MixedPrecision(model, self.running) if is_low(model.dtype) else None
        #: why this worker's passes are not CUDA graphs (None: they are,
        #: :mod:`~mpidist.parallel.data.graphed_passes`)
        self.graphs_off = why_eager(model, self.recipe.accumulate, collective=tensor > 1)
        if self.graphs_off is None:
            self.passes.graphed = GraphedPasses(self.passes)

    def optimizer_part(self):
        """The :class:`~mpidist.parallel.data.optimizer_shard.OptimizerShard` this worker updates, or None
        (the whole model)."""
        return None

    def _bind_buffer(self, buffer):
        self.buffer = buffer
        self.model.bind_grads(buffer)

    def average_running(self):
        """Collective over the workers: every worker's running statistics become their mean."""
        comm = self.worker_comm
        if comm is None or comm.Get_size() == 1:
            return
        for lo, hi in self.running:
            average_over(comm, self.model.params[lo:hi])

    def evaluate(self, batches):
        self.average_running()
        return super().evaluate(batches)

    def _clip_space(self):
        """Where a clipped gradient goes when the exchange holds the buffer (made on the first use)."""
        if self.recipe.clip_norm and getattr(self, "_clipped", None) is None:
            self._clipped = aligned.empty(self.model.xp, self.model.num_params, self.model.dtype)
        return getattr(self, "_clipped", None)

    def make_exchange(self):
        """The :class:`~mpidist.parallel.data.exchange.Exchange` that sums ``self.buffer`` over the
        workers."""
        raise NotImplementedError

    def free(self, keep=True):
        # The exchange's memory (a node's shared window) goes: nothing may keep a view of it.  With ``keep``
        # True the model's buffers become copies.  At the end of a run, copying them on every rank lifted the
        # node's memory, at the very end, to what per-rank buffers would hold, for values nobody reads: a
        # finished run's gradients are let go (the next backward makes a buffer), and its parameters are the
        # chief's result (``keep``: :meth:`state`'s copy), which the chief's model keeps; elsewhere the
        # layers are left on zeros (mapped only where written).
        copies = keep is True
        if self.exchange.holds_buffer:
            if copies:
                self._bind_buffer(self.buffer.copy())
            else:
                self.buffer = None
                self.model.unbind_grads()
        if self.exchange.holds_params:
            kept = self.model.params.copy() if copies else keep if keep is not False else None
            if kept is None:
                kept = self.model.xp.zeros(self.model.num_params, dtype=self.model.dtype)
            self.model.bind_params(kept, copy=False)
        self.exchange.free()
        self.mesh.free()
        if self.passes.graphed is not None:  # (the model keeps its arrays; graphs and spare memory go)
            self.passes.graphed.graphs.free()

    def stats(self):
        figures = {**super().stats(), **(self.mixed.stats() if self.mixed is not None else {})}
        if self.model.xp is not np:  # (a GPU's: how its passes ran)
            graphed = self.passes.graphed
            figures["graphs"] = self.graphs_off if graphed is None else graphed.graphs.summary()
        return figures

    def train_step(self, x, y, weight, step):
        def loss_into_buffer(loss):  # the loss rides in the top bucket, the first to leave
            self.buffer[-1] = loss * weight

        self.track("exchange")  # begin() may wait for the workers (the shared-memory exchange's last barrier)
        self.exchange.begin()
        scale = scale_of(self.mixed)  # (fp16: backward runs on the scaled loss)
        self.backprop(x, y, weight * scale, step, before_backward=loss_into_buffer, ready=self.exchange.ready)
        self.track("exchange")
        self.exchange.finish()
        self.track("compute")  # (the optimizer's step)
        verdict = self.judge(self.verdict())
        if self.mixed is not None:
            self.mixed.judged(verdict)
        if not verdict.skip:
            self.update(self._clipped_gradient(verdict), step)
        # (one copy per node: every part is updated before anyone reads the parameters)
        self.exchange.after_update()
        return float(self.buffer[-1])

    def verdict(self):
        """The step's :class:`~mpidist.parallel.verdict.Verdict`, once the exchange has finished.

        Every worker holds the same summed buffer and the exchange its squared
        norm, so every worker decides the same; the parts of a tensor group
        decide together (one small ``Allreduce``).
        """
        return self.tensor.verdict(
            self.model.grads,
            self.exchange.squared_norm(),
            float(self.buffer[-1]),
            self.recipe.clip_norm,
            scale_of(self.mixed),
        )

    def _clipped_gradient(self, verdict):
        """The summed gradient multiplied by the verdict's ``factor``: only the part this worker updates where
        it updates one (one copy per node: the others' parts are theirs to read; ``--shard optimizer``), and
        into a space of its own where other workers still read the buffer (the shared-memory exchange)."""
        grads = self.model.grads
        if self.mixed is not None:  # (taken out in float32: unscaled in 16 bits, a gradient would underflow)
            return self.mixed.gradient(grads, verdict)
        if self.part is not None:
            verdict.scaled(grads[self.part.lo : self.part.hi])
            return grads
        space = self._clip_space() if self.exchange.holds_buffer else None
        return verdict.scaled(grads, out=space, xp=self.model.xp)

    def update(self, grads, step):
        """The optimizer's step from the summed (and clipped) ``grads``, the same on every worker (on the
        float32 master, rounded into the model after, where the model computes in 16 bits)."""
        if self.mixed is None:
            self.optimizer.step(self.model.params, grads, self.recipe.lr(step))
        else:
            self.mixed.step(self.optimizer, grads, self.recipe.lr(step))
