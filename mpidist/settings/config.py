"""One dataclass for a run's settings: from flags, a TOML file or keyword arguments; validated.

Each field carries its flag's help text, so ``--help``, the TOML keys, the
keyword arguments of :func:`mpidist.train` and the checkpointed settings all
come from this one definition.  Precedence: defaults, then the ``--config``
TOML file (keys are the flag names), then the command line.
"""

import argparse
import dataclasses
import json
import math
import numbers
import os
import stat
import sys

from ..nn.schedules import SCHEDULES
from ..parallel import STRATEGIES, declared_options
from ..runtime.errors import UsageError
from ..runtime.memory import parse_bytes
from ..runtime.text import check_utf8, os_reason

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OPTIMIZER_NAMES = ("adam", "sgd")
DEVICES = ("auto", "cpu", "gpu")
DTYPES = ("float32", "float64")
PROGRESS = ("auto", "bar", "lines", "none")
REPLICATIONS = ("between-graph", "in-graph")
DATA_MODES = ("auto", "memory", "stream")
STREAM_IO = ("direct", "cached")
TRACE = ("off", "on", "detail")

#: Largest magnitude of an int setting: counters and seeds end up in int64 arrays, with room to add to them.
INT_LIMIT = 2**62
#: Largest ``--config`` file read: a settings file is a few lines.
CONFIG_BYTES = 1 << 20


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
    """Whether ``value`` can stand for a ``kind`` (int or float) setting: a real number (an integral one for int)."""
    wanted = numbers.Integral if kind is int else numbers.Real
    return isinstance(value, wanted) and not isinstance(value, bool)


def check_number(field, value):
    """Raise :class:`UsageError` unless ``value`` is a number within the bounds of ``field`` (an int or float field)."""
    flag = f"--{CommonSettings.flag(field.name)}"
    if not _is_number(value, field.type):
        raise UsageError(
            f"{flag} must be a{'n' if field.type is int else ''} {field.type.__name__}, got {value!r}"
        )
    bounds = bounds_of(field)
    if not bounds.admits(value):
        wanted, hint = bounds.explain(value)
        raise UsageError(f"{flag} must be {wanted}, got {value}{hint}")


def _field(default, help, choices=None, bare=None):
    """A setting; ``bare``: the value its flag given alone takes (``--trace`` is ``--trace on``)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "bare": bare})


@dataclasses.dataclass
class CommonSettings:
    """Everything that defines a training run: one field per ``train`` flag (``batch_size`` is ``--batch-size``).

    Build one with keyword arguments (``Settings(strategy="allreduce", epochs=5)``)
    or pass the same keywords to :func:`mpidist.train`; see ``python -m mpidist
    train --help`` for each field's meaning and default.
    """

    model: str = _field(
        "mlp",
        "model: a zoo name or spec (mlp, mlp:256,256, cnn:16,32; see `python -m mpidist info "
        "--models`), or a builder function as package.module:function or path/to/file.py:function",
    )
    data: str = _field("digits", "dataset: an HDF5 file in the mpidist layout, or a bundled dataset's name")
    strategy: str = _field(
        "auto",
        f"how workers share work: {', '.join(STRATEGIES)}; auto = local on one rank, "
        "ps-sync with --ps, pipeline with --stages, else allreduce",
    )
    replication: str = _field(
        "between-graph",
        "between-graph: every worker reads its own shard; in-graph: the "
        "chief reads the data and scatters each batch",
        REPLICATIONS,
    )
    epochs: int = _field(20, "passes over the training set")
    steps: int = _field(0, "stop after this many steps in total (0 = no limit)")
    batch_size: int = _field(64, "global batch size, split across workers")
    lr: float = _field(0.003, "learning rate")
    optimizer: str = _field("adam", "optimizer: adam, or sgd (with --momentum)", OPTIMIZER_NAMES)
    momentum: float = _field(0.9, "momentum of sgd")
    lr_schedule: str = _field(
        "constant",
        "learning-rate schedule after the warm-up: constant; step (x --lr-gamma "
        "every --lr-step-epochs epochs); exponential (x --lr-gamma every epoch); cosine or "
        "linear (down to --lr-min at the last step)",
        SCHEDULES,
    )
    lr_gamma: float = _field(0.1, "factor of the step and exponential schedules")
    lr_step_epochs: int = _field(10, "epochs between the step schedule's cuts")
    lr_min: float = _field(0.0, "learning rate the cosine and linear schedules end at")
    warmup_epochs: float = _field(
        0.0,
        "epochs of linear learning-rate warm-up, from --warmup-from x --lr to --lr "
        "(Goyal et al.: use it with large global batches)",
    )
    warmup_steps: int = _field(0, "warm-up length in steps instead of epochs")
    warmup_from: float = _field(0.1, "the warm-up's first learning rate, as a fraction of --lr")
    weight_decay: float = _field(
        0.0,
        "decoupled weight decay (AdamW with adam, SGDW with sgd): each step, "
        "weights shrink by lr x this of themselves; biases and normalisation "
        "parameters do not decay",
    )
    clip_norm: float = _field(
        0.0,
        "clip the summed gradient to this global norm (0 = no clipping); clipped steps "
        "are counted in the metrics",
    )
    accumulate: int = _field(
        1,
        "compute each worker's share of the global batch in this many slices, one after "
        "the other, and exchange once: the same step with about 1/K of the activation memory",
    )
    seed: int = _field(0, "seed for initialisation, data order and dropout")
    run_dir: str = _field(
        "auto",
        "directory of this run's settings, metrics, log, trace and checkpoints; auto = "
        "runs/<model>-<data>-<strategy>-<date>-<time>, or the one a --resume continues ('' = none: "
        "metrics.jsonl here, checkpoints only with --checkpoint-dir)",
    )
    metrics: str = _field(
        "auto",
        "JSON-lines metrics file the chief appends to ('' = none; auto = the run directory's metrics.jsonl)",
    )
    log_every: int = _field(10, "steps between metrics lines and progress updates")
    eval_every: int = _field(
        1,
        "epochs between evaluations (0 = only at the end): on the validation split where "
        "there is one, else on the test split",
    )
    eval_samples: int = _field(
        0,
        "samples of each evaluated split an evaluation takes: the same evenly spread "
        "rows every time (0 = the whole split)",
    )
    val_fraction: float = _field(
        0.0,
        "share of the training split held out for validation, chosen by --seed (0 = "
        "none; a dataset's own val/ split is used without it); with a validation split, "
        "the test split is evaluated once, at the end",
    )
    keep_best: str = _field(
        "",
        "also keep the checkpoint with the best value of this validation figure (e.g. "
        "val_accuracy, val_loss, val_mse; lower is better for loss, mse and mae), besides the "
        "--keep newest ('' = off)",
    )
    early_stop: int = _field(
        0,
        "stop when the validation figure (--keep-best's, else val_loss) has not improved for "
        "this many evaluations (0 = never)",
    )
    nan_patience: int = _field(
        10,
        "steps in a row whose loss or gradients are NaN or Inf are skipped (no update) "
        "before the run stops with an error (0 = stop at the first)",
    )
    checkpoint_dir: str = _field(
        "auto", "directory for checkpoints ('' = no checkpoints; auto = the run directory's checkpoints/)"
    )
    checkpoint_every: int = _field(0, "steps between checkpoints (0 = only at the end)")
    checkpoint_seconds: float = _field(
        0.0, "seconds between checkpoints, by the chief's clock (0 = off); combines with --checkpoint-every"
    )
    checkpoint_wait: bool = _field(
        False,
        "take every checkpoint due at its step: training waits for one still "
        "being written (ps-async: the chief holds at the step until the first ps has "
        "taken it); by default the next is taken at the first step after that write "
        "ends, and several due meanwhile become one",
    )
    keep: int = _field(3, "checkpoints kept in --checkpoint-dir, newest first (0 = all)")
    resume: str = _field(
        "",
        "checkpoint to resume from: a file, or 'auto' for the newest of the run written last "
        "in --checkpoint-dir (by default: the newest run directory of this model, data and "
        "strategy); the run continues in the run directory it came from",
    )
    new_lineage: bool = _field(
        False,
        "start a new run in a --checkpoint-dir that holds another run's checkpoints "
        "(they are kept: this run prunes only its own)",
    )
    allow_external: bool = _field(
        False,
        "follow HDF5 external links and virtual datasets in --data, which "
        "read other files (refused by default)",
    )
    data_mode: str = _field(
        "auto",
        "how each rank holds its data: memory (its shards read whole), stream (read in "
        "chunk-aligned blocks as training goes, bounded memory); auto = memory while it fits "
        "--memory-budget",
        DATA_MODES,
    )
    memory_budget: str = _field(
        "auto",
        "memory a rank's data may take before it streams, e.g. 512M, 8G; auto = half "
        "the node's free memory over the ranks on the node",
    )
    shuffle_buffer: int = _field(
        0,
        "samples the data order shuffles together, over the whole global batch (in "
        "memory and streamed alike): each lane's windows hold at least N / batch size, in "
        "random units of the lane, permuted (0 = as many as fill 64 MiB); a new run's is "
        "capped to what a stream fits in --memory-budget; a resumed run keeps its own",
    )
    stream_io: str = _field(
        "direct",
        "how a stream reads uncompressed data: direct (around the page cache, O_DIRECT, "
        "where the file system allows it; the least CPU), cached (through the page cache, which "
        "may keep a dataset that fits the node's memory between epochs)",
        STREAM_IO,
    )
    elastic: bool = _field(
        False,
        "keep training when workers die, on an MPI with User-Level Failure Mitigation "
        "(Open MPI: mpirun --with-ft ulfm); strategies allreduce, ps-sync, ps-async",
    )
    stall_timeout: float = _field(
        300.0,
        "seconds a rank may wait for others (an exchange, the step agreement, "
        "the end) before the chief names the ranks that have not arrived and ends the "
        "job (0 = wait forever)",
    )
    bucket_mb: float = _field(
        64.0, "gradient bucket size in MiB: one Iallreduce per bucket, started as backward fills it"
    )
    device: str = _field(
        "auto", "where to compute: cpu, gpu (cupy, one GPU per rank on a node), or auto", DEVICES
    )
    dtype: str = _field("float32", "parameter and activation dtype", DTYPES)
    tensorboard: bool = _field(
        False,
        "also write the figures as TensorBoard event files in the run directory (needs "
        "the tensorboard extra: pip install 'mpidist[tensorboard]')",
    )
    trace: str = _field(
        "off",
        "write a timeline of every rank, trace.json in the run directory, for Perfetto "
        "or chrome://tracing: on (phases, steps, exchanges, sends), detail (each layer too), off; "
        "--trace alone = on",
        TRACE,
        bare="on",
    )
    progress: str = _field(
        "auto", "chief's terminal output: bar, lines, none; auto = bar on a terminal", PROGRESS
    )

    @staticmethod
    def flag(name):
        """Field name -> flag name: ``batch_size`` -> ``batch-size``."""
        return name.replace("_", "-")

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def validate(self, world_size):
        """Raise :class:`UsageError` naming the first flag whose value cannot work."""
        self.validate_values()
        self._validate_for(world_size)

    def validate_values(self):
        """The checks that need no rank count: each value one of its choices, each number finite and in range."""
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise UsageError(
                    f"--{self.flag(f.name)} {getattr(self, f.name)!r} is not one of: {', '.join(choices)}"
                )
        for f in dataclasses.fields(self):  # every number, the strategies' own included: finite, in range
            if f.type in (int, float):
                check_number(f, getattr(self, f.name))
            elif f.type is str:  # every text (names, paths) storable: UTF-8
                check_utf8(getattr(self, f.name), f"--{self.flag(f.name)}")
        if self.memory_budget != "auto":
            parse_bytes(self.memory_budget)

    def _validate_for(self, world_size):
        if self.strategy not in STRATEGIES and self.strategy != "auto":  # (the registry, not a fixed list)
            raise UsageError(f"--strategy {self.strategy!r} is not one of: auto, {', '.join(STRATEGIES)}")
        if self.strategy == "auto":
            self = self.with_world(world_size)
        for name, (option, users) in declared_options().items():  # a strategy's own settings, for others
            value = getattr(self, name)
            if value != option.default and self.strategy not in users:
                why = f": {option.why}" if option.why else ""
                raise UsageError(
                    f"--{self.flag(name)} {value} applies to --strategy {' and '.join(users)} only, "
                    f"not {self.strategy}{why}"
                )
        chosen = STRATEGIES[self.strategy]
        chosen.check(self, world_size)
        if self.elastic and (
            not chosen.variant(self, world_size - self.ps).elastic_recovery or self.replication == "in-graph"
        ):
            elastic = " or ".join(name for name, cls in STRATEGIES.items() if cls.elastic_recovery)
            raise UsageError(
                f"--elastic carries on without lost workers under --strategy {elastic}, with each "
                "worker reading its own data; not with backup workers (--aggregate) or "
                "--replication in-graph"
            )
        if self.warmup_epochs and self.warmup_steps:
            raise UsageError(
                f"--warmup-epochs {self.warmup_epochs} and --warmup-steps {self.warmup_steps}: give "
                "the warm-up's length one way"
            )
        checkpoints = self.checkpoint_dir and not (self.checkpoint_dir == "auto" and not self.run_dir)
        if self.keep_best and not checkpoints:
            raise UsageError(
                f"--keep-best {self.keep_best} keeps a checkpoint: it needs --checkpoint-dir (or a --run-dir)"
            )
        running = chosen.variant(self, world_size - self.ps)
        if self.keep_best and not running.lockstep:
            raise UsageError(
                f"--keep-best checkpoints the state a validation judged best, which needs every rank at "
                f"that step: not with --strategy {running.title(self)}, whose workers step on their own"
            )
        if self.resume == "auto" and not checkpoints:
            raise UsageError("--resume auto needs --checkpoint-dir (or a --run-dir) to look in")

    def with_world(self, world_size):
        """A copy whose ``auto`` strategy is resolved for ``world_size`` ranks."""
        if self.strategy != "auto":
            return self
        ranked = [(cls.auto_rank(self, world_size), name) for name, cls in STRATEGIES.items()]
        chosen = min((rank, name) for rank, name in ranked if rank is not None)[1]  # (each strategy says)
        return dataclasses.replace(self, strategy=chosen)


def _make_settings():
    """:class:`CommonSettings` with one more field per option a registered strategy declares."""
    extra = [
        (name, option.type, _field(option.default, option.help, option.choices))
        for name, (option, _) in declared_options().items()
    ]
    namespace = {"__doc__": CommonSettings.__doc__, "__module__": __name__}
    return dataclasses.make_dataclass("Settings", extra, bases=(CommonSettings,), namespace=namespace)


Settings = _make_settings()
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def add_flags(parser):
    """Add one flag per :class:`Settings` field (the strategies' own in a group); unset flags stay absent."""
    strategies = parser.add_argument_group("options of the strategies (each applies to the ones it names)")
    own = declared_options()
    for f in dataclasses.fields(Settings):
        kind = (
            {"action": argparse.BooleanOptionalAction}
            if f.type is bool
            else {"type": f.type, "metavar": f.name.upper()}
        )
        if f.metadata.get("bare") is not None:
            kind.update(nargs="?", const=f.metadata["bare"])
        group = strategies if f.name in own else parser
        group.add_argument(
            f"--{Settings.flag(f.name)}",
            dest=f.name,
            default=dataclasses.MISSING,
            help=f"{f.metadata['help']} (default: {f.default!r})",
            **kind,
        )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="TOML file whose keys are these flag names; the command line wins over it",
    )


def typed(table, where):
    """``{field name: value}`` from ``{flag or field name: value}``, each checked against its field's type.

    ``where`` starts each error message (``--config run.toml``, ``mpidist.train()``).
    """
    settings = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            known = ", ".join(Settings.flag(n) for n in FIELDS)
            raise UsageError(f"{where}: unknown setting {key!r}; known settings: {known}")
        expected = FIELDS[name].type
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = _as_float(value, key, where)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise UsageError(
                f"{where}: {key} = {value!r} should be a{'n' if expected is int else ''} {expected.__name__}"
            )
        settings[name] = value
    return settings


def _as_float(value, key, where):
    """An int setting given for a float field, as a float; one too large for a float is refused."""
    try:
        return float(value)
    except OverflowError:
        raise UsageError(f"{where}: {key} = {value} is too large for a float") from None


def _file_kind(mode):
    """What a non-regular file is, in words, from its ``st_mode``."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((text for test, text in kinds if test(mode)), "not a regular file")


def _why_unreadable(err):
    """Why a config file could not be read, in words."""
    return os_reason(err, "no such file", "not readable (permission denied)", "not readable ({})")


def _check_regular(path, info):
    """Raise :class:`UsageError` unless ``info`` (an ``os.stat`` result) is a regular file of a sensible size."""
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"--config {path}: {_file_kind(info.st_mode)}, not a TOML file")
    if info.st_size > CONFIG_BYTES:
        raise UsageError(f"--config {path}: {info.st_size} bytes; a settings file is at most {CONFIG_BYTES}")


def read_config_text(path):
    """The text of the ``--config`` file ``path``; :class:`UsageError` for anything but a readable UTF-8 file.

    The path is checked with ``os.stat`` before it is opened, so a named pipe
    or a device is refused instead of blocking or being read; it is opened
    without blocking and checked again, in case it changed in between.
    """
    try:
        _check_regular(path, os.stat(path))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise UsageError(f"--config {path}: {_why_unreadable(err)}") from None
    with os.fdopen(fd, "rb") as handle:
        _check_regular(path, os.fstat(fd))
        try:
            data = handle.read(CONFIG_BYTES + 1)
        except OSError as err:
            raise UsageError(f"--config {path}: {_why_unreadable(err)}") from None
    try:
        return data.decode("utf-8-sig")  # (a byte-order mark, as some editors write, is allowed)
    except UnicodeDecodeError as err:
        raise UsageError(
            f"--config {path}: not UTF-8 text ({err.reason}: byte 0x{data[err.start]:02x} at "
            f"offset {err.start})"
        ) from None


def load_toml(path):
    """Settings from a TOML file, keyed by flag or field name; unknown keys are errors."""
    text = read_config_text(path)
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"--config {path}: not readable as TOML: {err}") from None
    return typed(table, f"--config {path}")


def settings_from(settings=None, **overrides):
    """``settings`` (a :class:`Settings`, or None for the defaults) with ``overrides``, each checked."""
    if settings is not None and not isinstance(settings, Settings):
        raise UsageError(f"settings= takes an mpidist.Settings, got {type(settings).__name__}")
    base = settings or Settings()
    return dataclasses.replace(base, **typed(overrides, "mpidist.train()"))


def settings_from_args(namespace):
    """Build a :class:`Settings` from parsed flags (and their ``--config`` file)."""
    settings = load_toml(namespace.config) if getattr(namespace, "config", None) else {}
    for name in FIELDS:
        value = getattr(namespace, name, dataclasses.MISSING)
        if value is not dataclasses.MISSING:
            settings[name] = value
    return Settings(**settings)
