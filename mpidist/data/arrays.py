"""Training data given as numpy arrays in memory, read through the same path as an HDF5 file.

Every rank passes the *same* arrays (the whole dataset, as Keras' ``fit``
takes it); mpidist then gives each worker its own strided shard, exactly as
it does for a file, so a run on arrays trains like the same run on the file
``ingest`` would write from them.  The arrays are copied once into an HDF5
image in memory, so the layout checks (shapes, dtypes, label range, NaN) and
the shard reading are the file's, tested once for both.
"""

import io
import numbers

import h5py
import numpy as np

from ..runtime.errors import UsageError


class ArrayData:
    """A dataset from arrays: ``ArrayData(train=(x, y), test=(x, y))``.

    Args:
        train: ``(x, y)``: samples first; ``y`` integer class labels, or float
            regression targets ``(N,)`` or ``(N, K)``.
        test: ``(x, y)`` held out for evaluation, shaped as ``train``.
        num_classes: classes of a classification task; ``0`` for regression;
            ``None`` (default): ``max(y) + 1`` over both splits when ``y`` is
            integer, else regression.
        name: the dataset's name in the logs and metrics.
    """

    def __init__(self, train, test, num_classes=None, name="arrays"):
        splits = {"train": _pair(train, "train"), "test": _pair(test, "test")}
        if num_classes is None:
            labels = [y for _, y in splits.values()]
            integer = all(y.dtype.kind in "biu" for y in labels)
            num_classes = int(max(int(y.max(initial=0)) for y in labels)) + 1 if integer else 0
        self.name, self.num_classes = str(name), _classes(num_classes)
        self.image = io.BytesIO()
        with h5py.File(self.image, "w") as handle:
            handle.attrs.update(name=self.name, num_classes=self.num_classes, source="numpy arrays in memory")
            for split, (x, y) in splits.items():
                handle.create_dataset(f"{split}/x", data=x)
                handle.create_dataset(f"{split}/y", data=y)

    def open(self):
        """The in-memory HDF5 image, open for reading."""
        self.image.seek(0)
        return h5py.File(self.image, "r")

    @property
    def stem(self):
        return self.name

    def __str__(self):
        return f"<arrays: {self.name}>"


def _pair(split, name):
    try:
        x, y = split
    except (TypeError, ValueError):
        raise UsageError(
            f"ArrayData {name}= takes a pair (x, y) of arrays, got {type(split).__name__}"
        ) from None
    try:
        x, y = np.asarray(x), np.asarray(y)
    except ValueError as err:  # (ragged lists: numpy refuses them as one array)
        raise UsageError(f"ArrayData {name}= takes arrays of one shape each: {err}") from None
    for what, array in (("x", x), ("y", y)):
        if array.dtype.kind not in "biuf":  # (strings, objects, ragged lists: nothing a model reads)
            raise UsageError(
                f"ArrayData {name}= {what} must be numbers (integers or floats), got an array of "
                f"{array.dtype}"
            )
    return x, y


def _classes(num_classes):
    """``num_classes`` as an int: a whole number, 0 or more (2.7 was taken as 2)."""
    whole = isinstance(num_classes, numbers.Integral) or (
        isinstance(num_classes, numbers.Real) and float(num_classes).is_integer()
    )
    if isinstance(num_classes, bool) or not whole or num_classes < 0:
        raise UsageError(
            f"ArrayData num_classes= is a whole number of classes (0 for regression), got {num_classes!r}"
        )
    return int(num_classes)
