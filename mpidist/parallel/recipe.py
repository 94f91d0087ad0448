"""What every strategy applies around its optimizer: the step's learning rate, clipping, accumulation.

The optimizer stays MPI-free (:mod:`mpidist.nn.optimizers`); a strategy asks
its :class:`Recipe` for the learning rate of the step an update belongs to,
and for the factor that clips the *summed* gradient to ``clip_norm`` by its
global norm.  How that norm is summed depends on where the gradient lives,
so each strategy reduces the squared norm its way (see :func:`clip_factor`):

* ``local``, ``allreduce``: every worker holds the whole summed gradient;
* ``ps-sync`` (and backup workers): each ps holds a shard of it, and the
  shards' squared norms are summed once per step;
* ``pipeline``: each stage holds its layers' part, summed over the stages once
  per step;
* ``ps-async`` and ``local-sgd``: no summed gradient ever exists -- each worker
  clips the gradient it sends (its own batch's).
"""

import dataclasses
import math

from ..nn.schedules import LearningRate


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The training recipe around the optimizer.

    Attributes:
        learning_rate: ``step -> lr`` (a :class:`~mpidist.nn.schedules.LearningRate`);
            None keeps the optimizer's own ``lr``.
        clip_norm: largest global norm of the summed gradient (0 = no clipping).
        accumulate: slices each worker's share of a batch is computed in, one
            after the other, before the one exchange of the step.
    """

    learning_rate: object = None
    clip_norm: float = 0.0
    accumulate: int = 1

    def lr(self, step):
        """The learning rate of the update computed at ``step`` (None: the optimizer's own)."""
        return None if self.learning_rate is None else self.learning_rate(step)


def clip_factor(squared_norm, clip_norm):
    """The factor that brings a gradient of squared global norm ``squared_norm`` down to ``clip_norm``.

    1.0 when clipping is off, the norm is within the limit, or the norm is not
    finite (that step is skipped anyway).

    >>> clip_factor(25.0, 1.0)
    0.2
    >>> clip_factor(0.25, 1.0)
    1.0
    """
    if not clip_norm or not math.isfinite(squared_norm):
        return 1.0
    norm = math.sqrt(squared_norm)
    return clip_norm / norm if norm > clip_norm else 1.0


def recipe_for(settings, total_steps, steps_per_epoch):
    """The :class:`Recipe` of a run's ``settings`` (``total_steps`` and ``steps_per_epoch`` of its data)."""
    warmup = settings.warmup_steps or round(settings.warmup_epochs * steps_per_epoch)
    schedule = LearningRate(
        settings.lr,
        settings.lr_schedule,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        warmup_steps=warmup,
        warmup_from=settings.warmup_from,
        gamma=settings.lr_gamma,
        step_epochs=settings.lr_step_epochs,
        minimum=settings.lr_min,
    )
    return Recipe(learning_rate=schedule, clip_norm=settings.clip_norm, accumulate=settings.accumulate)


def total_steps(config, setup):
    """Steps the run takes: epochs of the data, or fewer with ``--steps``."""
    steps = setup.steps_per_epoch * config.epochs
    return min(steps, config.steps) if config.steps else steps
