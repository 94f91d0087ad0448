"""The batches one rank trains on in one epoch: its piece of the epoch's virtual shards, the chief's scattered
(in-graph), or none (a ps); and what is left of the epoch (a checkpoint's data position)."""

import itertools
import os
from pathlib import Path

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


class Recorded:
    """``batches``, each one's first input values written to ``path`` as it is handed over (tests only)."""

    def __init__(self, batches, path, epoch):
        self.batches, self.path, self.epoch = batches, path, epoch

    def __iter__(self):
        for x, y in self.batches:
            if x is not None:
                with open(self.path, "a") as out:
                    out.write(f"{self.epoch} {' '.join(str(int(v)) for v in x.reshape(len(x), -1)[:, 0])}\n")
            yield x, y

    def close(self):
        self.batches.close()


def recorded(batches, worker, epoch):
    """``batches``, recorded where ``MPIDIST_TEST_RECORD=DIRECTORY`` says (``worker-<pid>.txt``: a line per batch,
    its epoch and its samples' first values).  For tests only: a dataset whose first value is the row number
    shows which samples each epoch trained on; unset in real runs."""
    folder = os.environ.get("MPIDIST_TEST_RECORD", "")
    if not folder or worker is None:
        return batches
    return Recorded(batches, Path(folder) / f"worker-{os.getpid()}.txt", epoch)


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
    return recorded(setup.train.batches(sizes[index], virtual.split(remaining, sizes)[index], config.seed, epoch,
                                        skip=skip - at, last_epoch=last_epoch), index, epoch)


def data_position(config, cluster, setup, position):
    """``(remaining, shard sizes)`` of ``position``'s epoch, as a checkpoint stores it; None on a rank without
    the training data (only the chief's is written)."""
    if setup.train is None:
        return None
    remaining, at = entered(setup, position.epoch, position.segment)
    return virtual.advance(remaining, training_layout(config, cluster)[0], position.epoch_step - at), \
        setup.train.shard_sizes
