"""One dataclass for a run's settings, :class:`Settings`: a field per ``train`` flag, generated from the
registry.

Each field carries its flag's help text, so ``--help``, the TOML keys, the
keyword arguments of :func:`mpidist.train` and the checkpointed settings all
come from this one definition.  The values a field may take are checked by
:mod:`mpidist.settings.validation`; flags, ``--config`` TOML files and keyword
arguments become a ``Settings`` through :mod:`mpidist.settings.sources`.
"""

import dataclasses
import json

from ..nn.precision import PRECISIONS
from ..nn.schedules import SCHEDULES
from ..parallel import STRATEGIES, declared_options
from . import validation

OPTIMIZER_NAMES = ("adam", "sgd")
DEVICES = ("auto", "cpu", "gpu")
DTYPES = ("float32", "float64")
PROGRESS = ("auto", "bar", "lines", "none")
REPLICATIONS = ("between-graph", "in-graph")
DATA_MODES = ("auto", "memory", "stream")
STREAM_IO = ("direct", "cached")
TRACE = ("off", "on", "detail")


def _field(default, help, choices=None, bare=None):
    """A setting; ``bare``: the value its flag given alone takes (``--trace`` is ``--trace on``)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "bare": bare})


@dataclasses.dataclass
class CommonSettings:
    """Everything that defines a training run: one field per ``train`` flag (``batch_size`` is
    ``--batch-size``).

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
    lr_min: float = _field(0.0, "learning rate the cosine and linear schedules end at (at most --lr)")
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
        "checkpoint to resume from: a file, a checkpoint or run directory (its newest loadable "
        "checkpoint), or 'auto' "
        "for the newest of the run written last "
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
        "follow HDF5 external links and virtual datasets, and read external storage, in --data: "
        "they read other files (refused by default)",
    )
    data_mode: str = _field(
        "auto",
        "how each rank holds its data: memory (its shards read whole), stream (read as "
        "training goes, bounded memory); auto = memory while it fits --memory-budget",
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
    precision: str = _field(
        "float32",
        "compute in 16 bits: bf16 or fp16 parameters, activations, gradients and exchanges, with "
        "float32 master weights and optimizer state (fp16 with dynamic loss scaling); "
        "strategies local and allreduce; float32: --dtype everywhere",
        PRECISIONS,
    )
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
        """Raise :class:`~mpidist.runtime.errors.UsageError` naming the first flag whose value cannot work."""
        self.validate_values()
        validation.check_for(self, world_size)

    def validate_values(self):
        """The checks that need no rank count: each value one of its choices, each number finite and in
        range."""
        validation.check_values(self)

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
