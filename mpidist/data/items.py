"""A dataset file's items, each checked before it is used: where it lives, and the optional items' values.

Every item :func:`mpidist.data.layout.inspect` uses is first found here: it
must be an HDF5 dataset stored in this file (an external link, a soft link
through one, a virtual dataset or external storage reads another file,
refused unless ``--allow-external``), and a link that loops or dangles is
named, not followed.  The items a file may hold beside its splits
(standardisation statistics, class names, feature names) are checked here
too, their sizes before they are read (:mod:`mpidist.store.bounded`), then
value by value; the layout of the splits themselves (``x`` and ``y`` of
each) is :mod:`mpidist.data.layout`'s.
"""

import h5py
import numpy as np

from ..runtime.errors import UsageError
from ..runtime.text import printable
from ..store import bounded, contained

MAX_NAME = 200  # characters in a class name
NAME_BYTES = 4 * MAX_NAME  # (UTF-8 takes up to 4 bytes a character)


def _refusal(path):
    """``bad(item, problem)`` for dataset file ``path``: the :class:`UsageError` naming it."""
    return lambda item, problem: UsageError(f"{path}: {item} {problem}")


def present(handle, name):
    """Whether the file has a link ``name`` (a broken one counts: reading it names the problem)."""
    try:
        return handle.get(name, getlink=True) is not None
    except (KeyError, RuntimeError, OSError, ValueError, TypeError):
        return True


def checked_dataset(path, handle, name, allow_external):
    """The dataset ``name`` (``train/x``), checked to be one, and to live in this file unless allowed."""
    node, parts = handle, name.split("/")
    for depth, part in enumerate(parts):
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            raise UsageError(
                f"{path}: missing dataset '{name}' (the layout needs train/x, train/y, test/x, "
                "test/y; `python -m mpidist ingest` writes it)"
            )
        if isinstance(link, h5py.ExternalLink) and not allow_external:
            raise UsageError(
                f"{path}: '{'/'.join(parts[: depth + 1])}' is an external link to "
                f"{printable(link.filename)!r}: refused, as it reads another file "
                "(--allow-external follows such links)"
            )
        try:
            node = node[part]
        except (KeyError, RuntimeError, OSError, ValueError) as err:  # a soft link that loops or dangles
            raise UsageError(
                f"{path}: '{'/'.join(parts[: depth + 1])}' cannot be read ({printable(err)})"
            ) from None
    if not isinstance(node, h5py.Dataset):
        raise UsageError(
            f"{path}: '{name}' is not a dataset (the layout needs train/x, train/y, test/x, test/y)"
        )
    if allow_external:
        return node
    if contained.other_file(handle, node):  # (a soft link through an external link its name does not show)
        raise UsageError(
            f"{path}: '{name}' leads through its links to {printable(node.file.filename)!r}: "
            f"{contained.REFUSED} (--allow-external follows such links)"
        )
    problem = contained.elsewhere(node)
    if problem:
        raise UsageError(f"{path}: '{name}' {problem}: {contained.REFUSED} (--allow-external allows it)")
    return node


def statistics(path, handle, sample_shape, allow_external):
    """``(mean, std)``: float64 arrays of the sample shape, checked; ``(None, None)`` where the file has
    none."""
    if not present(handle, "stats"):
        return None, None
    found = []
    for key in ("mean", "std"):
        name = f"stats/{key}"
        if not present(handle, name):
            raise UsageError(
                f"{path}: has 'stats' but no dataset '{name}': standardisation statistics are "
                f"stats/mean and stats/std, both of the sample shape {tuple(sample_shape)}"
            )
        item = checked_dataset(path, handle, name, allow_external)
        if item.dtype.kind != "f":
            raise UsageError(
                f"{path}: {name} has dtype {item.dtype}; standardisation statistics must be floats"
            )
        if tuple(item.shape) != tuple(sample_shape):
            raise UsageError(
                f"{path}: {name} has shape {tuple(item.shape)}; it must be the sample shape "
                f"{tuple(sample_shape)}"
            )
        value = np.asarray(
            bounded.values(item, name, int(np.prod(sample_shape)) * item.dtype.itemsize, _refusal(path)),
            dtype=np.float64,
        )
        bad = ~np.isfinite(value) if key == "mean" else ~(np.isfinite(value) & (value > 0))
        if bad.any():
            index = np.unravel_index(int(np.flatnonzero(bad)[0]), value.shape)
            raise UsageError(
                f"{path}: {name}[{', '.join(map(str, index))}] is {value[index]}; "
                + (
                    "standardisation statistics must be finite"
                    if key == "mean"
                    else "standard deviations must be finite and greater than 0 (ingest stores 1 for a "
                    "constant feature)"
                )
            )
        found.append(value)
    return tuple(found)


def class_names(path, handle, num_classes, allow_external):
    """The ``class_names`` item as a tuple of printable strings, checked; None where the file has none."""
    if present(handle, "class_names") and num_classes == 0:
        raise UsageError(f"{path}: has class_names but num_classes = 0 (regression): names need classes")
    names = _names(path, handle, "class_names", num_classes, "class", allow_external)
    # (escaped once here: reports and predictions files show them, and a dataset's fingerprint, which
    # checkpoints record, is made of them as read)
    return None if names is None else tuple(printable(name) for name in names)


def feature_names(path, handle, sample_shape, allow_external):
    """The ``feature_names`` item (a CSV header's names of a sample's values), checked, as stored; None where
    there is none.

    ``predict`` compares them with the cells of a CSV file's header, so they are not escaped: a name holding
    a no-break or zero-width space would then match no cell.  Print them through :func:`printable`.
    """
    if present(handle, "feature_names") and len(sample_shape) != 1:
        raise UsageError(
            f"{path}: has feature_names but its samples have shape {sample_shape}: names are for "
            "samples of one axis"
        )
    return _names(
        path, handle, "feature_names", sample_shape[0] if sample_shape else 0, "feature", allow_external
    )


def _names(path, handle, key, count, what, allow_external):
    """Item ``key``: ``count`` distinct, non-empty, bounded UTF-8 names, as stored; None where absent."""
    if not present(handle, key):
        return None
    item = checked_dataset(path, handle, key, allow_external)
    if h5py.check_string_dtype(item.dtype) is None:
        raise UsageError(f"{path}: {key} has dtype {item.dtype}; it must hold text (UTF-8 strings)")
    if tuple(item.shape) != (count,):
        raise UsageError(
            f"{path}: {key} has shape {tuple(item.shape)}; it needs one name per {what}, shape ({count},)"
        )
    names, seen = [], {}
    for index, value in enumerate(bounded.texts(item, key, NAME_BYTES, _refusal(path))):
        try:
            name = value.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(
                f"{path}: {key} holds bytes that are not UTF-8 text (at index {index})"
            ) from None
        if not name.strip():
            raise UsageError(f"{path}: {key}[{index}] is empty; every {what} needs a name")
        if len(name) > MAX_NAME:
            raise UsageError(
                f"{path}: {key}[{index}] is {len(name):,} characters long; a {what} name has "
                f"at most {MAX_NAME}"
            )
        if name in seen:
            raise UsageError(
                f"{path}: {key}[{index}] repeats {key}[{seen[name]}] "
                f"({printable(repr(name))}); every {what} needs a name of its own"
            )
        seen[name] = index
        names.append(name)
    return tuple(names)
