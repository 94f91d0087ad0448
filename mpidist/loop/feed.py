"""The batches one rank trains on in one epoch: its piece of the epoch's virtual shards, the chief's scattered
(in-graph), or none (a ps); and what is left of the epoch (a checkpoint's data position)."""

import itertools

from ..data import virtual
from ..parallel.recipe import total_steps
from ..parallel.scatter import ScatteredBatches
from .setup import training_layout


class NoData:
    """The batches of a rank that reads no data: ``steps - skip`` empty ones."""

    def __init__(self, steps, skip):
        self._items = itertools.repeat((None, None), steps - skip)

    def __iter__(self):
        return self._items

    def close(self):
        pass


def entered(setup, epoch, segment):
    """``(remaining, its step)``: what was left of ``epoch`` where this run entered it (``segment``, a
    :class:`~mpidist.loop.position.Position`'s), or the whole epoch at step 0."""
    if segment is not None and segment[0] == epoch:
        return segment[2], segment[1]
    return virtual.whole(setup.train.shard_sizes), 0


def epoch_batches(config, cluster, setup, epoch, skip, segment=None):
    """This rank's batches of ``epoch`` from step ``skip`` on (each has ``close()``).

    ``segment``: the position's (:class:`~mpidist.loop.position.Position`); this rank's piece of the epoch is
    its part of what was left there, cut for the workers now (:func:`mpidist.data.virtual.split`).
    """
    if config.replication == "in-graph" and cluster.worker_index is not None:
        source = None
        if cluster.is_chief:
            remaining, at = entered(setup, epoch, segment)
            source = setup.train.batches(config.batch_size, virtual.split(remaining, [config.batch_size])[0],
                                         config.seed, epoch, skip=skip - at)
        y_shape, y_dtype = ((), "int64") if setup.info.num_classes else ((setup.info.target_width,),
                                                                            setup.model.dtype)
        return ScatteredBatches(cluster.workers, source, config.batch_size, setup.model.input_shape,
                                y_shape, setup.model.dtype, y_dtype, setup.steps_per_epoch - skip)
    if setup.train is None:
        return NoData(setup.steps_per_epoch, skip)
    # the run ends in this epoch: a stream need not read the next one's first window
    last_epoch = (epoch + 1) * setup.steps_per_epoch >= total_steps(config, setup)
    sizes, index = training_layout(config, cluster)
    remaining, at = entered(setup, epoch, segment)
    return setup.train.batches(sizes[index], virtual.split(remaining, sizes)[index], config.seed, epoch,
                               skip=skip - at, last_epoch=last_epoch)


def data_position(config, cluster, setup, position):
    """``(remaining, shard sizes)`` of ``position``'s epoch, as a checkpoint stores it; None on a rank without
    the training data (only the chief's is written)."""
    if setup.train is None:
        return None
    remaining, at = entered(setup, position.epoch, position.segment)
    return virtual.advance(remaining, training_layout(config, cluster)[0], position.epoch_step - at), \
        setup.train.shard_sizes
