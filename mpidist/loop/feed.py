"""The batches one rank trains on in one epoch: its shard's, the chief's scattered (in-graph), or none (a ps)."""

import itertools

from .. import data
from ..parallel.recipe import total_steps
from ..parallel.scatter import ScatteredBatches
from .setup import data_layout


class NoData:
    """The batches of a rank that reads no data: ``steps - skip`` empty ones."""

    def __init__(self, steps, skip):
        self._items = itertools.repeat((None, None), steps - skip)

    def __iter__(self):
        return self._items

    def close(self):
        pass


def epoch_batches(config, cluster, setup, epoch, skip):
    """This rank's batches of ``epoch`` from step ``skip`` on (each has ``close()``)."""
    if config.replication == "in-graph" and cluster.worker_index is not None:
        source = None
        if cluster.is_chief:
            source = data.global_batches(setup.train, config.batch_size, setup.steps_per_epoch, config.seed,
                                         epoch, skip=skip)
        y_shape, y_dtype = ((), "int64") if setup.info.num_classes else ((setup.info.target_width,),
                                                                            setup.model.dtype)
        return ScatteredBatches(cluster.workers, source, config.batch_size, setup.model.input_shape,
                                y_shape, setup.model.dtype, y_dtype, setup.steps_per_epoch - skip)
    if setup.train is None:
        return NoData(setup.steps_per_epoch, skip)
    # the run ends in this epoch: a stream need not read the next one's first window
    last_epoch = (epoch + 1) * setup.steps_per_epoch >= total_steps(config, setup)
    return data.train_batches(setup.train, setup.local_batch, setup.steps_per_epoch, config.seed, epoch,
                              data_layout(config, cluster)[1], skip=skip, last_epoch=last_epoch)
