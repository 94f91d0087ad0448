"""A replicated worker's state (:class:`ReplicaState`): at the start (drawn or read, alike on every worker),
in a checkpoint (the chief's, with each worker's own rows gathered), back from one, and for the survivors
of a lost worker (:class:`ChiefHoldsAll`).

Mixed into :class:`~mpidist.parallel.data.replicated.DataParallel` before
:class:`~mpidist.parallel.base.Strategy` (whose
:class:`~mpidist.parallel.saved_state.SavedState` it refines): the step is
that class's concern, what a replica's state is this one's.
"""

import dataclasses

import numpy as np

from ...runtime import comm as mpi
from ...runtime.xp import to_host
from ..recovery import Recovery
from ..saved_state import WholeState


class ChiefHoldsAll(Recovery):
    """A data-parallel strategy's survivors: the chief holds the whole state (the old chief, or the worker in
    its place, whose parameters and optimizer state are every worker's)."""

    def survivor_state(self, cluster, step):
        """The state as the survivors' chief holds it (``cluster``'s)."""
        strategy = self.strategy
        # (check() refuses --elastic with --shard: a slice is not the whole state)
        if strategy.part is not None:
            raise RuntimeError("--shard optimizer does not run with --elastic")
        if not cluster.is_chief:  # (the old communicators are revoked: nothing collective, no averaging)
            return None
        arrays = {name: to_host(array) for name, array in strategy.optimizer.state_arrays().items()}
        return WholeState(to_host(strategy.model.params), arrays, strategy.optimizer.steps)


class ReplicaState:
    """What a data-parallel worker's state is, whole on the chief or placed where a tensor group splits the
    model (a mixin: it reads the strategy's model, optimizer, exchange, tensor part and workers)."""

    def state(self):
        """Collective over the workers: the chief's state, with every worker's :meth:`own_state` gathered (if
        any)."""
        self.average_running()
        if self.placement is not None:  # the parts of the first tensor group gather theirs on the chief
            return self._gathered_parts()
        state = super().state()
        # (the window's copy goes when the strategy does: the chief's result is a copy, which its model keeps
        # once the window is freed)
        if state is not None and self.exchange.holds_params:
            state = dataclasses.replace(state, params=state.params.copy())
        comm, own = self.worker_comm, self.own_state()
        if comm is None or comm.Get_size() == 1 or not own:
            return state
        size, n = comm.Get_size(), self.model.num_params
        rows = {}
        for name in sorted(own):  # (the same order on every worker)
            mine = np.ascontiguousarray(to_host(own[name]))
            rows[name] = np.empty((size, n), dtype=mine.dtype) if comm.Get_rank() == 0 else None
            mpi.gatherv(comm, mine, rows[name], [n] * size, [n * worker for worker in range(size)], root=0)
        return state if state is None else dataclasses.replace(state, per_worker=rows)

    def placed_state(self):
        """Collective over the workers (their running statistics averaged first), as :meth:`state` is."""
        self.average_running()
        return super().placed_state()

    def _gathered_parts(self):
        """Collective over the first tensor group: the whole model's state, gathered from its parts, on the
        chief."""
        arrays = {
            "params": to_host(self.model.params),
            **{name: to_host(array) for name, array in self.optimizer.state_arrays().items()},
        }
        whole = self.tensor.gather(arrays) if self.worker_index == 0 else None
        if not self.cluster.is_chief:
            return None
        return WholeState(whole.pop("params"), whole, self.optimizer.steps)

    def initialize(self, checkpoint=None):
        # every part draws (or reads) its slices of the whole model's start alone
        if self.placement is not None:
            params = self.model.params
            if checkpoint is not None:  # (read into place: this part's slices, one array at a time)
                self.restore(checkpoint)
            elif self.model.xp is np:  # (drawn into place)
                self.tensor.initial(self.passes.seed, out=params)
            else:
                params[...] = self.model.xp.asarray(self.tensor.initial(self.passes.seed))
            return
        comm = self.worker_comm
        if self.mixed is not None:  # (a 16-bit model: its float32 master, the same on every worker)
            self.mixed.initialize(comm, self.passes.seed, checkpoint)
        else:
            if comm is None or comm.Get_rank() == 0:
                if checkpoint is None:
                    self.model.init_params(self.passes.seed)
                else:
                    self.model.params[...] = self.model.xp.asarray(checkpoint.params)
            if self.exchange.holds_params:  # each node's copy from the chief's node, written once per node
                self.exchange.share_initial()
            elif comm is not None:
                mpi.bcast(comm, self.model.params, root=0)
        if checkpoint is not None and self.optimizer is not None:
            self.optimizer.load_state(checkpoint.optimizer_state, checkpoint.optimizer_steps)
        self.restore_own_state(checkpoint)

    def trained_params(self):
        # (a 16-bit model is trained through its float32 master: that is what a checkpoint keeps)
        return self.model.params if self.mixed is None else self.mixed.master.current()

    def own_state(self):
        """This worker's arrays that differ from the other workers' (name -> flat array as long as the
        parameters, a view of the live one), which a checkpoint keeps row by row: the exchange's
        (``--compress``'s residuals)."""
        n = self.model.num_params
        return {name: array[:n] for name, array in self.exchange.own_state().items()}

    def restore_own_state(self, checkpoint):
        """Each worker's row of ``checkpoint.per_worker`` into its :meth:`own_state`; whether they were
        restored.

        Only where the checkpoint has a row for each of these workers: with
        another worker count every worker goes on from what :meth:`initialize`
        gave it (the checkpoint's parameters and the chief's optimizer state;
        zero residuals), the same everywhere.
        """
        comm, own = self.worker_comm, self.own_state()
        rows = checkpoint.per_worker if checkpoint is not None and checkpoint.per_worker else {}
        size = 1 if comm is None else comm.Get_size()
        if not own or not rows or any(len(row) != size for row in rows.values()):
            return False
        worker = 0 if comm is None else comm.Get_rank()
        for name, array in own.items():
            # (another optimizer's arrays are left out: it starts afresh, as initialize says)
            if name in rows:
                array[...] = self.model.xp.asarray(rows[name][worker])
        return True
