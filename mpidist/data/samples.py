"""What every read sample goes through: checks, standardisation, conversion to the model's dtype.

The same function serves a shard read whole into memory and the blocks a
stream reads as it goes, so both refuse the same data with the same message,
naming the file, the split and the row.
"""

import numpy as np

from ..runtime.errors import UsageError


def prepare(x, y, info, where, rows, input_shape, dtype):
    """``(x, y)`` read from ``where`` (``"file.h5: train"``), checked and converted for training.

    ``rows`` are the file's row numbers of ``x`` (for messages).  Samples come
    back standardised where the dataset has statistics, as ``dtype``, shaped
    ``(n,) + input_shape``; class labels as int64 of shape ``(n,)`` (``(n, L)``
    for labels per position), regression targets as ``dtype`` of shape ``(n, width)``.
    """
    if x.dtype.kind == "f" and not _all_finite(x):
        raise UsageError(f"{where}/x holds NaN or Inf (first at sample {rows[_first_bad_row(x)]})")
    if info.num_classes > 0:
        out = (y < 0) | (y >= info.num_classes)
        if out.any():
            bad = np.unravel_index(int(np.flatnonzero(out)[0]), y.shape)
            position = f" position {int(bad[1])}" if len(bad) > 1 else ""
            raise UsageError(
                f"{where}/y has label {int(y[bad])} at sample {rows[bad[0]]}{position}, "
                f"outside [0, {info.num_classes}) (num_classes = {info.num_classes})"
            )
        y = y.astype(np.int64).reshape((len(y),) + info.target_shape)
    else:
        if y.dtype.kind == "f" and not np.isfinite(y).all():
            raise UsageError(f"{where}/y holds NaN or Inf")
        y = converted(y, dtype, f"{where}/y").reshape(len(y), -1)
    transform = standardizer(info)
    if transform is not None:  # checked again: statistics that do not fit the data can give Inf
        x = transform(x)
        if not _all_finite(x):
            raise UsageError(
                f"{where}/x standardised with the file's stats/mean and stats/std holds Inf "
                f"(first at sample {rows[_first_bad_row(x)]}): the statistics do not fit the data"
            )
    x = converted(x, dtype, f"{where}/x" + (" (standardised)" if transform else ""))
    return x.reshape((len(x),) + tuple(input_shape)), y


def _all_finite(x):
    """Whether ``x`` holds no NaN or Inf: its sum first (one pass, no temporary), element by element if that
    is not."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(x.sum()):  # NaN and Inf make the sum non-finite; finite values rarely do (overflow)
            return True
    return bool(np.isfinite(x).all())


def _first_bad_row(x):
    return int(np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))[0])


def footprint(rows, info, group, dtype):
    """Bytes reading ``rows`` samples of ``group`` into memory takes at its peak: as stored, converted,
    targets, and a compressed chunk larger than HDF5's cache decompressed (its x and y, and the compressed one
    read)."""
    sample = int(np.prod(info.sample_shape))
    stored = max((m.row_bytes.get(group, 0) for m in info.files), default=sample * 8)
    cache = max((m.cache_bytes(group) for m in info.files), default=0)
    targets = 8 * (info.target_width + 1)
    return (
        rows
        * (stored + sample * np.dtype(dtype).itemsize + (8 * sample if standardizer(info) else 0) + targets)
        + cache
    )


def standardizer(info):
    """What reading does to the samples of dataset ``info`` besides checking them, or None.

    For a file with standardisation statistics: a function of samples (any shape
    holding the sample's number of values per row) giving ``(x - mean) / std``
    in float64, shaped as given.
    """
    if getattr(info, "mean", None) is None:
        return None
    mean, std = info.mean.reshape(-1), info.std.reshape(-1)

    def standardize(x):
        x = np.asarray(x)
        with np.errstate(over="ignore", invalid="ignore"):  # an Inf made here is refused by the caller
            out = x.reshape(len(x), mean.size) - mean  # float64, as mean is
            out /= std
        return out.reshape(x.shape)

    return standardize


def converted(array, dtype, where):
    """``array`` as ``dtype``, refused if finite values overflow it (1e300 is Inf in float32)."""
    with np.errstate(over="ignore"):  # (refused in words below, not by numpy's warning)
        result = array.astype(dtype, copy=False)
    if result is not array and not np.isfinite(result).all():
        largest = float(np.max(np.abs(array)))
        raise UsageError(
            f"{where} holds values up to {largest:.3g}, beyond the range of --dtype {dtype} "
            "(they would become Inf): scale the data, or train with --dtype float64"
        )
    return result
