"""A run's evaluations: the latest figures of each split, the best validation so far, and where they were
taken."""

import math
import time

from .callbacks import lower_is_better

#: a split of more samples than this is named at start-up as one whose every evaluation reads it all
LARGE_EVALUATION = 1_000_000
#: an evaluation says how far it got once it has run this long, and again every PROGRESS_EVERY seconds
PROGRESS_AFTER, PROGRESS_EVERY = 5.0, 15.0


def shown(batches, total, split, say, clock=time.monotonic):
    """``batches`` of ``(x, y)``, saying now and then how many of ``total`` samples an evaluation of ``split``
    took.

    The chief's count of its own part: the others' parts are as large (within a batch) and go as fast.
    """
    began, done = clock(), 0
    due = began + PROGRESS_AFTER
    for batch in batches:
        yield batch
        done += len(batch[1])
        now = clock()
        if now >= due and done < total:
            rate, share = done / (now - began), 100 * done / total
            say(
                f"mpidist: evaluating {split}: {f'{share:.1f}%' if share >= 0.1 else 'under 0.1%'} ({done:,} "
                "of "
                f"{total:,} samples) after {duration(now - began)}, about {duration((total - done) / rate)} "
                "left"
            )
            due = now + PROGRESS_EVERY


def duration(seconds):
    """``12 s``, ``4 min 10 s``, ``3 h 12 min``, ``9 d 5 h``: a time in its two largest units."""
    seconds = int(round(seconds))
    units = [("d", 86400), ("h", 3600), ("min", 60), ("s", 1)]
    for index, (name, size) in enumerate(units[:-1]):
        if seconds >= size:
            smaller, small_size = units[index + 1]
            return f"{seconds // size} {name} {seconds % size // small_size} {smaller}"
    return f"{seconds} s"


class BestSoFar:
    """The best value of a validation figure so far (``--keep-best``): lower is better for losses and
    errors."""

    def __init__(self, figure, stored=None):
        self.figure = figure
        self.lower = lower_is_better(figure)  # (the rule --early-stop follows too)
        self.value, self.step = None, None
        if stored and stored.get("figure") == figure:  # a resumed run's checkpoint: the best it had seen
            self.value, self.step = stored["value"], stored["step"]

    def record(self):
        """What a checkpoint stores of it (None before the first value, or without ``--keep-best``)."""
        if not self.figure or self.value is None:
            return None
        return {"figure": self.figure, "value": self.value, "step": self.step}

    def offer(self, value, step):
        """Whether ``value`` (at ``step``) beats the best so far; it becomes the best if so.  NaN never
        does."""
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
        self.monitored = "val" if "val" in splits else "test"  # the split --eval-every evaluates
        self.figures, self.at = {"test": None, "val": None}, {"test": None, "val": None}
        self.best = BestSoFar(keep_best, stored_best)
        if early_stopping is not None:
            early_stopping.begin(self.best.value)

    def record(self, split, figures, step):
        self.figures[split], self.at[split] = figures, step

    def missing_at(self, step):
        """The splits the end of the run still evaluates at ``step``: the monitored one first, test last."""
        missing = []
        if self.at["test"] == step and self.figures["test"] is not None:
            return missing
        if self.monitored == "val" and self.at["val"] != step:
            missing.append("val")  # (the validation of the state the run ends with, as of every epoch's)
        return missing + ["test"]

    @property
    def test(self):
        """The last test figures (None before the first test evaluation)."""
        return self.figures["test"]

    @property
    def val(self):
        """The last validation figures (None before the first)."""
        return self.figures["val"]
