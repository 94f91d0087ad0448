"""The batches one rank trains on in one epoch: its lanes', the chief's scattered (in-graph), or none (a
ps)."""

import itertools
import os
from pathlib import Path

from .. import data
from ..parallel.data.scatter import ScatteredBatches
from ..parallel.recipe import total_steps
from .setup import data_layout


class NoData:
    """The batches of a rank that reads no data: ``steps - skip`` empty ones."""

    def __init__(self, steps, skip):
        self._items = itertools.repeat((None, None), steps - skip)

    def __iter__(self):
        return self._items

    def close(self):
        pass


class Recorded:
    """``batches``, each one's samples' first values written to ``path`` as it is handed over (tests only)."""

    def __init__(self, batches, path, epoch, skip, workers):
        self.batches, self.path, self.head = batches, path, (epoch, skip, workers)

    def __iter__(self):
        epoch, skip, workers = self.head
        for step, (x, y) in enumerate(self.batches, start=skip):
            if x is not None:
                with open(self.path, "a") as out:
                    rows = " ".join(str(int(v)) for v in x.reshape(len(x), -1)[:, 0])
                    out.write(f"{epoch} {step} {workers} {rows}\n")
            yield x, y

    def close(self):
        self.batches.close()


def recorded(batches, epoch, skip, workers):
    """``batches``, recorded where ``MPIDIST_TEST_RECORD=DIRECTORY`` says (``worker-<pid>.txt``: a line per
    batch, its epoch, its step, the worker count and its samples' first values, in order).  For tests only: a
    dataset whose first value is the row number shows which samples each step of each epoch trained on; unset
    in real runs."""
    folder = os.environ.get("MPIDIST_TEST_RECORD", "")
    if not folder:
        return batches
    return Recorded(batches, Path(folder) / f"worker-{os.getpid()}.txt", epoch, skip, workers)


def epoch_batches(config, cluster, setup, epoch, skip):
    """This rank's batches of ``epoch`` from step ``skip`` on (each has ``close()``)."""
    # the run ends in this epoch: a stream need not read the next one's first windows
    last_epoch = (epoch + 1) * setup.steps_per_epoch >= total_steps(config, setup)
    if config.replication == "in-graph" and cluster.worker_index is not None:
        source = None
        if cluster.is_chief:
            source = data.global_batches(
                setup.train, setup.steps_per_epoch, config.seed, epoch, skip=skip, last_epoch=last_epoch
            )
        y_shape, y_dtype = setup.info.target_shape, "int64" if setup.info.num_classes else setup.model.dtype
        return recorded(
            ScatteredBatches(
                cluster.workers,
                source,
                config.batch_size,
                setup.model.input_shape,
                y_shape,
                setup.model.dtype,
                y_dtype,
                setup.steps_per_epoch - skip,
            ),
            epoch,
            skip,
            cluster.num_workers,
        )
    if setup.train is None:
        return NoData(setup.steps_per_epoch, skip)
    return recorded(
        data.train_batches(
            setup.train, setup.steps_per_epoch, config.seed, epoch, skip=skip, last_epoch=last_epoch
        ),
        epoch,
        skip,
        data_layout(config, cluster)[0],
    )
