"""What a run's validation can judge: ``--keep-best``, ``--early-stop`` and a user's early stopping are
refused where the run has no validation to judge by (they would never act), or name a figure it lacks."""

from ..nn import scores
from ..runtime.errors import UsageError
from .callbacks import EarlyStopping


def validation_figures(info):
    """The figures a validation of dataset ``info`` reports, as ``--keep-best`` and ``--early-stop`` name
    them."""
    scoring = (
        scores.Classification(info.num_classes) if info.num_classes else scores.Regression(info.target_width)
    )
    return ["val_" + name for name in scoring.scalar_names()]


def check_validation(config, info):
    """Refuse ``--keep-best`` and ``--early-stop`` without a validation split, or naming a figure it lacks."""
    asked = [
        flag
        for flag, value in (("--keep-best", config.keep_best), ("--early-stop", config.early_stop))
        if value
    ]
    if asked and "val" not in info.sizes:
        raise UsageError(
            f"{' and '.join(asked)} judge(s) the run by a validation split, and dataset {info.name!r} "
            "has none: add --val-fraction F (or a val/ split to the file)"
        )
    if asked and not config.eval_every:
        raise UsageError(
            f"{' and '.join(asked)} judge(s) the run at its validations, and --eval-every 0 has "
            "none: give --eval-every N (epochs between validations)"
        )
    if config.keep_best and config.keep_best not in validation_figures(info):
        raise UsageError(
            f"--keep-best {config.keep_best!r}: dataset {info.name!r} is validated with "
            f"{', '.join(validation_figures(info))}"
        )


def check_monitors(callbacks, config, info):
    """Refuse a user's :class:`~mpidist.loop.callbacks.EarlyStopping` that watches a validation figure where
    dataset ``info`` has no validation split, or the run no validation before its end: it would never
    fire."""
    for callback in callbacks:
        monitor = str(callback.monitor) if isinstance(callback, EarlyStopping) else ""
        if monitor.startswith("val_") and "val" not in info.sizes:
            raise UsageError(
                f"EarlyStopping(monitor={monitor!r}) watches a validation split, and dataset {info.name!r} "
                "has none, so it would never stop the run: add val_fraction=F (--val-fraction F), or "
                "monitor a test_* figure"
            )
        if monitor.startswith("val_") and not config.eval_every:
            raise UsageError(
                f"EarlyStopping(monitor={monitor!r}) judges the run at its validations, and eval_every=0 "
                "(--eval-every 0) has none before its end: give eval_every=N (epochs between validations)"
            )
