"""Callbacks: user code called during a run, with the figures the metrics carry.

Callbacks run on the chief only (the rank that writes the metrics), right
after the matching metrics line is written, with the same figures as a dict:

=================  ==================================  ===================================================
method             when                                figures (as in ``metrics.jsonl``)
=================  ==================================  ===================================================
``on_start``       once, before the first step         ``config``, ``dataset``, ``params``, ...
``on_step``        every ``log_every`` steps           ``step``, ``epoch``, ``loss``, ``samples_per_s``,
                                                       ``time``
``on_eval``        after each evaluation               ``step``, ``epoch``, ``test_loss``, and the task's
                                                       figures (below)
``on_checkpoint``  after each checkpoint is written    ``step``, ``epoch``, ``path``
``on_end``         once, at the end                    the ``done``, ``stopped`` or ``failed`` event's
=================  ==================================  ===================================================

The test figures fit the task (see :mod:`mpidist.nn.scores`): classification
``test_accuracy`` and ``test_top5_accuracy`` (top-``k``, ``k = min(5, classes -
1)``: ``test_top3_accuracy`` for 4 classes, none for 2); regression
``test_mse``, ``test_mae`` and ``test_r2``, and no accuracy.  The ``done``
event carries them too, and for classification ``test_per_class`` (per class:
``precision``, ``recall``, ``f1``, ``support``) and ``test_confusion`` (up to
100 classes).

A callback asks the run to stop by calling :meth:`Callback.stop` (or setting
``stop_training``): every rank stops at the same step boundary, one or two
steps later, and the run then ends as a finished one (evaluated,
checkpointed, exit code 0).  A callback that raises ends the whole job on
every rank with exit code 1 and its traceback, as any other error does.
"""

import collections
import math
import numbers

from ..runtime.errors import UsageError

#: The metrics event each callback method follows.
EVENTS = {
    "start": "on_start",
    "step": "on_step",
    "eval": "on_eval",
    "checkpoint": "on_checkpoint",
    "done": "on_end",
    "stopped": "on_end",
    "failed": "on_end",
}


class Callback:
    """Base class of callbacks: override the methods you need; each takes one dict of figures."""

    stop_training = False

    def stop(self):
        """Ask every rank to stop at the next step boundary they all reach."""
        self.stop_training = True

    def on_start(self, figures):
        """Before the first step."""

    def on_step(self, figures):
        """After a metrics ``step`` line (every ``log_every`` steps)."""

    def on_eval(self, figures):
        """After an evaluation on the test split."""

    def on_checkpoint(self, figures):
        """After a checkpoint was written (``figures["path"]``)."""

    def on_end(self, figures):
        """At the end; ``figures["event"]`` says how it ended: ``done``, ``stopped`` or ``failed``."""


def lower_is_better(figure):
    """Whether a lower value of the figure named ``figure`` is better: a loss or an error (``loss``, ``mse``,
    ``mae``)."""
    return str(figure).endswith(("loss", "mse", "mae"))


def _whole_number(patience):
    """``patience`` as an int: a whole number of evaluations, 0 or more (2.5 or -1 said something else)."""
    if isinstance(patience, bool) or not isinstance(patience, numbers.Real):
        raise ValueError(f"EarlyStopping: patience is a number of evaluations, got {patience!r}")
    if not (math.isfinite(patience) and patience >= 0 and patience == int(patience)):
        raise ValueError(
            f"EarlyStopping: patience is a whole number of evaluations, 0 or more, got {patience!r}"
        )
    return int(patience)


def _gain(min_delta):
    """``min_delta`` as a float: a finite gain, 0 or more (a NaN would count no gain ever)."""
    if isinstance(min_delta, bool) or not isinstance(min_delta, numbers.Real):
        raise ValueError(f"EarlyStopping: min_delta is a gain of the figure, got {min_delta!r}")
    if not (math.isfinite(min_delta) and min_delta >= 0):
        raise ValueError(f"EarlyStopping: min_delta is a finite gain, 0 or more, got {min_delta!r}")
    return float(min_delta)


class EarlyStopping(Callback):
    """Stop when a test figure has not improved for ``patience`` evaluations.

    Args:
        patience: evaluations without a gain of more than ``min_delta`` that are tolerated.
        min_delta: smallest gain of the figure that counts as one.
        monitor: the figure of the ``eval`` event to watch: ``test_accuracy`` (the
            default; classification only), ``test_loss``, ``test_top5_accuracy``,
            or for regression ``test_mse``, ``test_mae``, ``test_r2``.
        mode: ``"max"`` (higher is better), ``"min"`` (lower is better) or ``"auto"``
            (the default): ``"min"`` for a loss or an error (a name ending in
            ``loss``, ``mse`` or ``mae``), else ``"max"``.

    Evaluations of another split are passed over (``val_loss`` is watched on the
    validation split's ``eval`` events, not the test split's).  A run whose
    evaluations of the split lack the monitored figure (``test_accuracy`` in a
    regression run) ends at its first evaluation with a
    :class:`~mpidist.runtime.errors.UsageError` that names the figures it has: monitor
    e.g. ``test_loss`` with ``mode="min"`` there.
    """

    MODES = ("auto", "max", "min")

    def __init__(self, patience=3, min_delta=0.0, monitor="test_accuracy", mode="auto"):
        if not str(monitor).startswith(("test_", "val_")):
            raise ValueError(
                f"EarlyStopping: monitor a figure of the eval events, test_* or val_* (test_loss, "
                f"val_accuracy, ...), got {monitor!r}"
            )
        if mode not in self.MODES:
            raise ValueError(
                f"EarlyStopping: mode must be one of {', '.join(map(repr, self.MODES))}, got {mode!r}"
            )
        if mode == "auto":
            mode = "min" if lower_is_better(monitor) else "max"
        self.patience, self.min_delta, self.monitor, self.mode = (
            _whole_number(patience),
            _gain(min_delta),
            monitor,
            mode,
        )
        self.best, self.waited, self.stopped_at = None, 0, None

    def begin(self, best=None):
        """A run begins (the callback may be given to several, one after the other): it judges against
        ``best`` (a resumed run's best so far), having waited for nothing yet."""
        self.best, self.waited, self.stopped_at = best, 0, None

    def on_eval(self, figures):
        # test_ or val_: an evaluation of another split is not ours
        split = str(self.monitor).split("_")[0] + "_"
        if self.monitor not in figures and not any(name.startswith(split) for name in figures):
            return
        if self.monitor not in figures:
            reported = ", ".join(name for name in figures if name.startswith(split))
            why = "; a regression has no accuracy" if "test_mse" in figures else ""
            raise UsageError(
                f"EarlyStopping monitors {self.monitor!r}, which this run's evaluations do not report "
                f"(they report {reported}{why}): monitor e.g. 'test_loss' with mode='min'"
            )
        value = figures[self.monitor]
        if self.best is None:
            gained = True
        elif self.mode == "max":
            gained = value > self.best + self.min_delta
        else:
            gained = value < self.best - self.min_delta
        if gained:
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience and not self.stop_training:
            self.stopped_at = figures["step"]  # (the run stops a step or two later, and evaluates once more)
            self.stop()


#: step events a rank off the chief keeps (the steps a dead chief may not have written: the one in flight, and
#: those a slow chief had not reached)
UNWRITTEN = 8


class Reporter:
    """The chief's record of a run: each event goes to the metrics file, then to the callbacks.

    Args:
        log: a :class:`~mpidist.loop.metrics.MetricsLog` (an empty one off the chief).
        callbacks: the user's callbacks (called only where ``active``).
        active: whether this rank reports (the chief).
    """

    def __init__(self, log, callbacks=(), active=True):
        self.log, self.callbacks, self.active = log, list(callbacks) if active else [], active
        # off the chief, the last step events it did not write: a worker that takes a dead chief's place
        # writes those the chief had not (see Outputs.take_over)
        self.unwritten = collections.deque(maxlen=UNWRITTEN)

    def discard(self):
        """The run was refused before it began: its metrics file goes, where opening it made it."""
        self.log.discard()

    def write(self, event, **figures):
        if not self.active and event == "step":
            self.unwritten.append(figures)
        self.log.write(event, **figures)
        if event == "start":  # (a callback used again in a new run: an earlier run's stop is not this one's)
            for callback in self.callbacks:
                callback.stop_training = False
        method = EVENTS.get(event)
        for callback in self.callbacks if method else ():
            getattr(callback, method)(dict(figures, event=event))

    @property
    def failure(self):
        """Why the metrics file could not be written (None while it can)."""
        return self.log.failure

    @property
    def stop_asked(self):
        """Whether a callback asked the run to stop."""
        return any(callback.stop_training for callback in self.callbacks)

    def close(self):
        self.log.close()
