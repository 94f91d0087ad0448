"""What ``plan --calibrate`` measured, as a JSON file: the figures every prediction starts from.

Everything in it is read back as untrusted input (a file anyone may have
edited): each figure is checked for its type, finiteness and range before a
prediction uses it, and a file that fails names the figure.
"""

import dataclasses
import json
import math
import os

from ..bench.output import write_results
from ..runtime.errors import UsageError
from ..store.outputs import read_input
from .links import Link

FORMAT = "mpidist-calibration-2"  # (2: micro_batch_s, overlap; the baseline with the read before the state)
MAX_BYTES = 1 << 22  # a calibration is a few KiB: refuse to read a larger file whole
MAX_LAYERS = 100_000
# Bounds of what a machine can have measured, so that every prediction is a finite number: no figure of
# seconds above a day (a step of one layer, a byte, a parameter), no slowdown or spread above a thousandfold,
# no model above 2^50 parameters (a petabyte of float32; the bucket advice tries only sizes of few buckets)
MOST_SECONDS = 86_400.0
MOST_FACTOR = 1_000.0
MOST_PARAMS = 1 << 50


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One top-level layer: its parameters, its output's elements per sample, whether ``--tensor`` divides it
    (its parameters and work), and its time per step as ``fixed + per_sample x samples`` seconds, forward and
    backward."""

    name: str
    params: int
    out_elements: int
    splits: bool
    forward: tuple  # (fixed s, s per sample)
    backward: tuple


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The figures of one model on one machine.

    Attributes:
        model, data, optimizer, dtype: what was measured (the run's settings).
        itemsize: bytes per parameter; sample_bytes: bytes per training sample as read.
        read_overhead_bytes: what reading a worker's lanes in memory (one of two workers) took at its peak
            above what it then held: the blocks and chunks of the file it reads them from.
        batch_per_rank: the batch it was measured at (``plan``'s default).
        train_samples, test_samples: the splits' rows (an epoch's data held in memory; what the last
            evaluation
            reads, spread over the workers).
        layers: a :class:`LayerCost` per top-level layer; loss: its (fixed, per-sample) seconds.
        tensor_sums: the elements per sample of each sum of activations a tensor group makes in forward (as
            many again in backward).
        optimizer_per_param: seconds per parameter of an update (the optimizer and the checks around it).
        step_overhead: seconds a step of ``train`` takes besides the strategy's step (batches, metrics).
        micro_batch_s: seconds a pipeline stage spends on each micro-batch besides its layers' lines and the
            sum of its gradients (its bookkeeping, and what small batches cost the layers above their lines).
        overlap: the share of what ``allreduce --exchange mpi``'s buckets could hide behind backward that it
            did
            hide, measured (0: none, as where ranks move the bytes on the cores they compute on; 1: all the
            bucket model says, as where a network card moves them).
        sum_per_byte: seconds per byte of summing one buffer into another in memory.
        jitter: the relative spread of step times (a standard deviation over the median) as two ranks'
            synchronous steps meet it (where one rank was calibrated alone: its own steps').
        node_crowding, network_crowding: how much slower a rank's step runs while another rank on its node (on
            another node) trains too (1.0: not slower, or not measured).
        node, network: the links within a node and between nodes (None: not measured, for want of two ranks
            on one node, or of two nodes).
        baseline_bytes: a rank's resident memory before any data or model (Python, numpy, MPI).
        ranks_per_node, cores, node_memory_bytes: where it was measured (the node's memory as available
            then: what a layout must fit in, unless ``plan --memory-per-node`` says otherwise).
    """

    model: str
    data: str
    optimizer: str
    dtype: str
    itemsize: int
    sample_bytes: int
    read_overhead_bytes: int
    batch_per_rank: int
    train_samples: int
    test_samples: int
    layers: tuple
    loss: tuple
    tensor_sums: tuple
    optimizer_per_param: float
    step_overhead: float
    micro_batch_s: float
    overlap: float
    sum_per_byte: float
    jitter: float
    node: Link
    network: Link
    node_crowding: float
    network_crowding: float
    baseline_bytes: int
    ranks_per_node: int
    cores: int
    node_memory_bytes: int

    @property
    def params(self):
        return sum(layer.params for layer in self.layers)

    def link_for(self, layout):
        """The link a layout's exchanges cross: this node's on one node, else the network's."""
        return self.node if layout.nodes == 1 else self.network

    def crowding_for(self, layout):
        """How much slower a rank computes beside the layout's others: ranks that train at once slow each
        other (a node's memory and caches; emulated nodes share a machine)."""
        return max(
            1.0,
            self.node_crowding if layout.per_node > 1 else 1.0,
            self.network_crowding if layout.nodes > 1 else 1.0,
        )

    def compute(self, samples):
        """Seconds of forward and backward of the whole model, the loss included, on ``samples`` samples."""
        return (
            sum(
                part[0] + part[1] * samples
                for layer in self.layers
                for part in (layer.forward, layer.backward)
            )
            + self.loss[0]
            + self.loss[1] * samples
        )

    def to_json(self):
        document = dataclasses.asdict(self)
        document["format"] = FORMAT
        return document


def save(calibration, path):
    """Write ``calibration`` to ``path`` whole (aside, then renamed over it)."""
    write_results(path, calibration.to_json(), "the calibration")


def load(path):
    """The :class:`Calibration` in ``path``, every figure checked; a :class:`UsageError` names what is
    wrong."""
    if not os.path.lexists(path):  # (the first plan a user runs: say how to make one)
        raise UsageError(
            f"--calibration {path}: no such file; measure one where the run will go first: mpiexec -n 2 "
            "python -m mpidist plan --calibrate --model MODEL --data DATA (it writes calibration.json, or "
            "--calibration FILE)"
        )
    raw = read_input(path, MAX_BYTES, "--calibration", "a calibration")
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as err:
        raise UsageError(f"--calibration {path}: not JSON ({err})") from None
    except RecursionError:  # (arrays within arrays past Python's stack: no calibration is so)
        raise UsageError(f"--calibration {path}: not a calibration (nested too deep to read)") from None
    return _checked(document, f"--calibration {path}")


def _no_constant(name):
    raise ValueError(f"{name} is not a figure")


def _checked(document, where):
    read = _Reader(document, where)
    if read.value("format", str) != FORMAT:
        raise UsageError(f"{where}: format {document.get('format')!r}, not {FORMAT!r} (calibrate again)")
    layers = read.value("layers", list)
    if not 0 < len(layers) <= MAX_LAYERS:
        raise UsageError(f"{where}: layers: {len(layers)} layers (1 to {MAX_LAYERS:,} expected)")
    costs = []
    for index, entry in enumerate(layers):
        layer = _Reader(entry, f"{where}: layers[{index}]")
        costs.append(
            LayerCost(
                layer.value("name", str),
                layer.count("params"),
                layer.count("out_elements"),
                layer.value("splits", bool),
                layer.pair("forward"),
                layer.pair("backward"),
            )
        )
    if sum(cost.params for cost in costs) > MOST_PARAMS:
        raise UsageError(
            f"{where}: layers: {sum(cost.params for cost in costs):,} parameters in all, more than "
            f"{MOST_PARAMS:,} (2^50): not a model a calibration measured"
        )
    sums = read.value("tensor_sums", list)
    if len(sums) > MAX_LAYERS or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 40 for n in sums
    ):
        raise UsageError(f"{where}: tensor_sums: positive element counts expected")
    made = Calibration(
        model=read.value("model", str),
        data=read.value("data", str),
        optimizer=read.value("optimizer", str),
        dtype=read.value("dtype", str),
        itemsize=read.count("itemsize", least=1),
        sample_bytes=read.count("sample_bytes"),
        read_overhead_bytes=read.count("read_overhead_bytes"),
        batch_per_rank=read.count("batch_per_rank", least=1),
        train_samples=read.count("train_samples", least=1),
        test_samples=read.count("test_samples"),
        layers=tuple(costs),
        loss=read.pair("loss"),
        tensor_sums=tuple(sums),
        optimizer_per_param=read.seconds("optimizer_per_param"),
        step_overhead=read.seconds("step_overhead"),
        micro_batch_s=read.seconds("micro_batch_s"),
        overlap=read.share("overlap"),
        sum_per_byte=read.seconds("sum_per_byte"),
        jitter=read.seconds("jitter"),
        node=read.link("node", optional=True),
        network=read.link("network", optional=True),
        node_crowding=read.seconds("node_crowding"),
        network_crowding=read.seconds("network_crowding"),
        baseline_bytes=read.count("baseline_bytes"),
        ranks_per_node=read.count("ranks_per_node", least=1),
        cores=read.count("cores", least=1),
        node_memory_bytes=read.count("node_memory_bytes", least=1),
    )
    for name in ("jitter", "node_crowding", "network_crowding"):
        if getattr(made, name) > MOST_FACTOR:
            raise UsageError(
                f"{where}: {name}: {getattr(made, name)!r:.60} is more than {MOST_FACTOR:g}: not a "
                "spread or a slowdown a machine shows"
            )
    if made.compute(made.batch_per_rank) + made.step_overhead <= 0:  # (every prediction divides by a step)
        raise UsageError(
            f"{where}: layers, loss and step_overhead: every figure is 0, so a step would take no "
            "time: not a measurement (calibrate again)"
        )
    return made


class _Reader:
    """Typed, range-checked reads of one JSON object, each failure a :class:`UsageError` naming the field."""

    def __init__(self, document, where):
        if not isinstance(document, dict):
            raise UsageError(f"{where}: an object expected, got {type(document).__name__}")
        self.document, self.where = document, where

    def value(self, name, kind):
        value = self.document.get(name)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise UsageError(f"{self.where}: {name}: {kind.__name__} expected, got {value!r:.60}")
        return value

    def count(self, name, least=0):
        value = self.value(name, int)
        if not least <= value < 1 << 62:
            raise UsageError(f"{self.where}: {name}: {value} is out of range")
        return value

    def seconds(self, name, value=None):
        value = self.document.get(name) if value is None else value
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not 0 <= value <= MOST_SECONDS
        ):
            raise UsageError(
                f"{self.where}: {name}: a figure from 0 to {MOST_SECONDS:,.0f} expected, got {value!r:.60}"
            )
        return float(value)

    def share(self, name):
        value = self.seconds(name)
        if value > 1:
            raise UsageError(f"{self.where}: {name}: a share from 0 to 1 expected, got {value!r:.60}")
        return value

    def pair(self, name):
        value = self.value(name, list)
        if len(value) != 2:
            raise UsageError(
                f"{self.where}: {name}: two figures expected (fixed, per sample), got {len(value)}"
            )
        return tuple(self.seconds(name, figure) for figure in value)

    def link(self, name, optional=False):
        value = self.document.get(name)
        if value is None and optional:
            return None
        figures = _Reader(value, f"{self.where}: {name}")
        return Link(figures.seconds("latency"), figures.seconds("per_byte"))
