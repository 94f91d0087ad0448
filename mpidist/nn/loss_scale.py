"""Dynamic loss scaling for fp16: the factor the loss is multiplied by before backward, and how it moves.

fp16's smallest normal value is 6e-5: many gradients are smaller and would
flush to zero.  Backward runs on ``scale x loss`` instead, so every gradient
is ``scale`` times larger, and the update divides it back out in float32
(:class:`~mpidist.nn.precision.MasterWeights`).  Too large a scale overflows
(an Inf in the gradient): the step's verdict skips that step, as it skips any
step that is not finite, and the scale halves; after
:data:`GROWTH_INTERVAL` steps in a row without an overflow it doubles.  The
same rule as PyTorch's ``GradScaler`` and Megatron's ``DynamicGradScaler``,
with their constants.  bfloat16 and float32 need none (:meth:`LossScale.none`).

Every worker decides on the same summed gradient, so every worker's scale is
the same; it is a pure function of the verdicts, tested by a table.
"""

import dataclasses

#: the first scale (2^16, as GradScaler's)
INITIAL = 2.0**16
#: steps without an overflow after which the scale doubles
GROWTH_INTERVAL = 2000
#: the scale never goes below this (a scale below 1 would shrink the gradients it exists to lift)
SMALLEST = 1.0


@dataclasses.dataclass(frozen=True)
class LossScale:
    """A loss scale and its history.

    Attributes:
        value: what the loss is multiplied by before backward.
        good_steps: steps in a row without an overflow since the scale last changed.
        dynamic: whether it moves (fp16); a static scale stays as it is.
    """

    value: float = INITIAL
    good_steps: int = 0
    dynamic: bool = True

    @classmethod
    def none(cls):
        """The scale of a run that needs none (float32, bf16): 1, for good."""
        return cls(1.0, 0, False)

    @classmethod
    def for_precision(cls, precision):
        """Dynamic for ``"fp16"``, :meth:`none` otherwise."""
        return cls() if precision == "fp16" else cls.none()

    def after(self, overflowed):
        """The scale for the next step, after a step that ``overflowed`` (skipped) or not.

        >>> LossScale(8.0).after(True)
        LossScale(value=4.0, good_steps=0, dynamic=True)
        >>> LossScale(8.0, GROWTH_INTERVAL - 1).after(False)
        LossScale(value=16.0, good_steps=0, dynamic=True)
        """
        if not self.dynamic:
            return self
        if overflowed:
            return LossScale(max(SMALLEST, self.value / 2.0), 0)
        if self.good_steps + 1 >= GROWTH_INTERVAL:
            return LossScale(self.value * 2.0, 0)
        return LossScale(self.value, self.good_steps + 1)
