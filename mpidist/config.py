"""One dataclass for a run's settings: from flags, a TOML file or keyword arguments; validated.

Each field carries its flag's help text, so ``--help``, the TOML keys, the
keyword arguments of :func:`mpidist.train` and the checkpointed settings all
come from this one definition.  Precedence: defaults, then the ``--config``
TOML file (keys are the flag names), then the command line.
"""

import argparse
import dataclasses
import json
import sys

from .errors import UsageError
from .parallel import STRATEGIES, declared_options

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OPTIMIZER_NAMES = ("adam", "sgd")
DEVICES = ("auto", "cpu", "gpu")
DTYPES = ("float32", "float64")
PROGRESS = ("auto", "bar", "lines", "none")
REPLICATIONS = ("between-graph", "in-graph")


def _field(default, help, choices=None):
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass
class CommonSettings:
    """Everything that defines a training run: one field per ``train`` flag (``batch_size`` is ``--batch-size``).

    Build one with keyword arguments (``Settings(strategy="allreduce", epochs=5)``)
    or pass the same keywords to :func:`mpidist.train`; see ``python -m mpidist
    train --help`` for each field's meaning and default.
    """

    model: str = _field("mlp", "model: a zoo name or spec (mlp, mlp:256,256, cnn:16,32; see `python -m mpidist info "
                        "--models`), or a builder function as package.module:function or path/to/file.py:function")
    data: str = _field("digits", "dataset: an HDF5 file in the mpidist layout, or a bundled dataset's name")
    strategy: str = _field("auto", f"how workers share work: {', '.join(STRATEGIES)}; auto = local on one rank, "
                           "ps-sync with --ps, pipeline with --stages, else allreduce")
    replication: str = _field("between-graph", "between-graph: every worker reads its own shard; in-graph: the "
                              "chief reads the data and scatters each batch", REPLICATIONS)
    epochs: int = _field(20, "passes over the training set")
    steps: int = _field(0, "stop after this many steps in total (0 = no limit)")
    batch_size: int = _field(64, "global batch size, split across workers")
    lr: float = _field(0.003, "learning rate")
    optimizer: str = _field("adam", "optimizer", OPTIMIZER_NAMES)
    momentum: float = _field(0.9, "momentum of sgd")
    seed: int = _field(0, "seed for initialisation, data order and dropout")
    metrics: str = _field("metrics.jsonl", "JSON-lines metrics file the chief appends to ('' = none)")
    log_every: int = _field(10, "steps between metrics lines and progress updates")
    eval_every: int = _field(1, "epochs between evaluations on the test set (0 = only at the end)")
    nan_patience: int = _field(10, "steps in a row whose loss or gradients are NaN or Inf are skipped (no update) "
                               "before the run stops with an error (0 = stop at the first)")
    checkpoint_dir: str = _field("", "directory for checkpoints ('' = no checkpoints)")
    checkpoint_every: int = _field(0, "steps between checkpoints (0 = only at the end)")
    checkpoint_seconds: float = _field(0.0, "seconds between checkpoints, by the chief's clock (0 = off); "
                                            "combines with --checkpoint-every")
    keep: int = _field(3, "checkpoints kept in --checkpoint-dir, newest first (0 = all)")
    resume: str = _field("", "checkpoint to resume from: a file, or 'auto' for the newest in --checkpoint-dir")
    elastic: bool = _field(False, "keep training when workers die, on an MPI with User-Level Failure Mitigation "
                           "(Open MPI: mpirun --with-ft ulfm); strategies allreduce, ps-sync, ps-async")
    stall_timeout: float = _field(300.0, "seconds a rank may wait for others (an exchange, the step agreement, "
                                  "the end) before the chief names the ranks that have not arrived and ends the "
                                  "job (0 = wait forever)")
    bucket_mb: float = _field(64.0, "gradient bucket size in MiB: one Allreduce per bucket")
    device: str = _field("auto", "where to compute: cpu, gpu (cupy, one GPU per rank on a node), or auto", DEVICES)
    dtype: str = _field("float32", "parameter and activation dtype", DTYPES)
    progress: str = _field("auto", "chief's terminal output: bar, lines, none; auto = bar on a terminal", PROGRESS)

    @staticmethod
    def flag(name):
        """Field name -> flag name: ``batch_size`` -> ``batch-size``."""
        return name.replace("_", "-")

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def validate(self, world_size):
        """Raise :class:`UsageError` naming the first flag whose value cannot work."""
        for f in dataclasses.fields(self):
            choices = f.metadata["choices"]
            if choices and getattr(self, f.name) not in choices:
                raise UsageError(f"--{self.flag(f.name)} {getattr(self, f.name)!r} is not one of: {', '.join(choices)}")
        positive = {"epochs": self.epochs, "batch_size": self.batch_size, "log_every": self.log_every}
        for name, value in positive.items():
            if value < 1:
                raise UsageError(f"--{self.flag(name)} must be at least 1, got {value}")
        for name in ("steps", "eval_every", "checkpoint_every", "checkpoint_seconds", "keep", "nan_patience",
                     "stall_timeout"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{self.flag(name)} must be 0 or more, got {getattr(self, name)}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not self.bucket_mb > 0:
            raise UsageError(f"--bucket-mb must be positive, got {self.bucket_mb}")
        if self.strategy not in STRATEGIES and self.strategy != "auto":   # (the registry, not a fixed list)
            raise UsageError(f"--strategy {self.strategy!r} is not one of: auto, {', '.join(STRATEGIES)}")
        if self.strategy == "auto":
            self = self.with_world(world_size)
        for name, (option, users) in declared_options().items():   # a strategy's own settings, for others
            value = getattr(self, name)
            if value != option.default and self.strategy not in users:
                raise UsageError(f"--{self.flag(name)} {value} applies to --strategy {' and '.join(users)} only, "
                                 f"not {self.strategy}")
        chosen = STRATEGIES[self.strategy]
        chosen.check(self, world_size)
        if self.elastic and (not chosen.variant(self, world_size - self.ps).elastic_recovery
                             or self.replication == "in-graph"):
            elastic = " or ".join(name for name, cls in STRATEGIES.items() if cls.elastic_recovery)
            raise UsageError(f"--elastic carries on without lost workers under --strategy {elastic}, with each "
                             "worker reading its own data; not with pipelines (a lost stage takes its layers), "
                             "backup workers (--aggregate) or --replication in-graph")
        if self.resume == "auto" and not self.checkpoint_dir:
            raise UsageError("--resume auto needs --checkpoint-dir to look in")

    def with_world(self, world_size):
        """A copy whose ``auto`` strategy is resolved for ``world_size`` ranks."""
        if self.strategy != "auto":
            return self
        chosen = ("ps-sync" if self.ps else "pipeline" if self.stages > 1 else
                  "local" if world_size == 1 else "allreduce")
        return dataclasses.replace(self, strategy=chosen)


def _make_settings():
    """:class:`CommonSettings` with one more field per option a registered strategy declares."""
    extra = [(name, option.type, _field(option.default, option.help, option.choices))
             for name, (option, _) in declared_options().items()]
    namespace = {"__doc__": CommonSettings.__doc__, "__module__": __name__}
    return dataclasses.make_dataclass("Settings", extra, bases=(CommonSettings,), namespace=namespace)


Settings = _make_settings()
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def add_flags(parser):
    """Add one flag per :class:`Settings` field (the strategies' own in a group); unset flags stay absent."""
    strategies = parser.add_argument_group("options of the strategies (each applies to the ones it names)")
    own = declared_options()
    for f in dataclasses.fields(Settings):
        kind = {"action": argparse.BooleanOptionalAction} if f.type is bool else \
            {"type": f.type, "metavar": f.name.upper()}
        group = strategies if f.name in own else parser
        group.add_argument(f"--{Settings.flag(f.name)}", dest=f.name, default=dataclasses.MISSING,
                            help=f"{f.metadata['help']} (default: {f.default!r})", **kind)
    parser.add_argument("--config", metavar="FILE.toml", default=None,
                        help="TOML file whose keys are these flag names; the command line wins over it")


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
            value = float(value)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise UsageError(f"{where}: {key} = {value!r} should be a{'n' if expected is int else ''} "
                             f"{expected.__name__}")
        settings[name] = value
    return settings


def load_toml(path):
    """Settings from a TOML file, keyed by flag or field name; unknown keys are errors."""
    try:
        with open(path, "rb") as handle:
            table = tomllib.load(handle)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except (OSError, tomllib.TOMLDecodeError) as err:
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
