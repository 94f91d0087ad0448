"""What ``eval`` and ``predict`` will hold on a rank, priced before the model's parameters are read.

As :mod:`mpidist.loop.pricing` prices training: what the process holds
already, the model (its part, where the layout splits it), its samples, an
evaluation batch's arrays (:mod:`mpidist.loop.rehearsed`), the outputs it
keeps, its threads, and MPI's copy of the activations a split layout sends.
"""

import types

from ..parallel import holding
from ..runtime.memory import thread_bytes
from ..runtime.price import Price
from . import split_model
from .rehearsed import rank_arrays

_WHOLE = types.SimpleNamespace(strategy="allreduce", tensor=1)  # (a whole model on every rank: no split)


def evaluation_price(settings, where, model, info, data, batch, kept=0, gradients=True):
    """The :class:`~mpidist.runtime.price.Price` of evaluating (or predicting with) ``model`` (a map of
    shapes) on rank ``where[0]`` of ``where[1]``: whole on every rank (``settings`` None), or split as
    ``settings`` (a layout's: :func:`~mpidist.loop.split_model.layout_settings`) split it; ``info`` its
    dataset's, ``data`` the bytes of its samples, ``batch`` the samples a pass takes, ``kept`` the outputs it
    keeps; ``gradients``: a strategy runs the passes, with the gradient buffer it makes beside the model
    (``predict`` runs a whole model's forward itself)."""
    rank, size = where
    if settings is None:
        whole = model.num_params
        share, settings = holding.Held(whole, 0, 0, grads=None if gradients else 0), _WHOLE
    else:
        share = holding.held(settings, split_model.Ranks(rank, size), model, 0)
    rehearsed = rank_arrays(settings, rank, size, model, info, 0, batch)
    price = Price()  # (what the process holds is read now: after the rehearsal loaded what the layers use)
    price.add("the model", holding.held_bytes(share, 0, model.dtype.itemsize))
    price.add("samples", data)
    price.add("a batch's arrays", rehearsed.evaluation)
    price.add("outputs kept", kept)
    price.add("threads' stacks", 2 * thread_bytes())  # (a stream's reader, the end's agreement)
    if settings is not _WHOLE and size > 1:  # (a tensor group's sums, a stage's sends: MPICH copies them)
        price.add("MPI's buffers", rehearsed.activations)
    return price
