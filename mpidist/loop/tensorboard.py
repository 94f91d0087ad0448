"""``--tensorboard``: the chief's figures as TensorBoard event files, beside the metrics.

Written with ``tensorboardX`` (the ``tensorboard`` extra: no TensorFlow or
PyTorch needed), from the same events as ``metrics.jsonl``, so both hold the
same values:

==================================  =====================================================
``train/loss``, ``lr``,             each ``step`` event (every ``--log-every`` steps)
``samples_per_s``,
``train/accuracy`` or ``train/mae``
``test/loss``, ``test/accuracy``,   each ``eval`` event (``val/...`` for the validation
``test/mse``, ``test/r2``, ...      split)
``ps/<rank>/updates``,              the ``done`` event's per-rank figures, at the last
``worker/<rank>/staleness_mean``,   step: each ps, each ``ps-async`` worker, each
``stage/<stage>/bubble``, ...       pipeline stage
==================================  =====================================================

``tensorboard --logdir runs`` then shows every run directory as a run.
"""

import math
import sys

from ..runtime.errors import UsageError
from .callbacks import Callback

INSTALL = "pip install 'mpidist[tensorboard]' (or: pip install tensorboardX)"
STEP_FIGURES = {
    "loss": "train/loss",
    "lr": "lr",
    "samples_per_s": "samples_per_s",
    "train_accuracy": "train/accuracy",
    "train_mae": "train/mae",
    "clipped": "train/clipped",
}
#: per-rank figures of the done event's roles, by role
ROLE_FIGURES = (
    "updates",
    "bytes_in",
    "bytes_out",
    "accepted",
    "dropped",
    "skipped",
    "steps",
    "staleness_mean",
    "staleness_max",
    "updates_missed_mean",
    "updates_missed_max",
    "wait_s",
    "bubble",
    "peak_activations",
)


def require():
    """The writer class, or a :class:`UsageError` saying what to install.

    Imported without torch: tensorboardX imports torch wherever it is
    installed (about 3 s of the chief's start-up) to accept its tensors, which
    mpidist never hands it, and goes on without it where the import fails.
    Where torch is loaded already (a user's script) it is left as it is.
    """
    absent = "torch" not in sys.modules
    if absent:
        sys.modules["torch"] = None  # (Python's way to make ``import torch`` raise ImportError)
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise UsageError(f"--tensorboard needs the tensorboardX package: {INSTALL}") from None
    finally:
        if absent:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoard(Callback):
    """A callback writing the run's figures to TensorBoard event files in ``logdir`` (the chief's only)."""

    def __init__(self, logdir):
        self.logdir = str(logdir)
        self.writer = require()(logdir=self.logdir)

    def on_step(self, figures):
        for name, tag in STEP_FIGURES.items():
            self._scalar(tag, figures.get(name), figures["step"])

    def on_eval(self, figures):
        for name, value in figures.items():
            split, _, figure = name.partition("_")
            if split in ("test", "val") and figure:
                self._scalar(f"{split}/{figure}", value, figures["step"])

    def on_end(self, figures):
        step = figures.get("steps", figures.get("step", 0))
        for record in figures.get("roles", ()):
            where = (
                f"stage/{record['stage']}"
                if "stage" in record and record.get("replica", 0) == 0
                else f"{'ps' if 'shard' in record else 'worker'}/{record.get('rank')}"
            )
            for name in ROLE_FIGURES:
                self._scalar(f"{where}/{name}", record.get(name), step)
        self.writer.flush()

    def close(self):
        self.writer.close()

    def _scalar(self, tag, value, step):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            self.writer.add_scalar(tag, value, int(step))
