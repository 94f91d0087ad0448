"""Which values a run's settings may take: each number's bounds, each field's choices, the rules between them.

:class:`~mpidist.settings.config.Settings` declares the fields (a default and
a help text each); the checks of the values they hold live here, apart from
that long list, so that the bounds of every number sit in one table
(:data:`BOUNDS`) beside the wording of their errors, and the rules that need
the rank count or the chosen strategy read as one function
(:func:`check_for`).  Each check raises a :class:`UsageError` that names the
flag, whatever the settings came from (flags, a TOML file, keyword arguments
or a checkpoint).
"""

import dataclasses
import math
import numbers

from ..parallel import STRATEGIES, declared_options
from ..runtime.errors import UsageError
from ..runtime.memory import parse_bytes
from ..runtime.suggest import did_you_mean
from ..runtime.text import check_utf8
from .precision import check_precision

#: What a value other tools name means here: (field, value) -> the hint the refusal ends with
MEANT = {
    ("optimizer", "adamw"): " (--optimizer adam with --weight-decay W is AdamW: its decay is decoupled)",
    ("optimizer", "sgdw"): " (--optimizer sgd with --weight-decay W is SGDW: its decay is decoupled)",
}

#: Largest magnitude of an int setting: counters and seeds end up in int64 arrays, with room to add to them.
INT_LIMIT = 2**62


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The values a numeric setting may take, and how an error message says so.

    ``low`` and ``high`` are included unless ``low_open`` / ``high_open``; a
    float must also be finite.  ``text`` replaces the wording made from the
    bounds; ``hint`` ends the message.
    """

    low: float = -INT_LIMIT
    high: float = INT_LIMIT
    low_open: bool = False
    high_open: bool = False
    text: str = ""
    hint: str = ""

    def admits(self, value):
        """Whether ``value`` (an int or a float) lies within the bounds, and is finite."""
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an int too large for a float: beyond any bound here
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def explain(self, value):
        """``(what a value must be, hint)`` for a message about ``value``: ``("at least 1", "")``.

        The hint is for a value below the bounds or not finite, not for one too large.
        """
        too_large = value > self.high and not _is_infinite(value)
        hint = "" if too_large else self.hint
        if self.text:
            return self.text, hint
        if too_large:
            return f"at most {self.high}", hint
        return ("0 or more" if self.low == 0 else f"at least {self.low}"), hint


def _is_infinite(value):
    """Whether ``value`` is an infinity (an int never is, however large)."""
    try:
        return math.isinf(value)
    except OverflowError:
        return False


_POSITIVE = Bounds(0, math.inf, low_open=True, text="a finite positive number")
_SECONDS = Bounds(0, math.inf, text="a finite number of seconds, 0 or more")

#: Bounds of the numeric settings, by field name; an int not named here is within +-INT_LIMIT, a float finite.
#: Options a strategy declares are checked by its ``check`` too; ``ps`` is here because ``auto`` reads it
#: before any strategy is chosen (a negative count would pick ps-sync).
BOUNDS = {
    "epochs": Bounds(1),
    "batch_size": Bounds(1),
    "log_every": Bounds(1),
    "steps": Bounds(0),
    "eval_every": Bounds(0),
    "eval_samples": Bounds(0),
    "checkpoint_every": Bounds(0),
    "keep": Bounds(0),
    "nan_patience": Bounds(0),
    "seed": Bounds(0, hint=" (numpy's random generators take no negative seeds)"),
    "lr": _POSITIVE,
    "momentum": Bounds(0, 1, high_open=True, text="a finite number in [0, 1)"),
    "checkpoint_seconds": dataclasses.replace(_SECONDS, hint=" (0 = no checkpoints by time)"),
    "stall_timeout": dataclasses.replace(_SECONDS, hint="; use 0 for no limit"),
    "bucket_mb": Bounds(
        0, INT_LIMIT >> 20, low_open=True, text=f"a finite positive number of MiB, at most {INT_LIMIT >> 20}"
    ),
    "ps": Bounds(0),
    "warmup_epochs": Bounds(0, math.inf, text="a finite number of epochs, 0 or more"),
    "warmup_steps": Bounds(0),
    "warmup_from": Bounds(0, 1, text="a fraction of --lr in [0, 1]"),
    "lr_gamma": dataclasses.replace(_POSITIVE, text="a finite positive factor"),
    "lr_step_epochs": Bounds(1),
    "lr_min": Bounds(0, math.inf, text="a finite learning rate, 0 or more"),
    "weight_decay": Bounds(0, math.inf, text="a finite number, 0 or more"),
    "clip_norm": Bounds(0, math.inf, text="a finite norm, 0 or more", hint=" (0 = no clipping)"),
    "accumulate": Bounds(1),
    "val_fraction": Bounds(0, 1, high_open=True, text="a fraction in [0, 1)"),
    "early_stop": Bounds(0),
    "shuffle_buffer": Bounds(0, hint=" (0 = as many samples as fill 64 MiB)"),
}


def bounds_of(field):
    """The :class:`Bounds` of a numeric dataclass field: from :data:`BOUNDS`, else the default of its type."""
    if field.name in BOUNDS:
        return BOUNDS[field.name]
    return Bounds(-math.inf, math.inf, text="a finite number") if field.type is float else Bounds()


def _is_number(value, kind):
    """Whether ``value`` can stand for a ``kind`` (int or float) setting: a real number (an integral one for
    int)."""
    wanted = numbers.Integral if kind is int else numbers.Real
    return isinstance(value, wanted) and not isinstance(value, bool)


def check_number(field, value, flag):
    """Raise :class:`UsageError` unless ``value`` is a number within the bounds of ``field`` (an int or float
    field).

    ``flag`` names the setting in the message (``--batch-size``).
    """
    if not _is_number(value, field.type):
        raise UsageError(
            f"{flag} must be a{'n' if field.type is int else ''} {field.type.__name__}, got {value!r}"
        )
    bounds = bounds_of(field)
    if not bounds.admits(value):
        wanted, hint = bounds.explain(value)
        raise UsageError(f"{flag} must be {wanted}, got {value}{hint}")


def check_values(settings):
    """The checks that need no rank count: each value one of its choices, each number finite and in range."""
    for f in dataclasses.fields(settings):
        choices = f.metadata["choices"]
        if choices and getattr(settings, f.name) not in choices:
            value = getattr(settings, f.name)
            hint = MEANT.get((f.name, str(value).lower())) or did_you_mean(value, choices)
            raise UsageError(f"--{settings.flag(f.name)} {value!r} is not one of: {', '.join(choices)}{hint}")
    for f in dataclasses.fields(settings):  # every number, the strategies' own included: finite, in range
        if f.type in (int, float):
            check_number(f, getattr(settings, f.name), f"--{settings.flag(f.name)}")
        elif f.type is str:  # every text (names, paths) storable: UTF-8
            check_utf8(getattr(settings, f.name), f"--{settings.flag(f.name)}")
    if settings.memory_budget != "auto":
        parse_bytes(settings.memory_budget)


def check_for(settings, world_size):
    """The checks for a run on ``world_size`` ranks: the strategy, the options it declares, and the rules
    between settings (``--elastic``, the warm-up, ``--keep-best``, ``--resume auto``)."""
    # (the registry, not a fixed list)
    if settings.strategy not in STRATEGIES and settings.strategy != "auto":
        raise UsageError(
            f"--strategy {settings.strategy!r} is not one of: auto, {', '.join(STRATEGIES)}"
            f"{did_you_mean(settings.strategy, ['auto', *STRATEGIES])}"
        )
    if settings.strategy == "auto":
        settings = settings.with_world(world_size)
    for name, (option, users) in declared_options().items():  # a strategy's own settings, for others
        value = getattr(settings, name)
        if value != option.default and settings.strategy not in users:
            why = f": {option.why}" if option.why else ""
            raise UsageError(
                f"--{settings.flag(name)} {value} applies to --strategy {' and '.join(users)} only, "
                f"not {settings.strategy}{why}"
            )
    chosen = STRATEGIES[settings.strategy]
    chosen.check(settings, world_size)
    check_precision(settings)
    if settings.elastic and (
        not chosen.variant(settings, world_size - settings.ps).elastic_recovery
        or settings.replication == "in-graph"
    ):
        elastic = " or ".join(name for name, cls in STRATEGIES.items() if cls.elastic_recovery)
        raise UsageError(
            f"--elastic carries on without lost workers under --strategy {elastic}, with each "
            "worker reading its own data; not with backup workers (--aggregate) or "
            "--replication in-graph"
        )
    if settings.lr_schedule in ("cosine", "linear") and settings.lr_min > settings.lr:
        raise UsageError(
            f"--lr-min {settings.lr_min} is above --lr {settings.lr}: the {settings.lr_schedule} schedule "
            "would raise the learning rate to it; give --lr-min at most --lr"
        )
    if settings.warmup_epochs and settings.warmup_steps:
        raise UsageError(
            f"--warmup-epochs {settings.warmup_epochs} and --warmup-steps {settings.warmup_steps}: give "
            "the warm-up's length one way"
        )
    checkpoints = settings.checkpoint_dir and not (settings.checkpoint_dir == "auto" and not settings.run_dir)
    if settings.keep_best and not checkpoints:
        raise UsageError(
            f"--keep-best {settings.keep_best} keeps a checkpoint: it needs --checkpoint-dir (or a --run-dir)"
        )
    running = chosen.variant(settings, world_size - settings.ps)
    if settings.keep_best and not running.lockstep:
        raise UsageError(
            f"--keep-best checkpoints the state a validation judged best, which needs every rank at "
            f"that step: not with --strategy {running.title(settings)}, whose workers step on their own"
        )
    if settings.resume == "auto" and not checkpoints:
        raise UsageError("--resume auto needs --checkpoint-dir (or a --run-dir) to look in")
