"""Learning-rate schedules: the learning rate of each step, as a pure function of the step.

A schedule is a function of the run's step alone, never of how many updates an
optimizer has applied, so every worker, every parameter server and every
pipeline stage computes the same rate for the same step, and a run resumed from
a checkpoint at step ``s`` continues with exactly the rate step ``s`` had.

Warm-up (Goyal et al., "Accurate, Large Minibatch SGD") ramps the rate
linearly over the first ``warmup_steps`` steps, from ``warmup_from x lr`` at
step 0 to ``lr`` at step ``warmup_steps``; the schedule takes over from there:

===============  ==============================================================
``constant``     ``lr``
``step``         ``lr x gamma ** floor(epoch / step_epochs)``
``exponential``  ``lr x gamma ** floor(epoch)``
``cosine``       ``minimum + (lr - minimum) x (1 + cos(pi x p)) / 2``
``linear``       ``lr + (minimum - lr) x p``
===============  ==============================================================

where ``epoch = step / steps_per_epoch`` and ``p`` is the progress after the
warm-up, ``(step - warmup_steps) / (total_steps - warmup_steps)``, from 0 to
1.  ``step`` and ``exponential`` count epochs from the start of the run, so a
warm-up does not shift their milestones.
"""

import math

#: The names ``--lr-schedule`` takes.
SCHEDULES = ("constant", "step", "exponential", "cosine", "linear")


class LearningRate:
    """The learning rate of each step: ``LearningRate(0.1, "cosine", total_steps=1000)(step)``.

    Args:
        lr: the peak (base) learning rate.
        kind: one of :data:`SCHEDULES`.
        total_steps: steps of the whole run (cosine and linear reach ``minimum`` there).
        steps_per_epoch: steps in one epoch (step and exponential schedules count epochs).
        warmup_steps: steps of the linear warm-up (0 = none).
        warmup_from: the warm-up's first rate, as a fraction of ``lr``.
        gamma: the factor of ``step`` (every ``step_epochs`` epochs) and ``exponential`` (every epoch).
        step_epochs: epochs between the ``step`` schedule's cuts.
        minimum: the rate cosine and linear decay to.
    """

    def __init__(
        self,
        lr,
        kind="constant",
        total_steps=1,
        steps_per_epoch=1,
        warmup_steps=0,
        warmup_from=0.1,
        gamma=0.1,
        step_epochs=10,
        minimum=0.0,
    ):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {kind!r}; choose from {', '.join(SCHEDULES)}")
        self.lr, self.kind = float(lr), kind
        self.total_steps, self.steps_per_epoch = max(int(total_steps), 1), max(int(steps_per_epoch), 1)
        self.warmup_steps, self.warmup_from = max(int(warmup_steps), 0), float(warmup_from)
        self.gamma, self.step_epochs, self.minimum = float(gamma), max(int(step_epochs), 1), float(minimum)

    def __call__(self, step):
        """The learning rate of the update computed at ``step`` (0 = the run's first)."""
        step = max(int(step), 0)
        if step < self.warmup_steps:
            return self.lr * (self.warmup_from + (1.0 - self.warmup_from) * step / self.warmup_steps)
        return self._after_warmup(step)

    def _after_warmup(self, step):
        if self.kind == "constant":
            return self.lr
        epoch = step // self.steps_per_epoch
        if self.kind == "step":
            return self.lr * self.gamma ** (epoch // self.step_epochs)
        if self.kind == "exponential":
            return self.lr * self.gamma**epoch
        span = self.total_steps - self.warmup_steps
        progress = min((step - self.warmup_steps) / span, 1.0) if span > 0 else 1.0
        if self.kind == "cosine":
            return self.minimum + (self.lr - self.minimum) * (1.0 + math.cos(math.pi * progress)) / 2.0
        return self.lr + (self.minimum - self.lr) * progress  # linear

    def __repr__(self):
        return (
            f"LearningRate({self.lr}, {self.kind!r}, total_steps={self.total_steps}, "
            f"warmup_steps={self.warmup_steps})"
        )


def constant(lr):
    """A schedule that is ``lr`` at every step."""
    return LearningRate(lr)
