"""What a strategy's state is for a checkpoint, and how a checkpoint's state comes back into it.

Where every rank (or the chief, after a gather) can hold the whole model, a
checkpoint is the whole state on the chief (:meth:`SavedState.state`).  Where
the strategy splits the model (its ``placement``: a pipeline stage, a tensor
part), each rank writes its own slices (:meth:`SavedState.placed_state`) and
reads them back into place (:meth:`SavedState.restore`): no rank holds the
whole.  A mixin of :class:`~mpidist.parallel.base.Strategy`, which gives
``model``, ``optimizer``, ``cluster`` and ``placement``.
"""

import dataclasses

import numpy as np

from ..runtime.xp import to_host


@dataclasses.dataclass
class WholeState:
    """A model's training state, whole, in host memory (on the chief): what a checkpoint of one file holds.

    Attributes:
        params: the flat parameters.
        optimizer: the optimizer's state arrays (name -> flat array, ordered as ``params``).
        steps: the optimizer's step count.
        per_worker: where each worker holds state of its own (``local-sgd``, ``--compress``): name -> one row
            per
            worker; None where none does.
    """

    params: np.ndarray
    optimizer: dict
    steps: int
    per_worker: dict = None


@dataclasses.dataclass
class PlacedState:
    """This rank's slices of a split model's training state (:attr:`SavedState.placement`), in host memory.

    Attributes:
        arrays: ``"params"`` and ``"optimizer/<name>"`` -> this rank's flat buffers, ordered as the placement.
        steps: the optimizer's step count.
    """

    arrays: dict
    steps: int


class SavedState:
    """A strategy's state for checkpoints (mixed into :class:`~mpidist.parallel.base.Strategy`)."""

    def state(self):
        """Collective: the :class:`WholeState` on the chief, else None."""
        arrays = self.whole_optimizer_arrays()  # (collective where the optimizer state is sharded)
        if self.cluster is not None and not self.cluster.is_chief:
            return None
        return WholeState(to_host(self.trained_params()), arrays, self.optimizer.steps)

    def trained_params(self):
        """The parameters the optimizer updates, which a checkpoint keeps: the model's (a strategy that trains
        a 16-bit model through a float32 master copy gives that)."""
        return self.model.params

    def placed_state(self):
        """Collective like :meth:`state`, where the strategy splits the model (:attr:`placement`): this rank's
        :class:`PlacedState`."""
        arrays = {"params": to_host(self.held_buffer())}
        arrays.update({f"optimizer/{name}": to_host(a) for name, a in self.optimizer.state_arrays().items()})
        return PlacedState(arrays, self.optimizer.steps)

    def restore(self, checkpoint):
        """Where the strategy splits the model (:attr:`placement`): this rank's parameters and optimizer state
        from ``checkpoint``, its slices read into place."""
        optimizer = self.optimizer
        checkpoint.restore(
            self.placement,
            {"params": self.held_buffer(), **(optimizer.state_arrays() if optimizer is not None else {})},
        )
        if optimizer is not None and checkpoint.optimizer_state:
            optimizer.steps = int(checkpoint.optimizer_steps)

    def held_buffer(self):
        """This rank's parameters as its :attr:`placement` orders them (the model's flat buffer, unless the
        strategy keeps them elsewhere)."""
        return self.model.params

    def whole_optimizer_arrays(self):
        """The optimizer's state arrays, whole and in host memory, on the chief (None elsewhere); collective
        where each worker holds a slice of them."""
        if self.cluster is not None and not self.cluster.is_chief:
            return None
        return {name: to_host(a) for name, a in self.optimizer.state_arrays().items()}
