"""A checkpoint's test figures, spread over the ranks: :func:`evaluate` (what ``python -m mpidist eval``
runs).

The checkpoint is loaded and checked through :mod:`mpidist.api.trained`, as
every rank's work; with ``stages`` or ``tensor`` above 1 the model is split
over the ranks as training splits it (:mod:`mpidist.loop.split_model`), each
rank reading only its part, for a model no rank can hold whole.
"""

import numpy as np
from mpi4py import MPI

from .. import data as datasets  # (``data`` is the argument users know)
from ..loop.inference_pricing import evaluation_price
from ..loop.rehearsed import EVALUATION_BATCH
from ..loop.evaluations import shown
from ..nn import scores
from ..observe.stall import LocalWatch
from ..runtime.agreement import agreed, ends_the_job_on_error
from ..runtime.cluster import build_cluster
from ..runtime.errors import UsageError
from ..runtime.price import gathered, said
from ..runtime.text import check_utf8
from ..runtime import memory
from ..runtime.threads import limit_blas_threads
from ..runtime.whereabouts import here
from ..settings.config import Settings
from .trained import load_shapes, load_split, read_parameters


def evaluate(
    checkpoint_path, data=None, *, model=None, comm=None, samples=0, stages=1, tensor=1, shard="none"
):
    """Evaluate a checkpoint on a dataset's test split, spread over the ranks of ``comm``.

    Args:
        checkpoint_path: a checkpoint file (``ckpt-*.h5``), or a checkpoint directory: its newest
            loadable checkpoint, as ``--resume auto`` picks it.
        data: the dataset (a path, a bundled name or an ArrayData); default: the one it trained on.
        model: the model, where its checkpoint cannot name it (layers given as objects) or
            to choose the builder yourself; default: the model spec the checkpoint stores.
        samples: evaluate this many rows of the split, evenly spread, the same every time (as
            ``--eval-samples`` in training); 0: all of them.
        stages, tensor: split the model over the ranks as training does (``--stages``,
            ``--tensor``; see :mod:`mpidist.loop.split_model`), for a model no rank can hold:
            each rank reads only its part of the checkpoint.  1 and 1 (the default): every
            rank loads the whole model and evaluates a share of the split.
        shard: "parameters": each rank holds a shard of every unit of the model (of its tensor
            part) and gathers one unit at a time, as ``--shard parameters`` trains (the ranks
            evaluate their shares of the split together).

    Returns:
        A dict, the same on every rank, of the figures that fit the task (see
        :mod:`mpidist.nn.scores`) and of what was evaluated (``samples``, ``step`` the
        checkpoint's, ``model`` its spec, ``dataset`` its name, ``checkpoint`` the file read). The
        figures are

        * classification: ``test_loss``, ``test_accuracy``, ``test_top5_accuracy`` (top-``k``
          with ``k = min(5, classes - 1)``, e.g. ``test_top3_accuracy`` for 4 classes; none for 2),
          ``test_per_class`` (one record per class: ``class``, ``name`` where the dataset names
          its classes, ``precision``, ``recall``, ``f1``, ``support``; 0.0 where a class is never
          predicted or has no support) and ``test_confusion`` (rows the true class, columns the
          predicted one; up to :data:`mpidist.nn.scores.CONFUSION_LIMIT` classes);
        * regression: ``test_loss``, ``test_mse``, ``test_mae``, ``test_r2`` (no ``test_accuracy``).
    """
    limit_blas_threads()
    memory.settle()  # (what it holds from here on is what its price bounds)
    world = MPI.COMM_WORLD if comm is None else comm
    here().enter("setup", 0)
    with LocalWatch(here(), Settings.stall_timeout, world.Get_rank()):
        return _evaluate(world, checkpoint_path, data, model, samples, (stages, tensor, shard))


def _evaluate(world, checkpoint_path, data, model, samples=0, layout=(1, 1, "none")):
    from ..loop import split_model
    from ..nn import loss_for
    from ..parallel import AllreduceStrategy

    stages, tensor, shard = layout
    split = layout != (1, 1, "none")
    rank, ranks = world.Get_rank(), world.Get_size()
    with agreed(world):
        check_utf8(checkpoint_path, "eval CHECKPOINT", absolute=True)
        if split:  # (its arrays are read by slices once the layout exists)
            saved, trained, settings = load_split(checkpoint_path, data, model, world, *layout)
        else:  # (its parameters are read once what the rank will hold is priced)
            saved, trained = load_shapes(checkpoint_path, data, model)
            settings = trained.settings
        info, net = trained.dataset, trained.model
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
            raise UsageError(f"--eval-samples {samples!r}: give a number of samples, 0 (all) or more")
        info = datasets.limit_evaluation(info, int(samples), splits=("test",))
        if rank == 0:
            for note in trained.notes:
                print(f"mpidist: {note}", flush=True)
        share, shares = split_model.data_share(rank, ranks, stages, tensor) if split else (rank, ranks)
        rows = len(range(share, info.sizes["test"], shares))
        reading = datasets.plan(trained.settings, info, [("test", rows)], net.input_shape, net.dtype)
        price = evaluation_price(
            settings if split else None, (rank, ranks), net, info, reading.nbytes, min(rows, EVALUATION_BATCH)
        )
        price.check(f"evaluating {net.num_params:,} parameters")
        if not split:
            read_parameters(saved, trained)
        test = reading.open(info, "test", share, shares, net.input_shape, net.dtype)
    with ends_the_job_on_error(world):
        prices = gathered(world, price)
        if rank == 0:
            print(said(prices), flush=True)
        cluster = build_cluster(world)
        batches = datasets.eval_batches(test)
        if rank == 0:  # (an evaluation past a few seconds says how far it got)
            batches = shown(batches, len(test), "test", lambda line: print(line, flush=True))
        if split:
            strategy = split_model.split_strategy(settings, net, info, cluster)
            figures = split_model.evaluate(strategy, saved, batches, world)
            strategy.free()
        else:  # (evaluation exchanges no gradients: no shared-memory window for them)
            strategy = AllreduceStrategy(
                net, loss_for(info.num_classes, net.xp), None, cluster, exchange="mpi"
            )
            figures = strategy.evaluate(batches)
        cluster.free()
    return {
        **scores.report(figures, getattr(info, "class_names", None)),
        "samples": figures["samples"],
        "step": trained.step,
        "model": trained.spec,
        "dataset": info.name,
        "checkpoint": str(trained.path),
    }
