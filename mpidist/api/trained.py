"""A checkpoint's model built again: :func:`load_trained`, the one way a checkpoint becomes a model.

:func:`~mpidist.api.evaluate`, :func:`mpidist.predict` and scripts all load a
checkpoint through it, so each is checked alike: the file, its stored
settings (as if given anew: a file is untrusted), the model it names, the
dataset it is built for (refused, or a warning, where it changed since the
checkpoint was written) and the number of parameters.  Local: no collectives.
"""

import dataclasses
import os
from pathlib import Path

from .. import data as datasets  # (``data`` is the argument users know)
from ..data.fingerprint import mismatch
from ..loop.setup import Inputs, build_model_for
from ..loop import sharded_save
from ..runtime.errors import UsageError
from ..runtime.memory import check_fits
from ..runtime.text import printable
from ..runtime.xp import select_device
from ..settings.config import Settings
from ..store import checkpoint
from ..store.checkpoint import refuse_another_model


@dataclasses.dataclass
class Trained:
    """What :func:`load_trained` returns: a checkpoint's model, holding its parameters, and where it came
    from.

    Attributes:
        model: an :class:`~mpidist.nn.Sequential` built for ``dataset`` on the device the
            checkpoint's settings name, holding the checkpoint's parameters
            (``trained.model.forward(x)`` predicts).
        dataset: the :class:`~mpidist.data.DatasetInfo` the model was built for.
        settings: the :class:`~mpidist.settings.config.Settings` the checkpoint stores, checked.
        spec: the model's spec (``"mlp"``, ``"mlp:256,256"``, ...).
        step: the checkpoint's step.
        path: the checkpoint file (a directory's newest, where a directory was given).
        notes: warnings for the user (a dataset given that changed since the checkpoint was written, newer
            checkpoints of a directory passed over as unreadable).
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
    checkpoint holds.  Local: no collectives (:func:`~mpidist.api.evaluate` and
    :func:`mpidist.predict` call it on every rank, inside an agreement).

    Args:
        checkpoint_path: a checkpoint file (``ckpt-*.h5``), or a checkpoint directory: its newest
            loadable checkpoint, as ``--resume auto`` picks it.
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
    saved, trained = load_shapes(checkpoint_path, data, model, data_given)
    net = trained.model
    check_fits(
        net.num_params * net.dtype.itemsize, f"the model of {checkpoint_path} ({net.num_params:,} parameters)"
    )
    read_parameters(saved, trained)
    return trained


def load_shapes(checkpoint_path, data=None, model=None, data_given=None):
    """:func:`load_trained`'s first half: ``(checkpoint, trained)``, the checkpoint checked but its arrays
    not read, and its :class:`Trained` whose model is a map of shapes (a caller prices what it will hold
    before :func:`read_parameters`)."""
    saved, passed_over = opened(checkpoint_path)
    return saved, _trained(saved, data, model, data_given, passed_over)


def opened(checkpoint_path):
    """``(checkpoint, notes)``: the checkpoint file ``checkpoint_path`` names, checked, its arrays not read;
    a directory names its newest loadable checkpoint, as ``--resume auto`` picks it (the newest of the
    lineage written last), with a note for each newer one passed over as unreadable."""
    if not isinstance(checkpoint_path, (str, os.PathLike)):
        raise UsageError(
            "checkpoint_path: a checkpoint file (ckpt-*.h5) or a checkpoint directory, as a path, "
            f"not {type(checkpoint_path).__name__}"
        )
    if not Path(checkpoint_path).is_dir():
        return checkpoint.load(checkpoint_path, arrays=False), []
    saved, skipped = checkpoint.newest_loadable(
        checkpoint_path, f"{checkpoint_path}: a directory that holds no checkpoint to read"
    )
    return saved, [
        f"warning: skipped unreadable checkpoint {Path(path).name}: {reason}" for path, reason in skipped
    ]


def read_parameters(saved, trained):
    """:func:`load_trained`'s second half: the checkpoint's parameters alone (no optimizer state), every part
    checked, read straight into ``trained``'s model's buffer."""
    from ..nn.placement import Placement

    net = trained.model
    saved.check_parts((0, 1)).restore(Placement.of_entries(net, 0, len(net.entries)), {"params": net.params})


def load_split(checkpoint_path, data, model, world, stages, tensor, shard="none", data_given=None):
    """:func:`load_trained` for a model split over the ranks of ``world`` as training splits it (``stages`` x
    ``tensor``, each part sharded over the replicas with ``shard`` "parameters"; see
    :mod:`mpidist.loop.split_model`): ``(checkpoint, trained, settings)``: the checkpoint, its
    arrays not read (each rank reads its slices once its part exists), its :class:`Trained` (a map of shapes),
    and the layout's settings, checked for the ranks and for what this rank may hold.  Local."""
    from ..loop import split_model

    saved, passed_over = opened(checkpoint_path)
    trained = _trained(saved, data, model, data_given, passed_over)
    ranks = world.Get_size()
    settings = split_model.layout_settings(trained.settings, ranks, stages, tensor, trained.model, shard)
    split_model.check_holds(settings, world.Get_rank(), ranks, trained.model)
    return saved, trained, settings


def _trained(saved, data, model, data_given=None, notes=()):
    """:func:`load_trained`'s :class:`Trained` of checkpoint ``saved`` (its arrays need not be read), its
    model a map of shapes with no buffers yet, checked to have the checkpoint's number of parameters;
    ``notes``: what the user is told already."""
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
    notes = list(notes)
    changed = mismatch(saved.dataset_fingerprint, config.data, info)
    if changed is not None and not given:
        raise UsageError(f"{checkpoint_path}: {changed}; name it with --data to use it all the same")
    if changed is not None:
        notes.append(f"warning: {checkpoint_path}: {changed}")
    # (what a rank holds is priced by the caller)
    net = build_model_for(config, inputs, info, xp, training=False)
    if net.num_params != saved.num_params:
        raise UsageError(
            f"{checkpoint_path}: holds {saved.num_params} parameters, but model "
            f"{inputs.model.spec} on {info.name!r} has {net.num_params}"
        )
    named = [(name, shape) for name, shape, _ in sharded_save.parameters(net)]
    refuse_another_model(saved, named, f"model {inputs.model.spec} on {info.name!r}")
    return Trained(
        model=net,
        dataset=info,
        settings=config,
        spec=inputs.model.spec,
        step=saved.step,
        path=Path(saved.path),
        notes=notes,
    )


def _stored_settings(saved):
    """The settings a checkpoint stores, checked as if given anew (a file is untrusted); unknown keys
    dropped."""
    from ..settings.config import FIELDS
    from ..settings.sources import typed

    try:
        config = Settings(
            **typed({k: v for k, v in saved.config.items() if k in FIELDS}, f"{saved.path}: config")
        )
        config.validate_values()
    except UsageError as err:
        raise UsageError(f"{saved.path}: its stored settings are not valid ({printable(err)})") from None
    # (a --precision run's checkpoint holds its float32 master: evaluated and used as it was trained to be)
    return dataclasses.replace(config, precision="float32")
