"""``allreduce --shard parameters``: fully sharded data parallelism (ZeRO stage 3, PyTorch FSDP).

Each of ``W`` workers holds ``1/W`` of every unit's parameters, gradients
and optimizer state (:mod:`mpidist.parallel.data.units`), and nothing of the model
whole: a unit's parameters are gathered into a workspace just before its
forward (and again before its backward, unless ``--no-reshard-after-forward``
keeps them), the next unit's gather in flight while this one computes; its
gradients are reduce-scattered to their owners as soon as backward has made
them (:mod:`mpidist.parallel.data.gathering`), and each worker's optimizer updates
its shards.  A worker's memory falls as workers are added: 16/W bytes a
parameter in float32 with Adam, plus at most two gathered units (one, where
two do not fit: the set-up's price chooses, the same on every worker).

The shards are regions of the whole model's parameters (its
:attr:`placement`), so every worker draws its initial values alone, and its
checkpoints are sharded: each worker writes its shards and reads them back,
from a checkpoint of any layout.  Whether a step is skipped or clipped is the
verdict on the shards' squared norms and the loss, summed in one small
``Allreduce``, the same on every worker.
"""

import numpy as np
from mpi4py import MPI

from ...runtime import aligned
from ..base import Strategy
from ..mesh import Mesh, ReplicaWorkers
from ..parts import split_over
from ..verdict import agree
from .declared import AllreduceDeclared
from .gathering import UnitGathers
from .unit_routes import unit_route
from .units import ShardedUnits, sliced, units_of, window_bytes


class FullyShardedStrategy(AllreduceDeclared, ReplicaWorkers, Strategy):
    """Workers holding a shard of every unit of the model, each unit gathered as it runs.

    Args:
        keep: keep each unit gathered from its forward to its backward (``--no-reshard-after-forward``).
        prefetch: gather the next unit while one runs (two units in flight); False where they do not fit
            (the set-up's price chose it): one unit of parameters and one of gradients at a time.
        exchange: ``--exchange``: "auto" gathers each unit once per node where the node's workers can share
            it, "node" insists, "mpi" gathers it on every worker (:func:`~.unit_routes.unit_route`).
        (the others as :class:`~mpidist.parallel.base.Strategy`'s)
    """

    elastic_recovery = False  # (a lost worker takes the only copy of its shards)
    chief_replaceable = False

    @classmethod
    def arguments(cls, settings, setup):
        return {
            "keep": not settings.reshard_after_forward,
            "prefetch": setup.prefetch,
            "exchange": settings.exchange,
            "tensor": settings.tensor,
        }

    def __init__(
        self,
        model,
        loss,
        make_optimizer=None,
        cluster=None,
        *args,
        keep=False,
        prefetch=True,
        exchange="auto",
        tensor=1,
        **kwargs,
    ):
        #: the workers' grid (made and freed here): replicas of ``tensor`` parts, each part sharded over the
        #: replicas
        self.mesh = Mesh(None if cluster is None else cluster.workers, parts=tensor)
        self.tensor = split_over(model, self.mesh, writes=True, buffers=False)
        super().__init__(self.tensor.model, loss, make_optimizer, cluster, *args, **kwargs)
        whole, model = model, self.model
        comm = MPI.COMM_SELF if self.worker_comm is None else self.worker_comm
        units = units_of(model.offsets, model.num_params, self.bucket_bytes, model.dtype.itemsize)
        ranks, itemsize = comm.Get_size(), model.dtype.itemsize
        #: how the units travel: gathered on each worker, or once per node (collective: the same everywhere)
        self.route = unit_route(
            comm,
            exchange,
            model.xp,
            lambda sharing: window_bytes(units, keep, ranks, prefetch, sharing, itemsize),
        )
        #: this worker's shards of the units
        self.shards = ShardedUnits(units, self.route.ranks, self.route.index)
        self.placement = sliced(self.tensor.within(whole, 0), self.shards.pieces())
        self.params = aligned.zeros(model.xp, self.shards.size, model.dtype)
        self.grads = aligned.zeros(model.xp, self.shards.size, model.dtype)
        self.gathers = UnitGathers(
            comm,
            self.route,
            model,
            self.shards,
            self.params,
            self.grads,
            keep,
            prefetch,
        )
        model.gate = self.gathers
        self.optimizer = self.optimizers.make_pieces(self.shards.pieces())
        #: the parameters every part of a tensor group holds alike, in this worker's buffer of shards
        self.shared = self.shards.within(self.tensor.shared)

    def describe(self, rank):
        shards, part = self.shards, self.tensor.describe()
        text = f"1/{shards.ranks} of {len(shards.units)} unit(s)" + (f" of tensor {part}" if part else "")
        text += "" if self.gathers.prefetches or len(shards.units) < 2 else ", one unit in flight"
        return text + (f", gathered once per node of {self.route.sharing}" if self.route.sharing > 1 else "")

    def held_buffer(self):
        return self.params

    def initialize(self, checkpoint=None):
        # every worker draws (or reads) its shards of the whole model's start alone
        if checkpoint is not None:
            self.restore(checkpoint)
        elif self.model.xp is np:
            self.placement.initial(self.passes.seed, out=self.params)
        else:
            host = np.empty(self.shards.size, dtype=self.model.dtype)
            self.params[...] = self.model.xp.asarray(self.placement.initial(self.passes.seed, out=host))
        self.gathers.gathered.invalidate()

    def train_step(self, x, y, weight, step):
        loss = self._backprop(x, y, weight, step)
        self.track("exchange")
        squares = self.tensor.squares(self.grads, shared=self.shared)  # (a part's shared ones on part 0)
        # (over every worker: each holds its shard of its part; a tensor group's parts know the loss alike)
        every = None if self.cluster is None else self.cluster.workers
        carry = (loss * weight / self.tensor.parts,)
        verdict, (total,) = agree(every, squares, loss, self.recipe.clip_norm, carry=carry)
        verdict = self.judge(verdict)
        self.track("compute")
        if not verdict.skip:
            self.optimizer.step(self.params, verdict.scaled(self.grads), self.recipe.lr(step))
            self.gathers.gathered.invalidate()
        return float(total)

    def _backprop(self, x, y, weight, step):
        """Forward and backward over this worker's batch (in ``--accumulate``'s slices, each one's sums added
        to the shards'); returns its loss."""
        self.track("compute")
        passes, model, n, loss = self.passes, self.model, len(x), 0.0
        for index, lo, hi, _ in passes.slices(n, step, self.worker_index):
            share = (hi - lo) / n
            loss += float(passes.forward(x[lo:hi], y[lo:hi])) * share
            self.gathers.summed.begin(adds=index > 0)
            model.backward(
                self.loss.backward(scale=weight * share), input_grad=False, ready=self.gathers.ready
            )
            self.gathers.summed.finish()
        return loss

    def held_bytes(self):
        state = (
            sum(int(array.nbytes) for array in self.optimizer.state_arrays().values())
            if self.optimizer
            else 0
        )
        return {
            "params": int(self.params.nbytes),
            "grads": int(self.grads.nbytes),
            "optimizer_state": state,
            "gathered_units": self.gathers.nbytes,
        }

    def stats(self):
        return {
            **super().stats(),
            "held_bytes": self.held_bytes(),
            "units": len(self.shards.units),
            "bytes_sent": self.gathers.sent,
        }

    def free(self, keep=True):
        self.gathers.gathered.invalidate()
        self.gathers.own_slots()  # (the model's layers outlive the node's windows)
        self.route.free()
        self.mesh.free()
