"""What a training run will hold on a rank, priced item by item before anything the items name is allocated.

One :class:`~mpidist.runtime.price.Price` a rank: what the process holds
already (the interpreter, its libraries, their BLAS buffers:
:func:`~mpidist.runtime.memory.settle` put them there), and

* its training state, as the layout splits it (:mod:`mpidist.parallel.holding`);
* its data: its shards in memory, or its streams (:class:`~mpidist.data.Reading`);
* a step's arrays: every layer's workspace for each micro-batch a stage holds
  at once, the passing arrays of the largest, and the batches in flight
  (:func:`~mpidist.nn.rehearsal.rehearse` runs this rank's layers once to
  measure them);
* an evaluation batch's arrays, where the rank evaluates;
* the stacks of the threads a run starts;
* what a checkpoint of the whole model costs the chief (the state it
  assembles or stages), and what the end of the run keeps (the model it
  returns).

:func:`check` refuses a run whose price is more than the rank may hold, naming
every item, before anything is allocated; a model whose training state alone
does not fit is refused earlier (:func:`check_holds`), with the layouts that
would fit it.
"""

import math

import numpy as np

from ..nn import rehearsal, tensor
from ..parallel import holding, schedule
from ..parallel.balance import balance_by_parameters, layer_costs, parse_balance
from ..parallel.mesh import MeshShape
from ..parallel.stage import StageLayout
from ..parallel.units import units_of
from ..runtime.errors import UsageError
from ..runtime.memory import check_fits, holdable, human, thread_bytes
from ..runtime.price import Price
from ..store import checkpoint_save
from . import split_model

#: a step's batches alive at once: a prefetcher's queue of two, the one it fills, the one the step trains on
BATCHES_IN_FLIGHT = 4
EVALUATION_BATCH = 1024  # samples an evaluation runs through the model at once (data.batches.eval_batches)


def optimizer_arrays(config):
    """Arrays of state the optimizer keeps per parameter (Adam's two moments, SGD's velocity)."""
    return len(checkpoint_save.OPTIMIZER_STATE.get(config.optimizer, ()))


def training_price(config, cluster, model, info, reading, reads, local_batch, strategy):
    """The :class:`~mpidist.runtime.price.Price` of training ``model`` (a map of shapes) on this rank of
    ``cluster``: ``reading`` its data's (:class:`~mpidist.data.Reading`), ``reads`` the splits it reads
    (``setup._reads``), ``local_batch`` its worker's share of a global batch (0: it computes none),
    ``strategy`` the class that runs it (its :meth:`~mpidist.parallel.declared.Declared.copies`)."""
    arrays, itemsize, whole = optimizer_arrays(config), model.dtype.itemsize, model.num_params
    share = holding.held(config, cluster, model, arrays)
    price = Price()
    price.add("training state", holding.held_bytes(share, arrays, itemsize))
    price.add("data", reading.nbytes)
    if local_batch:
        passes, slots, batch, evaluated = _passes(config, cluster, model, info, local_batch, reads)
        sample = int(np.prod(model.input_shape)) * itemsize + 8 * (info.target_width + 1)
        price.add("a step's arrays", passes.step * slots + BATCHES_IN_FLIGHT * batch * sample)
        price.add("an evaluation batch", passes.evaluation + 2 * evaluated * sample)
    price.add("threads' stacks", _threads(config, cluster, local_batch) * thread_bytes())
    if share.params == whole and cluster.is_chief:  # (a split model's ranks write their own slices, no copy)
        staged = 2 if config.checkpoint_dir else 1  # (a write behind keeps a copy while the next is made)
        price.add("the whole model's checkpoints and result", staged * (1 + arrays) * whole * itemsize)
    elif share.params == whole:  # (the end of a run on one copy per node leaves each rank zeros of it)
        price.add("the end of the run", whole * itemsize)
    copies = strategy.copies(config, cluster, arrays)
    if config.compress != "none" and local_batch:  # (a worker's residual and what it sends; the chief's rows
        # of every worker's residual for a checkpoint, and their copy for a write behind)
        copies += 2 + (2 * cluster.num_workers if cluster.is_chief else 0)
    price.add("the strategy's buffers", copies * whole * itemsize)
    if cluster.size > 1:
        price.add("MPI's buffers", _mpi_buffers(config, cluster, model, local_batch))
    return price


def _mpi_buffers(config, cluster, model, local_batch):
    """What MPI allocates for the largest message a rank sends: MPICH's allreduce keeps a copy of the message
    (64 MiB: 64 MiB more, measured), a reduce-scatter of one rank's block; the gradients go a bucket (a
    ``--shard parameters`` unit) at a time, a tensor group's or a pipeline's activations a layer's
    output."""
    itemsize = model.dtype.itemsize
    parts = max(1, int(config.tensor))
    units = units_of(model.offsets, model.num_params, config.bucket_mb * (1 << 20) * parts, itemsize)
    gradients = max(unit.size for unit in units) * itemsize // parts
    widest = max(int(np.prod(shape)) for shape in [*model.shapes[1:], model.output_shape])
    return max(gradients, local_batch * widest * itemsize)


def _threads(config, cluster, local_batch):
    """The threads a run starts on this rank after its check: a prefetcher of batches (where it trains), the
    stall monitor (with other ranks to watch), a checkpoint's writer, and one the end's agreement may start
    (:class:`~mpidist.runtime.agreement.OneVoice`); the watch of its own I/O runs already."""
    monitor = cluster.size > 1 and config.stall_timeout > 0
    return (local_batch > 0) + monitor + bool(config.checkpoint_dir) + 1


def _passes(config, cluster, model, info, local_batch, reads):
    """``(passes, slots, batch, evaluated)``: this rank's layers' :class:`~mpidist.nn.rehearsal.Passes`, the
    micro-batches a stage holds at once, the samples of one (a slice of ``--accumulate``), and the samples of
    an evaluation batch (0: none)."""
    layers, layout = layers_of(config, cluster.rank, cluster.size, model)
    slots, batch = 1, max(1, local_batch // max(1, config.accumulate))
    if layout is not None:
        micro = int(config.micro_batches)
        batch = max(1, math.ceil(local_batch / micro))
        slots = in_flight(config.schedule, layout.stage, layout.stages, micro)
    evaluated = 0
    evaluating = [split for split in ("test", "val") if split in reads] or (
        ["test"] if config.strategy == "pipeline" else []
    )
    for split in evaluating:
        _, worker, workers = reads.get(split, (split, 0, 1))
        rows = -(-info.sizes.get(split, 0) // max(1, workers))
        evaluated = max(evaluated, min(EVALUATION_BATCH, rows))
    return rehearsal.rehearse(layers, batch, evaluated), slots, batch, evaluated


def layers_of(settings, rank, size, model):
    """``(layers, layout)``: the model whose layers this rank of ``size`` runs under ``settings`` (a map of
    shapes: ``model``, a pipeline stage's, or a tensor part's), and its stage's
    :class:`~mpidist.parallel.stage.StageLayout` (None outside a pipeline)."""
    parts, layers, layout = max(1, int(settings.tensor)), model, None
    part = MeshShape(size, parts=parts).coordinates(rank)[2]
    if settings.strategy == "pipeline":
        balance = parse_balance(settings, model) or balance_by_parameters(layer_costs(model), settings.stages)
        layout = StageLayout(model, balance, rank, size, parts)
        layers, part = layout.stage_model(model), layout.part
    if parts > 1:  # (this part's layers: a split layer's arrays are its part's)
        layers = tensor.split_model(layers, part, parts, buffers=False)[0]
    return layers, layout


def evaluation_price(settings, rank, size, model, data, batch, kept=0, gradients=True):
    """The :class:`~mpidist.runtime.price.Price` of evaluating (or predicting with) ``model`` (a map of
    shapes) on rank ``rank`` of ``size``: whole on every rank (``settings`` None), or split as ``settings``
    (a layout's: :func:`~mpidist.loop.split_model.layout_settings`) split it; ``data`` the bytes of its
    samples, ``batch`` the samples a pass takes, ``kept`` the outputs it keeps; ``gradients``: a strategy
    runs the passes, with the gradient buffer it makes beside the model (``predict`` runs a whole model's
    forward itself)."""
    if settings is None:
        whole = model.num_params
        share = holding.Held(whole, 0, 0, grads=None if gradients else 0)
        return inference_price(model, model, share, data, batch, kept)
    share = holding.held(settings, split_model.Ranks(rank, size), model, 0)
    layers, _ = layers_of(settings, rank, size, model)
    return inference_price(model, layers, share, data, batch, kept)


def prediction_price(settings, where, model, reader, rows, sizes):
    """The :class:`~mpidist.runtime.price.Price` of ``predict`` on a rank: ``where`` its ``(rank, size,
    replica)``, ``settings`` the split's (None: the whole model), ``reader`` the samples', ``rows`` the
    replica's, ``sizes`` ``(rows read at once, rows a pass takes)``: the model, a part of its rows read (as
    stored and converted), a batch's arrays, the outputs (and targets) it keeps of its rows, and on rank 0
    every rank's, gathered and written."""
    rank, size, _ = where
    part, batch = sizes
    width = int(np.prod(model.output_shape, dtype=np.int64))
    values = int(np.prod(reader.info.sample_shape))
    kept = 2 * rows * (width * model.dtype.itemsize + 8)  # (a part's outputs and targets, then all joined)
    if rank == 0:
        kept += reader.samples * width * (model.dtype.itemsize + 4) + reader.samples * 8
    read = 2 * min(rows, part) * 8 * values
    return evaluation_price(
        settings, rank, size, model, read, min(batch, max(1, rows)), kept, gradients=settings is not None
    )


def inference_price(model, layers, share, data, batch, kept=0):
    """The :class:`~mpidist.runtime.price.Price` of evaluating or predicting with ``model`` (a map of shapes)
    on this rank: ``layers`` the model it runs (:func:`layers_of`), ``share`` what it holds of the model
    (:func:`~mpidist.parallel.holding.held` with no optimizer: its parameters, the gradients a strategy
    keeps, gathered units), ``data`` the bytes of its samples in memory, ``batch`` the samples a pass takes,
    ``kept`` the bytes of what it keeps of the outputs."""
    itemsize = model.dtype.itemsize
    sample = int(np.prod(model.input_shape)) * itemsize
    price = Price()
    price.add("the model", holding.held_bytes(share, 0, itemsize))
    price.add("samples", data)
    price.add("a batch's arrays", rehearsal.rehearse(layers, 0, batch).evaluation + 2 * batch * sample)
    price.add("outputs kept", kept)
    price.add("threads' stacks", 2 * thread_bytes())  # (a stream's reader, the end's agreement)
    return price


def in_flight(name, stage, stages, micro_batches):
    """The most micro-batches stage ``stage`` holds at once under schedule ``name``."""
    held = peak = 0
    for op, _ in schedule.schedule(name, stage, stages, micro_batches):
        held += {"fwd": 1, "bwd": -1}.get(op, 0)
        peak = max(peak, held)
    return max(peak, 1)


def check(config, cluster, model, price):
    """Refuse, naming every item and the layouts that would fit, a run whose ``price`` is more than this
    rank may hold."""
    whole, arrays = model.num_params, optimizer_arrays(config)
    refused = price.refusal(_subject(config, cluster, model, arrays))
    if refused is None:
        return
    state = dict(price.items).get("training state", 0)
    limit = holdable()[0] - (price.more - state)  # (what the training state may take beside the rest)
    share = holding.held(config, cluster, model, arrays)
    ways = _ways_it_fits(config, cluster, model, arrays, limit) if share.params == whole else []
    raise UsageError("; ".join([refused, *ways]))


def _subject(config, cluster, model, arrays):
    whole = model.num_params
    share = holding.held(config, cluster, model, arrays) if cluster is not None else None
    if share is None or not share.part:
        return f"training {whole:,} parameters with {config.optimizer}"
    return (
        f"{share.part} ({share.params:,} of the model's {whole:,} parameters), trained with "
        f"{config.optimizer}"
        + (
            f", and assembling the whole model's state for checkpoints ({share.gathered:,} values)"
            if share.gathered
            else ""
        )
    )


def check_holds(config, cluster, model):
    """Refuse, naming what it needs, a model whose training state alone, as this rank's share of it, does not
    fit in what the rank may hold (before its data and the rest are priced: :func:`check`)."""
    arrays = optimizer_arrays(config)
    whole = model.num_params
    share = (
        holding.held(config, cluster, model, arrays)
        if cluster is not None
        else holding.Held(whole, whole, whole)
    )
    try:
        subject = _subject(config, cluster, model, arrays)
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
