"""What ``predict`` will hold on a rank beside an evaluation's price: its rows read a part at a time, the
outputs it keeps, and on rank 0 what the whole split's predictions take to gather, score and write."""

import numpy as np

from ..loop.inference_pricing import evaluation_price

SOFTMAX_ARRAYS = 3  # a chunk's exponentials, their sums and the probabilities (predictions.softmax)
CSV_BYTES = 32  # a value formatted for a CSV file, as the list of rows holds it


def prediction_price(settings, where, model, reader, rows, sizes, output):
    """The :class:`~mpidist.runtime.price.Price` of ``predict`` on a rank: ``where`` its ``(rank, size)``,
    ``settings`` the split's (None: the whole model), ``reader`` the samples', ``rows`` its replica's,
    ``sizes`` ``(rows read at once, rows a pass takes, rows a softmax takes)``, ``output`` the path written
    (None: none)."""
    rank = where[0]
    part, batch, chunk = sizes
    item = model.dtype.itemsize
    width = int(np.prod(model.output_shape, dtype=np.int64))
    values = int(np.prod(reader.info.sample_shape))
    targets = 8 * max(1, reader.info.target_width)
    kept = 2 * rows * (width * item + targets)  # (a part's outputs and targets, then all of them joined)
    if reader.info.num_classes == 0:  # (a regression's figures: its errors in float64, and their squares)
        kept += 4 * rows * width * 8
    if rank == 0:  # (every rank's outputs gathered, their probabilities and classes, and the file's content)
        samples = reader.samples
        softmax = SOFTMAX_ARRAYS * min(chunk, samples) * width * 8
        kept += samples * width * (item + 4) + samples * 16 + softmax
        if output is not None and str(output).endswith(".csv"):
            kept += samples * (width + 2) * CSV_BYTES
        elif output is not None:
            kept += samples * width * item
    read = 2 * min(rows, part) * 8 * values  # (as stored, and converted)
    return evaluation_price(
        settings,
        where,
        model,
        reader.info,
        read,
        min(batch, max(1, rows)),
        kept,
        gradients=settings is not None,
    )
