"""A training step's time and a rank's memory, predicted for a layout from a :class:`Calibration`.

Each strategy is costed as mpidist runs it (the module docstrings of
:mod:`mpidist.parallel` say how): the compute of a worker's share of the
global batch, the part of the exchange that backward does not hide (here:
all of it, a bound), the optimizer on the parameters a rank updates, the
pipeline's bubble from the schedule's own simulation with measured stage
times, and the wait for the slowest of the ranks a step synchronises.
"""

import dataclasses
import functools
import math
import statistics

import numpy as np

from ..parallel import AllreduceStrategy, LocalStrategy, PipelineStrategy, PsAsyncStrategy, PsSyncStrategy
from ..parallel.data.units import block_of, gathered_elements, node_sharing
from ..parallel.holding import zero_bytes_per_param
from ..parallel.mesh import MeshShape
from ..parallel.pipeline.balance import balance_by_parameters
from ..parallel.pipeline.schedule import schedule as stage_plan
from ..parallel.pipeline.schedule import simulate
from ..parallel.registry import STRATEGIES
from ..runtime.errors import UsageError
from .buckets import MIB, hideable
from .layout import Prediction
from .unit_traffic import shared_by, unit_traffic, units_of_model

OPTIMIZER_ARRAYS = {"adam": 2, "sgd": 1}  # optimizer state per parameter


def predicted(strategy):
    """Whether ``plan`` costs the registered strategy named ``strategy`` (``local-sgd`` has no cost model;
    ``plan --check`` passes its runs over, saying so)."""
    return STRATEGIES.get(strategy) in _COSTS


def predict(cal, layout):
    """The :class:`Prediction` of ``layout`` (a :class:`UsageError` where the layout cannot run)."""
    check(cal, layout)
    made = _COSTS[STRATEGIES[layout.strategy]](cal, layout)
    # ranks crowd each other while they compute at once: a pipeline stage with slack leaves its neighbour
    # alone for part of the step (and a bubble and a wait are made of stage and step times: as slow)
    slower = 1.0 + (cal.crowding_for(layout) - 1.0) * made.together
    return dataclasses.replace(
        made,
        compute=made.compute * slower,
        optimizer=made.optimizer * slower,
        bubble=made.bubble * slower,
        wait=made.wait * slower,
        loop=cal.step_overhead,
    )


def check(cal, layout):
    if layout.strategy in ("ps-sync", "ps-async") and not 0 < layout.ps < layout.ranks:
        raise UsageError(f"{layout.describe()}: needs 1 to {layout.ranks - 1} ps ranks on {layout.ranks}")
    if layout.nodes > 1 and cal.network is None:
        raise UsageError(
            f"{layout.nodes} nodes: the calibration has no link between nodes (it ran on one): "
            "give one with --link, e.g. --link 25GB/s,2us"
        )
    if layout.per_node > 1 and cal.node is None:
        raise UsageError(
            f"{layout.per_node} ranks a node: the calibration has no link within a node (it ran one "
            "rank a node): calibrate with two ranks on one node"
        )
    if not MeshShape.divides(layout.ranks, layout.stages, layout.tensor):
        raise UsageError(
            f"--stages {layout.stages} x --tensor {layout.tensor} does not divide {layout.ranks} ranks"
        )
    if layout.stages > len(cal.layers):
        raise UsageError(f"--stages {layout.stages}: the model has {len(cal.layers)} layers")


@functools.lru_cache(maxsize=None)
def slowest_of(count):
    """The expected largest of ``count`` standard normal draws: ``integral of x d(Phi(x)^count)``, summed on a
    fine grid (to 1e-4; ``sqrt(2 ln count)``, its limit, is twice too large at 2)."""
    if count <= 1:
        return 0.0
    x = np.linspace(-8.0, 8.0 + math.sqrt(2 * math.log(count)), 8001)
    below = np.array([statistics.NormalDist().cdf(value) for value in x])
    # Phi^count from its logarithm: at a million ranks Phi^(count - 1) underflows where the density is not 0
    top = np.exp(count * np.log(np.maximum(below, 1e-300)))
    return float(np.sum(0.5 * (x[1:] + x[:-1]) * np.diff(top)))


def _wait(cal, compute, ranks):
    """The expected wait for the slowest of ``ranks`` ranks whose step times spread by ``cal.jitter`` (as
    independent normal draws)."""
    return cal.jitter * compute * slowest_of(ranks)


EVAL_BATCH = 1024  # samples an evaluation runs through the model at once (data.batches.eval_batches)


def _memory(cal, layout, params, updated, workers, activations, kept=0):
    """A rank's resident bytes at the larger of two moments, on top of the baseline, its lanes of the training
    data, and its parameters and gradients (the model is built first): reading its lanes at set-up (with other
    workers' lanes between its rows, what the read takes above them, as calibrated); then training and the
    last evaluation, with the optimizer state of what it updates, ``kept`` more values the strategy keeps, a
    step's ``activations`` and an evaluation batch's."""
    item = cal.itemsize
    state = (OPTIMIZER_ARRAYS.get(cal.optimizer, 2) * updated + kept) * item
    data = cal.train_samples * cal.sample_bytes // max(1, workers)
    # the last evaluation: its share of the test split, a batch of up to EVAL_BATCH through every layer
    evaluated = (
        min(EVAL_BATCH, -(-cal.test_samples // max(1, workers)))
        * item
        * sum(layer.out_elements for layer in cal.layers)
    )
    reading = cal.read_overhead_bytes if workers > 1 else 0
    return int(cal.baseline_bytes + data + 2 * params * item + max(reading, state + activations + evaluated))


def _activations(cal, samples, first=0, end=None):
    end = len(cal.layers) if end is None else end
    return samples * cal.itemsize * sum(layer.out_elements for layer in cal.layers[first:end])


def _local(cal, layout):
    compute = cal.compute(layout.batch)
    return Prediction(
        layout,
        compute,
        0.0,
        cal.optimizer_per_param * cal.params,
        0.0,
        0.0,
        _memory(cal, layout, cal.params, cal.params, 1, _activations(cal, layout.batch)),
    )


def _tensor_share(cal, tensor):
    """``(parameters a part holds, fraction of the compute it does)`` at ``--tensor tensor``."""
    if tensor == 1:
        return cal.params, 1.0
    params = sum(layer.params / tensor if layer.splits else layer.params for layer in cal.layers)
    whole = sum(layer.forward[1] + layer.backward[1] for layer in cal.layers) or 1.0
    share = sum(
        (layer.forward[1] + layer.backward[1]) / (tensor if layer.splits else 1) for layer in cal.layers
    )
    return int(params), share / whole


def _fully_sharded(cal, layout):
    """``allreduce --shard parameters``: a worker gathers every unit for its forward and again for its
    backward (all but the last two, still gathered), sums each unit's gradients into their owners' shards,
    and updates and holds ``1/W`` of everything, with two units gathered at a time.  The exchange is all
    costed (a bound: each unit's gather overlaps the one before's compute)."""
    workers = layout.replicas
    samples = layout.batch / workers
    compute = cal.compute(samples)
    units = units_of_model(cal, layout.bucket_mb)
    padded = [workers * block_of(unit.size, workers) * cal.itemsize for unit in units]
    sharing = shared_by(layout)
    exchange = unit_traffic(cal, layout, padded, sharing)
    shard = -(-cal.params // workers)
    slots = gathered_elements(units, False, workers, True, sharing)
    return Prediction(
        layout,
        compute,
        exchange,
        cal.optimizer_per_param * shard,
        0.0,
        _wait(cal, compute, layout.ranks),
        _memory(cal, layout, shard, shard, workers, _activations(cal, samples), kept=slots),
    )


def held_per_parameter(cal, counts=(1, 2, 4), bucket_mb=64.0, per_node=1):
    """Rows of the bytes a worker holds a parameter under each ``allreduce`` layout at each worker count of
    ``counts``: the ZeRO paper's count (:func:`~mpidist.parallel.holding.zero_bytes_per_param`) and, with
    ``--shard parameters``, its gathered units (two of the calibrated model's, at ``bucket_mb``), their
    parameters read once per node where the workers fill nodes of ``per_node`` alike (``--exchange auto``)."""
    item, arrays = cal.itemsize, OPTIMIZER_ARRAYS.get(cal.optimizer, 2)
    units = units_of_model(cal, bucket_mb)
    rows = []
    for shard in ("none", "optimizer", "parameters"):
        for workers in counts:
            local = min(workers, per_node)
            sharing = node_sharing("auto", local) if workers % local == 0 else 1
            gathered = (
                gathered_elements(units, False, workers, True, sharing) * item / cal.params
                if shard == "parameters"
                else 0
            )
            zero = zero_bytes_per_param(shard, workers, arrays, item)
            rows.append(
                {
                    "shard": shard,
                    "workers": workers,
                    "zero": zero,
                    "gathered": gathered,
                    "held": zero + gathered,
                }
            )
    return rows


def _allreduce(cal, layout):
    if layout.shard == "parameters":
        return _fully_sharded(cal, layout)
    groups = layout.replicas
    samples = layout.batch / groups
    params, share = _tensor_share(cal, layout.tensor)
    compute = cal.compute(samples) * share
    nbytes = params * cal.itemsize
    node_model = layout.exchange == "auto" and layout.tensor == 1 and layout.per_node > 1
    if node_model:  # one copy per node: a rank sums its 1/L over the node, rings between nodes, updates 1/L
        local = layout.per_node
        exchange = (local - 1) * nbytes / local * cal.sum_per_byte
        if layout.nodes > 1:
            exchange += (
                2 * (layout.nodes - 1) * (cal.network.latency + nbytes / layout.nodes * cal.network.per_byte)
            )
        updated = params / local
        # (the others' gradients a rank sums its part of: its pages too)
        window = (local - 1) * nbytes // local
    else:  # MPI's allreduce over the groups' same parts
        link = cal.link_for(layout)
        exchange = link.allreduce(nbytes, groups) + (groups - 1) / groups * nbytes * cal.sum_per_byte
        if layout.buckets and cal.overlap > 0:  # (the calibrated share of what the buckets can hide)
            exchange -= cal.overlap * hideable(cal, layout, layout.bucket_mb * MIB)[0]
        updated = params / groups if layout.shard == "optimizer" else params
        window = 0
    if layout.tensor > 1:  # two sums of activations per split pair, forward and backward, within a node
        sums = sum(elements for elements in cal.tensor_sums) * samples * cal.itemsize
        exchange += 2 * cal.node.allreduce(sums, layout.tensor) + 2 * len(cal.tensor_sums) * cal.node.latency
    return Prediction(
        layout,
        compute,
        exchange,
        cal.optimizer_per_param * updated,
        0.0,
        _wait(cal, compute, layout.ranks),
        _memory(cal, layout, params, updated, groups, _activations(cal, samples) * share) + window,
    )


def _ps_sync(cal, layout):
    workers, ps = layout.ranks - layout.ps, layout.ps
    samples = layout.batch / workers
    compute = cal.compute(samples)
    nbytes = cal.params * cal.itemsize
    link = cal.link_for(layout)
    # Reduce_scatter: each ps takes its shard of every worker's gradients (its link carries them in turn) and
    # sums them; Allgatherv: each ps's updated shard to every rank
    gather = workers * link.time(nbytes / ps) + workers * nbytes / ps * cal.sum_per_byte
    scatter = (layout.ranks - 1) * link.latency + nbytes * link.per_byte
    # a ps keeps the previous shard and its optimizer state (a lost rank's rollback) and checks the sum:
    # copies
    kept = (1 + OPTIMIZER_ARRAYS.get(cal.optimizer, 2) + 0.5) * nbytes / ps * cal.sum_per_byte
    return Prediction(
        layout,
        compute,
        gather + scatter,
        cal.optimizer_per_param * cal.params / ps + kept,
        0.0,
        _wait(cal, compute, workers),
        _memory(cal, layout, cal.params, cal.params / ps, workers, _activations(cal, samples)),
    )


def _ps_async(cal, layout):
    """Workers step apart: a worker's step is its compute and a push and a pull of the whole model; a ps
    serves every worker's push in turn, which bounds the rate when the workers outrun it."""
    workers, ps = layout.ranks - layout.ps, layout.ps
    samples = layout.batch / workers
    compute = cal.compute(samples)
    nbytes = cal.params * cal.itemsize
    link = cal.link_for(layout)
    moves = 2 * link.time(nbytes, messages=ps)
    serve = (
        link.time(2 * nbytes / ps)
        + nbytes / ps * cal.sum_per_byte
        + cal.optimizer_per_param * cal.params / ps
    )
    # one worker-step of the whole job (every worker once) takes the longer of a worker's step and the ps's
    # turns
    round_s = max(compute + moves, workers * serve)
    return Prediction(
        layout,
        compute,
        round_s - compute,
        0.0,
        0.0,
        0.0,
        _memory(cal, layout, cal.params, cal.params / ps, workers, _activations(cal, samples)),
    )


def _pipeline(cal, layout):
    stages, tensor = layout.stages, layout.tensor
    replicas = layout.replicas
    micro = layout.batch / (replicas * layout.micro_batches)
    sizes = balance_by_parameters([layer.params + 1 for layer in cal.layers], stages)
    starts = [sum(sizes[:stage]) for stage in range(stages + 1)]
    spans = list(zip(starts[:-1], starts[1:]))
    params = [sum(layer.params for layer in cal.layers[lo:hi]) for lo, hi in spans]  # (each stage's)
    seconds = {}
    for stage, (lo, hi) in enumerate(spans):
        forward = sum(cal.layers[i].forward[0] + cal.layers[i].forward[1] * micro for i in range(lo, hi))
        backward = sum(cal.layers[i].backward[0] + cal.layers[i].backward[1] * micro for i in range(lo, hi))
        if hi == len(cal.layers):
            backward += cal.loss[0] + cal.loss[1] * micro
        # each micro-batch's gradients are added into the step's, and the runner keeps its books
        backward += params[stage] * cal.itemsize * cal.sum_per_byte + cal.micro_batch_s
        seconds[stage, "fwd"], seconds[stage, "bwd"] = forward, backward
    link = cal.link_for(layout)
    largest = max(cal.layers[hi - 1].out_elements for _, hi in spans[:-1]) if stages > 1 else 0
    transfer = link.time(micro * largest * cal.itemsize) if stages > 1 else 0.0
    plans = [stage_plan(layout.schedule, stage, stages, layout.micro_batches) for stage in range(stages)]
    makespan, peak = _makespan(plans, seconds, transfer)
    loads = [
        sum(seconds[stage, op] for op, _ in plan if op in ("fwd", "bwd")) for stage, plan in enumerate(plans)
    ]
    busy = max(loads)
    stage_params = max(params)
    nbytes = stage_params * cal.itemsize
    exchange = link.allreduce(nbytes, replicas) + (replicas - 1) / replicas * nbytes * cal.sum_per_byte
    held = max(_activations(cal, peak[stage] * micro, lo, hi) for stage, (lo, hi) in enumerate(spans))
    # (each rank draws, writes and reads only its own slices: no rank, the chief included, holds the whole)
    # (the busiest stage computes beside the others only while they compute: the rest of its step, alone;
    # replicas side by side on a node compute at once)
    together = 1.0
    if 1 < stages and layout.per_node <= stages * tensor and busy > 0:
        together = min(1.0, (sum(loads) - busy) / ((stages - 1) * busy))
    return Prediction(
        layout,
        busy,
        exchange,
        cal.optimizer_per_param * stage_params,
        makespan - busy,
        _pipeline_wait(cal, plans, seconds, transfer, makespan, replicas),
        _memory(cal, layout, stage_params, stage_params, replicas, held, kept=stage_params),
        together=together,
    )


def _makespan(plans, seconds, transfer):
    """``(seconds from the first stage's start to the last's end, activations held per stage)`` of the
    schedule run with ``seconds[stage, op]`` per computation."""
    timeline, peak = simulate(plans, cost=lambda stage, op: seconds[stage, op], transfer=transfer)
    return max(
        start + seconds[stage, op] for stage, line in enumerate(timeline) for start, op, _ in line
    ), peak


DRAWS = 64  # schedules run with drawn stage speeds, for the pipeline's wait


def _pipeline_wait(cal, plans, seconds, transfer, makespan, replicas):
    """What stages that step at different speeds add to the schedule's makespan: the schedule run
    :data:`DRAWS` times, each stage's step slowed or sped by a draw of the calibrated spread (a stage with
    slack to spare delays no one; stages as loaded as each other wait for the slowest), then the slowest of
    ``replicas`` replicas' makespans, which the replicas' allreduce waits for."""
    if cal.jitter <= 0:
        return 0.0
    rng = np.random.default_rng(0)  # (the same prediction every time)
    spans = []
    for _ in range(DRAWS):
        factor = np.maximum(0.1, 1.0 + cal.jitter * rng.standard_normal(len(plans)))
        drawn = {(stage, op): value * factor[stage] for (stage, op), value in seconds.items()}
        spans.append(_makespan(plans, drawn, transfer)[0])
    mean, spread = float(np.mean(spans)), float(np.std(spans))
    return max(0.0, mean - makespan) + spread * slowest_of(replicas)


#: The cost of a step of each strategy plan predicts, by its registered class (a renamed or subclassed
#: strategy is found through the registry, and a strategy left out is said to be so: :func:`predicted`)
_COSTS = {
    LocalStrategy: _local,
    AllreduceStrategy: _allreduce,
    PsSyncStrategy: _ps_sync,
    PsAsyncStrategy: _ps_async,
    PipelineStrategy: _pipeline,
}
