"""``predict``: a trained model's outputs on new samples, spread over the ranks, written in input order.

What is predicted (``data``) is a split of a dataset in the mpidist layout,
or plain samples (a file or a numpy array): :mod:`mpidist.tools.prediction_inputs`
reads and checks them.  The checkpoint's model is loaded by
:func:`mpidist.api.load_trained`, as ``eval`` loads it, for the dataset predicted
(for plain samples: the dataset the checkpoint trained on).  Everything read is
untrusted, and bad input is agreed on by every rank
(:func:`mpidist.runtime.agreement.agreed`): one message, exit code 2, nobody
left waiting.

Rank ``r`` of ``W`` reads one contiguous block of rows (the first ``N % W``
ranks one more), runs ``model.forward(training=False)`` over it in batches of
:data:`BATCH` (a model split as training splits it, ``stages`` x ``tensor``:
each replica its block, through its stages, :mod:`mpidist.loop.split_model`),
and the outputs are gathered to rank 0 with one ``Gatherv``
(:func:`mpidist.runtime.comm.gatherv`: buffers, no pickle), in input order.  Rank 0
writes the output file aside and renames it into place
(:func:`mpidist.store.outputs.claimed`), so an existing file is replaced only by a
whole new one; what the file holds, by its suffix, is
:mod:`mpidist.tools.prediction_file`'s.
"""

import contextlib
import dataclasses
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..api.trained import load_shapes, load_split, read_parameters
from ..loop import split_model
from ..nn.scores import digits4
from ..runtime import comm as mpi
from ..runtime.agreement import agreed, ends_the_job_on_error
from ..runtime.errors import UsageError
from ..runtime import memory
from ..runtime import price as memory_price
from ..runtime.text import check_utf8
from ..runtime.whereabouts import here
from ..store.outputs import claimed
from .prediction_file import refuse_an_input, write_predictions
from .prediction_inputs import reader_for
from .prediction_price import prediction_price

#: Samples per forward pass (``eval`` uses the same).
BATCH = 1024
PART_BYTES = 64 << 20  # samples read and predicted at once on a rank (as float64): memory bounded by this
#: Most values one ``Gatherv`` may carry (MPI counts are C ints).
GATHER_LIMIT = 2**31 - 1


@dataclasses.dataclass
class Predictions:
    """What :func:`predict` returns on every rank; the arrays on rank 0 only (None elsewhere).

    Attributes:
        samples: how many samples were predicted.
        output: the file written, or None where ``output=None``.
        task: ``"classification"`` or ``"regression"``.
        step: the checkpoint's step.
        model: the model's spec.
        checkpoint: the checkpoint file read (a directory's newest, where a directory was given).
        source: what was predicted, in words (``"'digits' (digits.h5), test split"``).
        classes: ``(N,)`` int64, the class of the highest output (first on ties), for classification.
        probabilities: ``(N, K)`` float32 softmax of the outputs, for classification.
        values: ``(N, W)`` outputs in the model's dtype, for regression.
        class_names: the dataset's class names, where it has them.
        figures: for a dataset split (it has labels): ``{"accuracy": ...}`` (classification, the
            fraction ``eval`` reports as ``test_accuracy`` on the test split) or ``{"mse": ...}``
            (regression); ``{}`` for plain samples.  On every rank.
    """

    samples: int
    output: Path
    task: str
    step: int
    model: str
    source: str
    classes: np.ndarray = None
    probabilities: np.ndarray = None
    values: np.ndarray = None
    class_names: list = None
    figures: dict = dataclasses.field(default_factory=dict)
    checkpoint: Path = None

    def summary(self):
        """One line: what was predicted, where it was written, and the figure of a labelled split."""
        read = "" if self.checkpoint is None else f"{self.checkpoint.name}, "
        line = (
            f"mpidist predict: {self.samples} sample{'s' * (self.samples != 1)} of {self.source} ("
            f"{read}step {self.step}, model {self.model})"
        )
        line += f" -> {self.output}" if self.output is not None else " (not written)"
        if "accuracy" in self.figures:
            line += f", accuracy {100 * self.figures['accuracy']:.2f}%"
        elif "mse" in self.figures:
            line += f", MSE {digits4(self.figures['mse'])}"
        return line


def predict(
    checkpoint_path,
    data=None,
    output=None,
    *,
    model=None,
    comm=None,
    split="test",
    stages=1,
    tensor=1,
    shard="none",
):
    """Predict with a checkpoint on new samples, each rank its own block, and write the predictions in input
    order.

    Every rank calls it with the same arguments.

    Args:
        checkpoint_path: a checkpoint file (``ckpt-*.h5``), or a checkpoint directory: its newest
            loadable checkpoint, as ``--resume auto`` picks it.
        data: a dataset in the mpidist layout (a path, a bundled name or an
            :class:`~mpidist.data.arrays.ArrayData`: its ``split`` is predicted), or plain samples: an
            HDF5 file with a dataset ``x``, a ``.npy`` file, an ``.npz`` file with an array ``x``,
            or a numpy array (the same on every rank); default: the dataset the checkpoint trained on.
        output: the HDF5 file rank 0 writes (replaced only by a whole new one); None: write nothing.
        model: the model, where its checkpoint cannot name it; default: the spec the checkpoint stores.
        comm: the communicator whose ranks predict together (default ``MPI.COMM_WORLD``).
        split: the split of a dataset: ``"test"``, ``"train"`` or ``"val"`` (where the file has one).
        stages, tensor: split the model over the ranks as training does (``--stages``, ``--tensor``; see
            :mod:`mpidist.loop.split_model`), for a model no rank can hold: each rank reads only its part of
            the checkpoint, each replica (``ranks / (stages x tensor)``) predicts a block of rows, and its
            last stage's outputs go to rank 0.  1 and 1 (the default): every rank loads the whole model.
        shard: "parameters": each rank holds a shard of every unit of the model and gathers a unit at a time,
            as ``--shard parameters`` trains; each rank predicts a block of rows.

    Returns:
        :class:`Predictions` on every rank, its arrays on rank 0.  Bad input raises
        ``SystemExit(2)`` on every rank, after one message.
    """
    from ..observe.stall import LocalWatch
    from ..runtime.threads import limit_blas_threads
    from ..settings.config import Settings

    limit_blas_threads()
    memory.settle()  # (what it holds from here on is what its price bounds)
    world = MPI.COMM_WORLD if comm is None else comm
    here().enter("setup", 0)
    with LocalWatch(here(), Settings.stall_timeout, world.Get_rank()):
        return _predict(world, checkpoint_path, data, output, model, split, (stages, tensor, shard))


def _predict(world, checkpoint_path, data, output, model, split, layout=(1, 1, "none")):
    rank, size = world.Get_rank(), world.Get_size()
    split_up, saved = layout != (1, 1, "none"), None
    claiming = contextlib.ExitStack()  # rank 0's file written aside, removed unless renamed into place
    with claiming:
        with agreed(world):
            for value, what in ((checkpoint_path, "predict CHECKPOINT"), (output, "predict --output")):
                check_utf8(value, what, absolute=True)
            check_utf8(data, "predict --data")
            reader = reader_for(data, split)
            # the model is built for the dataset predicted, or for plain samples the one it trained on
            if split_up:  # (its arrays are read by slices once the layout exists)
                saved, trained, settings = load_split(
                    checkpoint_path, reader.dataset_for, model, world, *layout, data_given=reader.given
                )
            else:  # (its parameters are read once what the rank will hold is priced)
                saved_whole, trained = load_shapes(
                    checkpoint_path, reader.dataset_for, model=model, data_given=reader.given
                )
            check_utf8(reader.data, "predict --data")  # (as the file records it: absolute)
            net = trained.model
            if rank == 0:
                for note in trained.notes:
                    print(f"mpidist: {note}", flush=True)
            reader.check_shape(net)
            if rank == 0:
                for note in reader.notes:  # (the columns of a CSV file left out)
                    print(f"mpidist: note: {note}", flush=True)
            if reader.info.num_classes > 0 and len(net.output_shape) > 1:
                raise UsageError(
                    f"predict writes one class per sample, and model {trained.spec} classifies each "
                    f"position of a sequence (outputs {tuple(net.output_shape)} per sample): load it "
                    "with mpidist.api.load_trained and call model.forward for its outputs"
                )
            share, shares = split_model.data_share(
                rank, size, *layout[:2]
            )  # (a replica's ranks: the same rows)
            counts, starts = blocks(reader.samples, shares)
            width = int(np.prod(net.output_shape, dtype=np.int64))
            if reader.samples * width > GATHER_LIMIT:
                raise UsageError(
                    f"{reader.where}: {reader.samples:,} samples of {width:,} outputs are more values "
                    f"than one gather carries ({GATHER_LIMIT:,}): predict them in parts"
                )
            target = None if output is None else Path(output)
            if target is not None:
                refuse_an_input(target, [checkpoint_path] + reader.files)
            # rows are read and predicted a part at a time (the memory of a part, whatever the input's size)
            part = max(1, PART_BYTES // (8 * int(np.prod(reader.info.sample_shape))))
            price = prediction_price(
                settings if split_up else None,
                (rank, size),
                net,
                reader,
                counts[share],
                (part, BATCH, 16 * BATCH),
                output,
            )
            price.check(f"predicting {reader.samples:,} samples with {net.num_params:,} parameters")
            if not split_up:
                read_parameters(saved_whole, trained)
            if rank == 0:
                if target is not None:
                    # unwritable: fails now
                    claim = claiming.enter_context(claimed(target, "the predictions"))
        _agree_on_sizes(world, reader.samples, width)
        totals = memory_price.gathered(world, price)
        if rank == 0:
            print(memory_price.said(totals), flush=True)
        forward = (
            (lambda x: _forward(net, x, width))
            if saved is None
            else SplitForward(world, saved, settings, net, reader.info, width)
        )
        givers = _givers(world, forward)
        # every rank takes as many parts, so each read is agreed on: bad rows end every rank cleanly, output
        # untouched
        outputs, targets = [], []
        for lo in range(0, max(counts) or 1, part):
            with agreed(world):
                begin, end = (
                    starts[share] + min(lo, counts[share]),
                    starts[share] + min(lo + part, counts[share]),
                )
                x, y = reader.read(begin, end, net)
            with ends_the_job_on_error(world):
                outputs.append(forward(x))
                targets.append(None if y is None else y[: len(outputs[-1])])  # (no outputs here: no targets)
        with ends_the_job_on_error(world):
            if saved is not None:
                forward.free()
            mine = np.concatenate(outputs)
            classification = reader.info.num_classes > 0
            y = None if targets[0] is None else np.concatenate(targets)
            figures = _figures(world, mine, y, classification) if y is not None else {}
            here().enter("gather")
            gathered = np.empty((reader.samples, width), dtype=mine.dtype) if rank == 0 else None
            owner = [
                split_model.data_share(r, size, *layout[:2])[0] for r in range(size)
            ]  # (each rank's block)
            mpi.gatherv(
                world,
                mine,
                gathered,
                [counts[owner[r]] * width * givers[r] for r in range(size)],
                [starts[owner[r]] * width for r in range(size)],
                root=0,
            )
        result = Predictions(
            samples=reader.samples,
            output=target,
            model=trained.spec,
            step=trained.step,
            task="classification" if classification else "regression",
            source=reader.source,
            class_names=_names(reader.info),
            figures=figures,
            checkpoint=trained.path,
        )
        if rank == 0:
            if classification:
                result.classes, result.probabilities = (
                    gathered.argmax(axis=1).astype(np.int64),
                    softmax(gathered),
                )
            else:
                result.values = gathered
        with agreed(world):  # every rank learns whether the file was written
            if rank == 0 and target is not None:
                here().enter("write")
                claim.write(lambda aside: write_predictions(aside, result, checkpoint_path, reader))
    return result


def blocks(samples, ranks):
    """``(counts, starts)``: contiguous blocks of rows, one per rank, the first ``samples % ranks`` one
    longer."""
    counts = [samples // ranks + (1 if r < samples % ranks else 0) for r in range(ranks)]
    return counts, [int(s) for s in np.cumsum([0] + counts[:-1])]


def softmax(outputs):
    """Softmax over the last axis, computed in float64 in chunks, as float32."""
    out = np.empty(outputs.shape, dtype=np.float32)
    for lo in range(0, len(outputs), BATCH * 16):
        part = outputs[lo : lo + BATCH * 16].astype(np.float64)
        part = np.exp(part - part.max(axis=1, keepdims=True))
        out[lo : lo + len(part)] = part / part.sum(axis=1, keepdims=True)
    return out


def _forward(net, x, width):
    """``net``'s outputs on ``x`` in batches, as a host array ``(len(x), width)``."""
    from ..runtime.xp import to_host

    xp = net.xp
    here().enter("compute")
    out = np.empty((len(x), width), dtype=net.dtype)
    for lo in range(0, len(x), BATCH):
        out[lo : lo + BATCH] = to_host(net.forward(xp.asarray(x[lo : lo + BATCH]), training=False)).reshape(
            -1, width
        )
    return out


class SplitForward:
    """``forward(x)`` for a model split over the ranks (collective over a replica): the outputs on the rank
    that gives its replica's (``(len(x), width)``, host), an empty ``(0, width)`` array on the others."""

    def __init__(self, world, saved, settings, net, info, width):
        from ..runtime.cluster import build_cluster

        with agreed(world):  # (a part whose checksum differs: one message, every rank exits 2)
            saved.check_parts((world.Get_rank(), world.Get_size()))
        with ends_the_job_on_error(world):
            self.cluster = build_cluster(world)
            self.strategy = split_model.split_strategy(settings, net, info, self.cluster)
            self.strategy.restore(saved)
        self.gives, self.width, self.dtype = split_model.gives_outputs(self.strategy), width, net.dtype

    def __call__(self, x):
        from ..runtime.xp import to_host

        here().enter("compute")
        out = np.empty((len(x) if self.gives else 0, self.width), dtype=self.dtype)
        # (where the ranks' forward passes are collective, every rank runs as many: Passes.in_step)
        for lo in self.strategy.passes.in_step(range(0, len(x), BATCH)):
            part = split_model.outputs(self.strategy, x[lo : lo + BATCH])
            if part is not None:
                out[lo : lo + BATCH] = to_host(part).reshape(-1, self.width)
        return out

    def free(self):
        self.strategy.free()
        self.cluster.free()


def _givers(world, forward):
    """Which ranks give outputs to the gather (1 or 0 each): every rank, or one of each replica of a split
    model."""
    mine = np.array([getattr(forward, "gives", True)], dtype=np.int64)
    every = np.empty(world.Get_size(), dtype=np.int64)
    mpi.allgather(world, mine, every)
    return [int(flag) for flag in every]


def _figures(world, outputs, y, classification):
    """Accuracy or MSE over every rank's rows, as ``eval`` computes it (a ratio of summed counts)."""
    if classification:
        correct = float((outputs.argmax(axis=1) == y.reshape(-1)).sum()) if len(outputs) else 0.0
        total, count = mpi.sum_float64(world, [correct, len(outputs)])
        return {"accuracy": float(total / int(count))}
    error = outputs.astype(np.float64) - y.reshape(outputs.shape).astype(np.float64)
    total, count = mpi.sum_float64(world, [float((error * error).sum()), error.size])
    return {"mse": float(total / int(count))}


def _agree_on_sizes(world, samples, width):
    """Every rank must see the same samples (a numpy array differing between ranks would scramble the
    gather)."""
    mine = np.array([samples, width], dtype=np.int64)
    every = np.empty((world.Get_size(), 2), dtype=np.int64)
    mpi.allgather(world, mine, every)
    with agreed(world):
        if (every != mine).any():
            raise UsageError(
                f"the ranks were given different samples: {every[:, 0].tolist()} samples of "
                f"{every[:, 1].tolist()} outputs; pass the same data on every rank"
            )


def _names(info):
    names = getattr(info, "class_names", None)
    if names is None:
        return None
    return [name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name) for name in names]
