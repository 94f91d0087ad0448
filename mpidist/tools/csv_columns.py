"""Which columns of a CSV file ``predict`` reads are the model's features, and what it says of the others.

A file of samples holds the model's features, and may hold a label column
after them (as the file ``ingest`` read did) and pandas' index before them
(``to_csv`` writes one unless told ``index=False``; with its header, the
index's name is empty, and :func:`mpidist.tools.csv_table.read_csv` drops it).
The columns are taken:

* by name, where the file has a header and the dataset the model trained on
  stores its features' names (``ingest`` of a CSV with a header): in the
  model's order, whatever the file's; a feature the file lacks, a name it
  gives twice, or a column besides the features and a last one (the label's)
  is refused, named;
* else by count, in the file's order.  As many columns as the model has
  features are the features.  One more: the features and a label column, or
  (in a file without a header) pandas' index and the features.  The first
  column could be an index where it holds distinct whole numbers from 0, the
  last could be a label where it holds a class of the model in every row (any
  number, for a regression); where one reading is left, it is taken, and where
  both are, the file is refused: nothing in it tells which.  Two more, in a
  file without a header: the index, the features and the label, where the
  first could be an index and the last a label.  Any other count is refused,
  with the counts.

A column left out is named in a note (rank 0 prints it): columns are never
shifted or dropped silently.  :func:`choose` is the decision; it reads only the
values it is given.
"""

import dataclasses

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.suggest import nearest
from ..runtime.text import printable

SHOWN_NAMES = 5  # names a refusal lists


@dataclasses.dataclass(frozen=True)
class Columns:
    """What :func:`choose` decided: the columns of the model's features, in its order, and the notes."""

    features: list  # column numbers (0-based) among the file's columns of numbers
    notes: tuple = ()


@dataclasses.dataclass(frozen=True)
class Model:
    """What the model takes: its features (and their stored names, or None), its classes (0: regression),
    and how a message names the dataset it trained on."""

    features: int
    names: tuple = None
    classes: int = 0
    dataset: str = "the dataset it trained on"


def choose(where, values, model, names=None, labelled=False):
    """The :class:`Columns` of a CSV file's columns of numbers that are the model's features.

    Args:
        where: the file, as messages name it.
        values: ``(rows, columns)``: the file's columns of numbers, in its order (a label column of class
            names is not among them).
        model: the :class:`Model` the samples are for.
        names: the header's names of those columns, or None where the file has no header.
        labelled: a label column of class names followed them (left out already).
    """
    if names is not None and model.names is not None:
        return _by_name(where, names, model.names, labelled)
    return _by_count(where, values, model, names, labelled)


def could_be_index(column):
    """Whether ``column`` could be pandas' index: distinct whole numbers from 0 (a subset's, shuffled
    or not, are not 0, 1, 2, ...)."""
    whole = np.all(column >= 0) and np.all(column == np.floor(column))
    return bool(whole) and len(np.unique(column)) == len(column)


def could_be_label(column, classes):
    """Whether ``column`` could be the labels of a model of ``classes`` classes (0: any number, a
    regression's)."""
    return classes == 0 or bool(np.all((column >= 0) & (column < classes) & (column == np.floor(column))))


def _by_count(where, values, model, names, labelled):
    count, wanted = values.shape[1], model.features
    index = names is None and count > 1 and could_be_index(values[:, 0])  # (a header leaves it unnamed)
    label = not labelled and count > 1 and could_be_label(values[:, -1], model.classes)
    first, last = (_column(0, values, names), _column(count - 1, values, names)) if count else (None, None)
    if count == wanted:
        return Columns(list(range(count)))
    if count == wanted + 1 and label and not index:
        return Columns(list(range(count - 1)), (f"{where}: {last} left out as the label column",))
    if count == wanted + 1 and index and not label:
        return Columns(list(range(1, count)), (f"{where}: {first} left out as pandas' index",))
    if count == wanted + 2 and index and label:
        return Columns(
            list(range(1, count - 1)),
            (f"{where}: {first} left out as pandas' index, and {last} as the label column",),
        )
    found = f"{where}: {count} column{'s' * (count != 1)} of numbers" + (
        " and a label column of class names" if labelled else ""
    )
    if count == wanted + 1 and index and label:
        raise UsageError(
            f"{found}, one more than the model's {wanted} features, and no header to tell which is extra: "
            f"{last} could be a label column after them, and {first} pandas' index before them; write the "
            "file without the index (to_csv(index=False)), without the label column, or with its header"
        )
    readings = "the features in the model's order" + (
        "" if labelled else ", a label column after them or not"
    )
    if names is None:
        readings += ", and pandas' index before them or not"
    why_not = []
    if count - wanted in (1, 2):  # (the columns too many are not an index and a label)
        if not index:
            why_not.append(f"{first} is no index (distinct whole numbers from 0)")
        if not label and not labelled:
            why_not.append(f"{last} is no label (classes 0 to {model.classes - 1})")
    raise UsageError(
        f"{found}, but the model takes {wanted} features (as in {model.dataset}): predict reads {readings}"
        + (f"; {', and '.join(why_not)}" if why_not else "")
    )


def _column(number, values, names):
    """Column ``number`` (0-based) in words: its place, its name in the header, and its values' range."""
    column = values[:, number]
    low, high = float(column.min()), float(column.max())
    held = f"{low:g}" if low == high else f"{low:g} to {high:g}"
    return f"column {number + 1} ({printable(repr(names[number]), 40) + ': ' if names else ''}{held})"


def _by_name(where, names, stored, labelled):
    """The columns the model's ``stored`` names name, in its order; refused where they do not match."""
    seen, repeated = {}, []
    for number, name in enumerate(names):
        if name in seen and name not in repeated:
            repeated.append(name)
        seen.setdefault(name, number)
    wanted = set(stored)
    besides = names if labelled else names[:-1]  # (a last column besides the features: the label's)
    missing = [name for name in stored if name not in seen]
    for what, found in (
        ("names columns twice", repeated),
        ("lacks the model's features", missing),
        ("has columns the model does not take", [name for name in besides if name not in wanted]),
    ):
        if found:
            raise UsageError(
                f"{where}: {what}, by the names ingest stored: {_names(found)}{_near_in(missing, names)} "
                f"({len(stored)} features named {_names(stored, 3)}); give the columns the training data "
                "had, with their header"
            )
    notes = ()
    if not labelled and names[-1] not in wanted:
        notes = (
            f"{where}: column {len(names)} ({printable(repr(names[-1]), 40)}) left out as the label column",
        )
    return Columns([seen[name] for name in stored], notes)


def _near_in(missing, names):
    """The header's names nearest the features it lacks (another case, a typo): ``" (the header has
    'Proline')"``, or nothing."""
    pairs = [(name, nearest(name, [other for other in names if other not in missing])) for name in missing]
    near = [(name, found[0]) for name, found in pairs if found]
    if not near:
        return ""
    shown = ", ".join(
        f"{printable(repr(found), 40)} for {printable(repr(name), 40)}" for name, found in near[:SHOWN_NAMES]
    )
    return f" (the header has {shown})"


def _names(names, shown=SHOWN_NAMES):
    """Up to ``shown`` names, quoted and made printable, for a message."""
    return ", ".join(printable(repr(name), 40) for name in names[:shown]) + (
        ", ..." if len(names) > shown else ""
    )
