"""What a strategy's state is for a checkpoint, and how a checkpoint's state comes back into it.

Where every rank (or the chief, after a gather) can hold the whole model, a
checkpoint is the whole state on the chief (:meth:`SavedState.state`).  Where
the strategy splits the model (its ``placement``: a pipeline stage, a tensor
part), each rank writes its own slices (:meth:`SavedState.placed_state`) and
reads them back into place (:meth:`SavedState.restore`): no rank holds the
whole.  A mixin of :class:`~mpidist.parallel.base.Strategy`, which gives
``model``, ``optimizer``, ``cluster`` and ``placement``.
"""

from ..runtime.xp import to_host


class SavedState:
    """A strategy's state for checkpoints (mixed into :class:`~mpidist.parallel.base.Strategy`)."""

    def state(self):
        """Collective: ``(params, optimizer arrays, optimizer steps)`` as host arrays on the chief, else None."""
        arrays = self.whole_optimizer_arrays()   # (collective where the optimizer state is sharded)
        if self.cluster is not None and not self.cluster.is_chief:
            return None
        return to_host(self.model.params), arrays, self.optimizer.steps

    def placed_state(self):
        """Collective like :meth:`state`, where the strategy splits the model (:attr:`placement`): this rank's own
        host buffers (``"params"``, ``"optimizer/<name>"``, ordered as the placement) and the optimizer's steps."""
        arrays = {"params": to_host(self.model.params)}
        arrays.update({f"optimizer/{name}": to_host(a) for name, a in self.optimizer.state_arrays().items()})
        return arrays, self.optimizer.steps

    def restore(self, checkpoint):
        """Where the strategy splits the model (:attr:`placement`): this rank's parameters and optimizer state
        from ``checkpoint``, its slices read into place."""
        optimizer = self.optimizer
        checkpoint.restore(self.placement, {"params": self.model.params,
                                            **(optimizer.state_arrays() if optimizer is not None else {})})
        if optimizer is not None and checkpoint.optimizer_state:
            optimizer.steps = int(checkpoint.optimizer_steps)

    def whole_optimizer_arrays(self):
        """The optimizer's state arrays, whole and in host memory, on the chief (None elsewhere); collective
        where each worker holds a slice of them."""
        if self.cluster is not None and not self.cluster.is_chief:
            return None
        return {name: to_host(a) for name, a in self.optimizer.state_arrays().items()}

