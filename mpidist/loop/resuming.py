"""A run resumed from a checkpoint: which checkpoint, what the run takes from it, what the user is told.

The set-up (:mod:`mpidist.loop.setup`) finds the checkpoint ``--resume``
names, fits it to the model this run builds (the same number of parameters;
the optimizer state only of the same optimizer) and notes what differs from
the run it came from: another recipe (the schedule goes on as the new
settings give it), another ``--batch-size`` mid-epoch (other lanes), a
checkpoint written in another data order (an earlier version's: another
epoch order, other rows held out), a dataset whose content changed.  The
run then goes on with the checkpoint's seed and data order
(:func:`continued`).  Local: no collectives.
"""

import dataclasses
import os

from ..data.fingerprint import mismatch
from ..runtime.errors import UsageError
from ..runtime.text import printable
from ..store import checkpoint, checkpoint_save, rundir
from . import sharded_save


def find_resume(config):
    """``(checkpoint --resume names or None, [(path, reason) of unreadable newer ones skipped])``: checked,
    its arrays not read yet (each rank reads what it will hold:
    :meth:`~mpidist.store.checkpoint.Checkpoint.whole`, or its slices by
    :meth:`~mpidist.store.checkpoint.Checkpoint.restore`)."""
    if not config.resume:
        return None, []
    if config.resume == "auto":
        return checkpoint.newest_valid(config.checkpoint_dir, arrays=False)  # empty directory: start afresh
    if os.path.isdir(config.resume):  # (its newest loadable checkpoint, as evaluate and predict read one)
        return checkpoint.newest_loadable(
            rundir.checkpoints_in(config.resume),
            f"--resume {config.resume}: a directory that holds no checkpoint to resume from",
        )
    return checkpoint.load(config.resume, arrays=False), []


def fit_to_model(config, resume, info, model):
    """``(resume, notes)``: checkpoint ``resume`` (or None) as this run starts from it, for ``model`` built
    for dataset ``info``; refused where its number of parameters differs, its optimizer state dropped (the
    parameters and the position kept, and the user told) where it holds another optimizer's."""
    if resume is not None and resume.num_params != model.num_params:
        raise UsageError(
            f"--resume {resume.path}: holds {resume.num_params} parameters, but --model "
            f"{config.model} on {info.name!r} has {model.num_params} (it was written by --model "
            f"{printable(resume.config.get('model'))} on {printable(repr(resume.config.get('data')))})"
        )
    if resume is not None:
        where = f"--model {config.model} on {info.name!r}"
        named = [(name, shape) for name, shape, _ in sharded_save.parameters(model)]
        checkpoint.refuse_another_model(resume, named, where)
    if resume is not None and set(resume.optimizer_state) != set(
        checkpoint_save.OPTIMIZER_STATE[config.optimizer]
    ):
        kept = ", ".join(map(printable, sorted(resume.optimizer_state))) or "none"
        note = (
            f"note: --optimizer {config.optimizer} starts with fresh state: {resume.path} holds "
            f"another optimizer's ({kept}); the parameters and the position are resumed"
        )
        return dataclasses.replace(resume, optimizer_state={}, optimizer_steps=0), [note]
    return resume, []


def resume_notes(config, resume, info, cluster):
    """What the user is told of a resumed run that differs from the one checkpoint ``resume`` (or None) was
    written by: its recipe (:func:`recipe_changes`), and, on the chief, a dataset whose content changed."""
    if resume is None:
        return []
    notes = recipe_changes(config, resume) + order_changes(config, resume)
    changed = (
        mismatch(resume.dataset_fingerprint, resume.config.get("data"), info) if cluster.is_chief else None
    )
    if changed is not None:  # (--data is given to a resumed run: it goes on, and the user is told)
        notes.append(f"warning: --resume {resume.path}: {changed}; training goes on with it")
    return notes


#: Settings that shape the learning rate of every step: a resumed run that changes them changes its schedule.
RECIPE = (
    "lr",
    "lr_schedule",
    "lr_gamma",
    "lr_step_epochs",
    "lr_min",
    "warmup_epochs",
    "warmup_steps",
    "warmup_from",
    "epochs",
    "steps",
    "batch_size",
    "weight_decay",
    "clip_norm",
    "accumulate",
    "val_fraction",
)


def continued(config, setup):
    """``config`` as the run goes on with it: a resumed run's random streams as its checkpoint left them (its
    seed), and the shuffle buffer of the data order (``setup.reading``'s), which its checkpoints record."""
    kept = dict(
        seed=setup.resume.seed if setup.resume is not None else config.seed,
        shuffle_buffer=setup.reading.buffer if setup.reading is not None else config.shuffle_buffer,
    )
    return (
        dataclasses.replace(config, **kept)
        if any(getattr(config, k) != v for k, v in kept.items())
        else config
    )


def resumed_buffer(resume):
    """The shuffle buffer of the data order ``resume`` (a checkpoint, or None) was written in; 0 where it
    records none (older checkpoints, whose order was another) or one that is not a count of samples."""
    value = resume.config.get("shuffle_buffer") if resume is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**62 else 0


def recipe_changes(config, resume):
    """Notes for a resumed run whose recipe differs from the one its checkpoint was written with.

    A schedule is a function of the step and these settings alone: with the
    same ones a resumed run continues exactly; with others it continues on a
    new schedule from the checkpoint's step, which the user should know.
    Another ``--batch-size`` also cuts the data into other lanes
    (:mod:`mpidist.data.lanes`): mid-epoch, the epoch is not the same set of
    samples once.
    """
    changed = [
        f"--{name.replace('_', '-')} {printable(repr(resume.config[name]))} -> {getattr(config, name)!r}"
        for name in RECIPE
        if name in resume.config and resume.config[name] != getattr(config, name)
    ]
    if not changed:
        return []
    notes = [
        f"note: resumed with another recipe than {resume.path} was written with ({', '.join(changed)}): "
        "the schedule continues as the new settings give it from this step"
    ]
    before = resume.config.get("batch_size", config.batch_size)
    if before != config.batch_size and resume.epoch_step:
        notes.append(
            f"note: --batch-size {config.batch_size} cuts the training split into {config.batch_size} "
            f"lanes, not {printable(repr(before))}: epoch {resume.epoch + 1} goes on from step "
            f"{resume.epoch_step} of the new lanes' orders, so some of its samples may come twice or not at "
            "all; every later epoch trains on each sample once"
        )
    return notes


def order_changes(config, resume):
    """Notes for a run resumed from checkpoint ``resume`` written in another data order than this mpidist's
    (:data:`~mpidist.store.checkpoint_save.DATA_ORDER`: an earlier version's, whose units followed the
    files' chunks and whose ``--val-fraction`` drew other rows): mid-epoch, its position is a step of that
    order, and the rest of the epoch is taken in this one; the rows held out are drawn this version's way."""
    if resume.data_order == checkpoint_save.DATA_ORDER:
        return []
    notes = []
    if resume.epoch_step:
        notes.append(
            f"note: {resume.path} was written in another data order than this mpidist's (an earlier "
            f"version's): epoch {resume.epoch + 1} goes on from step {resume.epoch_step} in this one's, so "
            "some of its samples may come twice or not at all; every later epoch trains on each sample once"
        )
    if config.val_fraction and resume.config.get("val_fraction"):
        notes.append(
            f"note: --val-fraction holds out other rows than the run that wrote {resume.path} did (an "
            "earlier version drew them otherwise): some rows it trained on are now validation rows, so the "
            "validation figures are not comparable with its own (start a new run for an honest split)"
        )
    return notes
