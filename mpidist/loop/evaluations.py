"""A run's evaluations: the latest figures of each split, the best validation so far, and where they were taken."""

import math

from .callbacks import lower_is_better


class BestSoFar:
    """The best value of a validation figure so far (``--keep-best``): lower is better for losses and errors."""

    def __init__(self, figure, stored=None):
        self.figure = figure
        self.lower = lower_is_better(figure)   # (the rule --early-stop follows too)
        self.value, self.step = None, None
        if stored and stored.get("figure") == figure:   # a resumed run's checkpoint: the best it had seen
            self.value, self.step = stored["value"], stored["step"]

    def record(self):
        """What a checkpoint stores of it (None before the first value, or without ``--keep-best``)."""
        if not self.figure or self.value is None:
            return None
        return {"figure": self.figure, "value": self.value, "step": self.step}

    def offer(self, value, step):
        """Whether ``value`` (at ``step``) beats the best so far; it becomes the best if so.  NaN never does."""
        if not math.isfinite(value):
            return False
        if self.value is not None and (value >= self.value if self.lower else value <= self.value):
            return False
        self.value, self.step = value, step
        return True


class Evaluations:
    """The figures of the last evaluation of each split (``test``, ``val``) and the step each was taken at.

    Args:
        splits: the dataset's splits (``val`` among them where a validation split exists).
        keep_best: the ``--keep-best`` figure ("" for none).
        stored_best: what a resumed checkpoint stored of the best so far (None for a new run).
        early_stopping: the run's :class:`~mpidist.loop.callbacks.EarlyStopping`, or None: a resumed run
            judges against the best so far, not afresh.
    """

    def __init__(self, splits, keep_best="", stored_best=None, early_stopping=None):
        self.monitored = "val" if "val" in splits else "test"   # the split --eval-every evaluates
        self.figures, self.at = {"test": None, "val": None}, {"test": None, "val": None}
        self.best = BestSoFar(keep_best, stored_best)
        if early_stopping is not None and self.best.value is not None:
            early_stopping.best = self.best.value

    def record(self, split, figures, step):
        self.figures[split], self.at[split] = figures, step

    def missing_at(self, step):
        """The splits the end of the run still evaluates at ``step``: the monitored one first, test last."""
        missing = []
        if self.at["test"] == step and self.figures["test"] is not None:
            return missing
        if self.monitored == "val" and self.at["val"] != step:
            missing.append("val")   # (the validation of the state the run ends with, as of every epoch's)
        return missing + ["test"]

    @property
    def test(self):
        """The last test figures (None before the first test evaluation)."""
        return self.figures["test"]

    @property
    def val(self):
        """The last validation figures (None before the first)."""
        return self.figures["val"]
