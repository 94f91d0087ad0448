"""What a training run will hold on a rank, priced item by item before anything the items name is allocated.

One :class:`~mpidist.runtime.price.Price` a rank: what the process holds
already (the interpreter, its libraries, their BLAS buffers:
:func:`~mpidist.runtime.memory.settle` put them there; the price is taken
after the rehearsal, which loads the kernels a model's layers compile), and

* its training state, as the layout splits it (:mod:`mpidist.parallel.holding`);
* its data: its shards in memory, or its streams (:class:`~mpidist.data.Reading`);
* a step's arrays and an evaluation batch's (:mod:`mpidist.loop.rehearsed`:
  this rank's layers rehearsed on the run's batches, the loss, the batches in
  flight, a stage's buffers);
* the stacks of the threads a run starts, and MPI's copy of its largest
  message;
* what a checkpoint of the whole model costs the chief (the state it
  assembles, and the copy a write behind keeps), what the end of the run
  keeps, the checkpoint a run resumes from as it is read, ``--clip-norm``'s
  clipped gradient, ``--trace``'s events, and what a strategy's servers keep
  beside them (:meth:`~mpidist.parallel.declared.Declared.copies`).

:func:`check` refuses a run whose price is more than the rank may hold, naming
every item, before anything is allocated; a model whose training state alone
does not fit is refused earlier (:func:`check_holds`), with the layouts that
would fit it.  Under ``--shard parameters`` a run whose two units in flight
do not fit gathers one at a time where that fits (:func:`priced`; every rank
takes the same layout: :func:`mpidist.loop.setup.agreed_setup`).  ``eval`` and ``predict`` are priced by
:mod:`mpidist.loop.inference_pricing`.
"""

import dataclasses

from ..nn.parameter_map import walk
from ..nn.precision import is_low, master_dtype
from ..parallel import holding
from ..parallel.data.units import units_of
from ..runtime import recorder
from ..runtime.errors import UsageError
from ..runtime.memory import check_fits, holdable, human, thread_bytes
from ..runtime.price import Price
from ..store import checkpoint_save
from .rehearsed import EVALUATION_BATCH, rank_arrays

#: what a ``--trace`` event holds in memory (a tuple and its dict, measured: 288 bytes), and how many a step
#: records: its phases, and with ``--trace detail`` two spans a layer
EVENT_BYTES, EVENTS_A_STEP = 300, 12


@dataclasses.dataclass(frozen=True)
class Run:
    """What a rank's set-up fixed of its run that its price depends on."""

    info: object  # the dataset's DatasetInfo
    reading: object  # its data's Reading: in memory or streamed, and its bytes
    reads: dict  # the splits it reads: {split: (split, worker, workers)}
    local_batch: int  # its worker's share of a global batch (0: it computes none)
    steps: int  # the steps the run takes
    resume: object = None  # the checkpoint it resumes from, or None


def optimizer_arrays(config):
    """Arrays of state the optimizer keeps per parameter (Adam's two moments, SGD's velocity)."""
    return len(checkpoint_save.OPTIMIZER_STATE.get(config.optimizer, ()))


def gathers_in_turn(config):
    """Whether the run may gather its units one at a time where two in flight do not fit: ``--shard
    parameters`` (not where ``--no-reshard-after-forward`` keeps every unit)."""
    return config.strategy == "allreduce" and config.shard == "parameters" and config.reshard_after_forward


def priced(config, cluster, model, run, strategy):
    """``(price, prefetch)`` of this rank's run (:func:`training_price`): its ``--shard parameters`` units
    gathered two in flight where that fits, else one at a time where that does; refused (:func:`check`,
    naming the prefetching layout's items) where neither fits."""
    price = training_price(config, cluster, model, run, strategy)
    if gathers_in_turn(config) and price.refusal("") is not None:
        in_turn = training_price(config, cluster, model, run, strategy, prefetch=False)
        if in_turn.refusal("") is None:
            return in_turn, False
    check(config, cluster, model, price)
    return price, True


def one_in_flight(config, cluster, model, price):
    """``price`` (of the prefetching layout) as it is where this rank takes one unit in flight because
    another rank must: its training state is that layout's (the rest is the same)."""
    _, state = _training_state(config, cluster, model, prefetch=False)
    items = [(what, state if what == "training state" else nbytes) for what, nbytes in price.items]
    return dataclasses.replace(price, items=items)


def _training_state(config, cluster, model, prefetch):
    """``(Held, bytes)``: this rank's share of the model (:func:`~mpidist.parallel.holding.held`) and what
    it takes, priced at float32's size for a 16-bit model (its master copies are priced beside)."""
    arrays, itemsize = optimizer_arrays(config), master_dtype(model.dtype).itemsize
    share = holding.held(config, cluster, model, arrays, prefetch)
    return share, holding.held_bytes(share, arrays, itemsize)


def training_price(config, cluster, model, run, strategy, prefetch=True):
    """The :class:`~mpidist.runtime.price.Price` of training ``model`` (a map of shapes) on this rank of
    ``cluster``, run by ``strategy`` (the class: its
    :meth:`~mpidist.parallel.declared.Declared.copies`); ``run`` what the set-up fixed of it:
    ``info``, ``reading`` (its data's :class:`~mpidist.data.Reading`), ``reads`` (the splits it reads),
    ``local_batch`` (0: it computes none), ``steps`` (the run's), ``resume`` (the checkpoint, or None);
    ``prefetch``: ``--shard parameters``' units two in flight, or one (:func:`priced` chooses)."""
    # (a 16-bit model's state is priced at float32's size, its master copies beside: an upper bound)
    arrays, itemsize, whole = optimizer_arrays(config), master_dtype(model.dtype).itemsize, model.num_params
    share, state = _training_state(config, cluster, model, prefetch)
    in_graph = config.replication == "in-graph" and cluster.is_chief
    rehearsed = rank_arrays(
        config,
        cluster.rank,
        cluster.size,
        model,
        run.info,
        run.local_batch,
        _evaluated(config, run),
        config.batch_size if in_graph else None,
    )
    price = Price()  # (what the process holds is read now: after the rehearsal loaded what the layers use)
    price.add("training state", state)
    if is_low(model.dtype):
        price.add("--precision's float32 master and gradient", 2 * share.params * itemsize)
    price.add("data", run.reading.nbytes)
    price.add("a step's arrays", rehearsed.step)
    price.add("an evaluation batch", rehearsed.evaluation)
    price.add("threads' stacks", _threads(config, cluster, run) * thread_bytes())
    whole_model = share.params == whole  # (a split model's ranks write and read their own slices, no copy)
    copies = strategy.copies(config, cluster, arrays) + _own_rows(config, cluster, run.local_batch)
    if whole_model and cluster.is_chief:
        staged = 2 if config.checkpoint_dir else 1  # (a write behind keeps a copy while the next is made)
        price.add("the whole model's checkpoints and result", staged * (1 + arrays) * whole * itemsize)
    elif whole_model:  # (the end of a run on one copy per node leaves each rank zeros of it)
        price.add("the end of the run", whole * itemsize)
    if run.resume is not None and whole_model:  # (read whole by every rank, its optimizer state and rows)
        price.add("the checkpoint resumed", (1 + arrays + copies) * whole * itemsize)
    if config.clip_norm and whole_model:  # (where a clipped gradient goes, beside a buffer MPI holds)
        price.add("the clipped gradient", whole * itemsize)
    price.add("--trace's events", _trace(config, cluster, model, run.steps))
    price.add("the strategy's buffers", copies * whole * itemsize)
    if cluster.size > 1:
        price.add("MPI's buffers", max(largest_unit_bytes(config, model), rehearsed.activations))
    return price


def _evaluated(config, run):
    """The samples of this rank's evaluation batch (0: it evaluates none; a pipeline's stages all do)."""
    splits = [split for split in ("test", "val") if split in run.reads] or (
        ["test"] if config.strategy == "pipeline" else []
    )
    rows = [
        -(-run.info.sizes.get(split, 0) // max(1, run.reads.get(split, (0, 0, 1))[2])) for split in splits
    ]
    return min(EVALUATION_BATCH, max(rows, default=0))


def _own_rows(config, cluster, local_batch):
    """Whole-model arrays ``--compress`` keeps: a worker's residual and what it sends; the chief's rows of
    every worker's residual for a checkpoint, and their copy for a write behind."""
    if config.compress == "none" or not local_batch:
        return 0
    return 2 + (2 * cluster.num_workers if cluster.is_chief else 0)


def largest_unit_bytes(config, model):
    """The largest gradient message a rank hands MPI, which MPICH copies (an allreduce of 64 MiB: 64 MiB
    more, measured; a reduce-scatter one block): a bucket, or a ``--shard parameters`` unit."""
    parts, itemsize = max(1, int(config.tensor)), model.dtype.itemsize
    units = units_of(model.offsets, model.num_params, config.bucket_mb * (1 << 20) * parts, itemsize)
    return max(unit.size for unit in units) * itemsize // parts


def _threads(config, cluster, run):
    """The threads a run starts on this rank after its check: the prefetchers of its batches (a stream's
    two), a stream's evaluation reader, the stall monitor (with other ranks to watch), a checkpoint's
    writers (a sharded one's part and index), and one the end's agreement may start
    (:class:`~mpidist.runtime.agreement.OneVoice`); the watch of its own I/O runs already."""
    streams = run.reading.mode == "stream"
    feeding = (2 if streams else 1) * (run.local_batch > 0) + streams
    monitor = cluster.size > 1 and config.stall_timeout > 0
    return feeding + monitor + 2 * bool(config.checkpoint_dir) + 1


def _trace(config, cluster, model, steps):
    """``--trace``'s events: this rank's (a step's phases, and with ``detail`` two spans a layer), at most
    :data:`mpidist.runtime.recorder.LIMIT`; the chief gathers every rank's and writes them."""
    if config.trace == "off":
        return 0
    layers = sum(1 for _ in walk(model.layers)) if config.trace == "detail" else 0
    events = min(recorder.LIMIT, max(1, steps) * (EVENTS_A_STEP + 2 * layers))
    return events * EVENT_BYTES * (1 + 2 * cluster.size if cluster.is_chief else 1)


def check(config, cluster, model, price):
    """Refuse, naming every item and the layouts that would fit, a run whose ``price`` is more than this
    rank may hold."""
    whole, arrays = model.num_params, optimizer_arrays(config)
    share = holding.held(config, cluster, model, arrays)
    refused = price.refusal(_subject(config, model, share))
    if refused is None:
        return
    state = dict(price.items).get("training state", 0)
    limit = holdable()[0] - (price.more - state)  # (what the training state may take beside the rest)
    ways = _ways_it_fits(config, cluster, model, arrays, limit) if share.params == whole else []
    raise UsageError("; ".join([refused, *ways]))


def _subject(config, model, share):
    """What a refusal names: training the whole model, or this rank's ``share`` of it (a
    :class:`~mpidist.parallel.holding.Held`)."""
    whole = model.num_params
    if not share.part:
        return f"training {whole:,} parameters with {config.optimizer}"
    return (
        f"{share.part} ({share.params:,} of the model's {whole:,} parameters), trained with "
        f"{config.optimizer}"
        + (f", and {share.assembles} ({share.gathered:,} values)" if share.gathered else "")
    )


def check_holds(config, cluster, model):
    """Refuse, naming what it needs, a model whose training state alone, as this rank's share of it, does not
    fit in what the rank may hold (before its data and the rest are priced: :func:`check`); in the smallest
    layout the run may take (its units gathered one at a time where it may: :func:`gathers_in_turn`)."""
    arrays = optimizer_arrays(config)
    whole = model.num_params
    share = (
        holding.held(config, cluster, model, arrays, prefetch=not gathers_in_turn(config))
        if cluster is not None
        else holding.Held(whole, whole, whole)
    )
    try:
        subject = _subject(config, model, share)
        check_fits(holding.held_bytes(share, arrays, model.dtype.itemsize), subject)
    except UsageError as err:
        ways = _ways_it_fits(config, cluster, model, arrays) if share.params == whole else []
        if not ways:
            raise
        raise UsageError("; ".join([str(err), *ways])) from None


def _ways_it_fits(config, cluster, model, arrays, limit=None):
    """What would fit a model whose whole training state does not (in ``limit`` bytes: by default what the
    rank may hold): its workers each holding a shard of it (``allreduce`` on more than one worker), or a
    pipeline's stages."""
    ways, itemsize = [], model.dtype.itemsize
    limit = holdable()[0] if limit is None else limit
    if cluster is not None and cluster.num_workers > 1 and config.strategy == "allreduce":
        need = holding.held_bytes(holding.fully_sharded_held(config, cluster, model), arrays, itemsize)
        if need <= limit:
            ways.append(
                f"sharded, it fits: --shard parameters (each of the {cluster.num_workers} workers needs "
                f"{human(need)})"
            )
    split = holding.fitting_stages(model, arrays, itemsize, limit)
    if split is not None:
        stages, need = split
        ways.append(
            f"split, it fits: --strategy pipeline --stages {stages} on {stages} or more ranks "
            f"(its largest stage needs {human(need)})"
        )
    return ways
