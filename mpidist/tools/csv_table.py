"""CSV files read for ``ingest``: the delimiter and the header detected, every cell checked, labels or class
names.

A CSV file holds one sample per row.  Its cells are cut at ``,``, ``;``,
tabs or runs of whitespace (``--delimiter``, or detected from the first
:data:`SNIFFED` lines: the cut giving the most numbers); the first row is a
header, and skipped, when it has text above a column of numbers (the only row,
when it has text outside the label column, or nothing but text).  Every cell
but the label column's must be a finite number within float32; the label
column holds numbers, or class names in every row.  A refusal names the row
(its line in the file), the column and the cell.
"""

import dataclasses

import re

import numpy as np

from ..runtime.errors import UsageError
from ..runtime.lines import bounded_lines
from ..runtime.text import printable
from .csv_cells import SNIFFED, cells_of, detect_delimiter, has_header, is_number, unquoted
from .dataset_file import FLOAT32_MAX, MAX_NAME
from .labels import checked_names, infer_task, split_train_test

#: ``--delimiter`` values and the delimiter each means (None: runs of whitespace)
DELIMITERS = {"auto": "auto", ",": ",", ";": ";", "tab": "\t", "\t": "\t", "whitespace": None}
SHOWN = {",": "','", ";": "';'", "\t": "tab", None: "whitespace"}


#: what a spreadsheet takes a cell beginning with for a formula (OWASP, "CSV Injection"): ``=``, ``+``, ``-``,
#: ``@``, and a tab or carriage return, which some strip before looking at the next character
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
#: a plain decimal number, signed: a spreadsheet reads it as that number, not as a formula
PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def spreadsheet_safe(cell):
    """``cell`` (text written into a CSV file mpidist makes) as a spreadsheet shows it and never runs it.

    A class name such as ``=HYPERLINK(...)`` or ``@SUM(A1)`` comes from a user's data, and a spreadsheet that
    opens the file would evaluate it: a text cell that begins like a formula is prefixed with a single quote,
    as the OWASP guidance says (the quote is visible in a text editor, and marks the cell as text in a
    spreadsheet).  A plain number (``-1.5``, ``+2e-3``) is left as it is: a spreadsheet reads it as the number
    it is, which is what it means, and never as a formula.
    """
    text = str(cell)
    if text.startswith(FORMULA_STARTS) and not PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


def mixed(path, label, cell, line_no):
    return (
        f"{path}: the label column (column {label + 1}) mixes numbers and class names "
        f"({printable(repr(unquoted(cell)), 60)} in row {line_no}); give every label as a number or every "
        "label as a name"
    )


def column_words(column, titles=None):
    """File column ``column`` (1-based) in the user's words: by its header's name where it has one, and
    counted as a data frame counts it where the file's first column is pandas' unnamed index."""
    name = titles[column - 1] if titles and column <= len(titles) else ""
    if not name or _unnamed(name):
        return f"column {column}"
    indexed = _unnamed(titles[0]) and not any(map(_unnamed, titles[1:]))
    shown = printable(repr(name), 60)
    if indexed:
        return f"column {shown} (column {column - 1} after pandas' index, {column} of the file)"
    return f"column {shown} (column {column})"


def first_bad_cell(path, rows, split=None, label=None, named=False, command="ingest", titles=None):
    """Why ``np.loadtxt`` refused ``rows``: one line naming the row (line in the file) and column.

    ``label``: the label column (0-based); ``named``: it holds class names, not read here; ``command``: the
    command reading them, which the line says needs numbers; ``titles``: the header's names, where it has
    one (:func:`column_words`).
    """
    split = split or cells_of(",")
    width = len(split(rows[0][1]))
    for line_no, line in rows:
        cells = split(line)
        if len(cells) != width:
            return f"{path}: row {line_no} has {len(cells)} columns but row {rows[0][0]} has {width}"
        for column, cell in enumerate(cells, 1):
            if named and column - 1 == label:
                continue
            if not cell.strip():
                return (
                    f"{path}: row {line_no}, {column_words(column, titles)} is empty (NaN); {command} needs "
                    "finite numbers"
                )
            if not is_number(cell):
                if column - 1 == label:
                    return mixed(path, label, cell, line_no)
                return (
                    f"{path}: {column_words(column, titles)} holds text ({printable(repr(cell.strip()), 60)} "
                    f"in row {line_no}); "
                    f"{command} needs numbers in every row after the header (text only in the label column)"
                )
    return None


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a command needs of a CSV file, in the words its refusals use."""

    command: str  # its name, as a refusal says what it needs: "ingest needs finite numbers"
    rows: int  # rows of data
    why: str  # why that many, as the refusal of fewer ends
    label: bool  # a label column of 2 or more classes (or of numbers) besides the features


#: ingest cuts the rows into a train and a test split, and takes the labels from their column
INGEST = Needs("ingest", 2, "a train and a test split need at least 2", True)
#: predict takes samples, one or more, and leaves out their label column where they have one
PREDICT = Needs("predict", 1, "predict needs at least 1", False)


@dataclasses.dataclass
class Table:
    """A CSV file read: the feature columns, the labels, and how the file was cut."""

    x: np.ndarray  # float64, the columns other than the label column, in file order
    y: np.ndarray  # the label column: float64 numbers, or int64 classes where it holds names
    label: int  # the label column, 0-based
    delimiter: object  # ',', ';', '\t' or None (whitespace)
    detected: bool  # the delimiter was detected (not given)
    header_line: int = None  # the line skipped as column names
    class_names: tuple = None  # where the label column holds names: class i is class_names[i]
    index_note: str = None  # what was done with a first column of row numbers (an index?), or None
    index_dropped: bool = False  # that column was dropped (the header leaves it unnamed), not kept
    names: tuple = None  # the header's names of the columns of x (None: no header)
    label_name: str = None  # the header's name of the label column


def read_csv(path, label_column=-1, delimiter="auto", needs=INGEST):
    """The :class:`Table` of ``path``, refused with the row (line in the file) and column of any bad cell.

    The delimiter is detected (``delimiter="auto"``) among ``,``, ``;``, tab and
    whitespace from the first lines; the first row is a header when it has text
    above a column of numbers.  Every cell but the label column's must be a
    number; the label column holds numbers, or class names in every row.
    ``needs``: what the command reading it needs of it (:data:`INGEST`, :data:`PREDICT`).
    """
    try:  # (a line at a time, each bounded: one line of a gigabyte is refused before it is held)
        # (numbered as str.splitlines numbers the whole)
        lines = [
            piece
            for _, line in bounded_lines(path, str(path), encoding="utf-8-sig", errors="strict")
            for piece in line.splitlines() or [""]
        ]
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: not a readable text file ({err})") from None
    rows = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    detected = delimiter == "auto"
    delimiter = detect_delimiter([line for _, line in rows[:SNIFFED]]) if detected else DELIMITERS[delimiter]
    split = cells_of(delimiter)
    header = rows[:1] if rows and has_header(rows, split, label_column) else []
    rows = rows[len(header) :]
    if len(rows) < needs.rows:
        found = (
            "the file is empty"
            if not lines
            else f"{len(rows)} row{'s' * (len(rows) != 1)} of data"
            + (f" after the header (line {header[0][0]})" if header else "")
        )
        raise UsageError(f"{path}: {found}; {needs.why}")
    width = len(split(rows[0][1]))
    if width < 2 and needs.label:
        raise UsageError(
            f"{path}: has 1 column; it needs at least one feature column and a label column (cut at "
            f"{SHOWN[delimiter]}, {'detected' if detected else 'given'}: see --delimiter)"
        )
    if not -width <= label_column < width:
        raise UsageError(
            f"--label-column {label_column}: {path} has {width} columns (0 to {width - 1}, or -{width} to -1)"
        )
    label = label_column % width
    if header and len(split(header[0][1])) != width:
        raise UsageError(
            f"{path}: the header has {len(split(header[0][1]))} columns but the rows have {width}"
        )
    # names in the label column's first rows: the column holds class names (all of it, checked)
    named = any(
        label < len(cells) and cells[label].strip() and not is_number(cells[label])
        for cells in map(split, (line for _, line in rows[:SNIFFED]))
    )
    y, class_names = read_names(path, rows, split, width, label, needs.label) if named else (None, None)
    columns = [column for column in range(width) if column != label] if named else list(range(width))
    try:
        # (usecols lets longer rows pass)
        table = np.loadtxt(
            # (a line with quotes as its cells without them: "1", "2" has a blank before its quote)
            [(delimiter or " ").join(split(line)) if '"' in line else line for _, line in rows],
            delimiter=delimiter,
            ndmin=2,
            comments=None,
            usecols=columns if named else None,
        )
    except ValueError as err:
        titles = [unquoted(cell) for cell in split(header[0][1])] if header else None
        raise UsageError(
            first_bad_cell(path, rows, split, label, named, needs.command, titles)
            or f"{path}: not a table of numbers ({printable(err)})"
        ) from None
    magnitude = np.abs(np.nan_to_num(table, nan=0.0, posinf=np.inf, neginf=np.inf))
    for bad, why in (
        (~np.isfinite(table), f"{needs.command} needs finite numbers"),
        (magnitude > FLOAT32_MAX, f"beyond float32 (max {FLOAT32_MAX:.3g}); scale the data"),
    ):
        if bad.any():  # the largest bad value: Inf before NaN, the largest magnitude beyond float32
            r, c = np.unravel_index(np.argmax(np.where(bad, magnitude, -1)), table.shape)
            value = "NaN" if np.isnan(table[r, c]) else "Inf" if np.isinf(table[r, c]) else "too large"
            raise UsageError(
                f"{path}: row {rows[r][0]}, column {columns[c] + 1} is {value} "
                f"({split(rows[r][1])[columns[c]].strip()!r}); {why}"
            )
    if not named:
        y, table = table[:, label], np.delete(table, label, axis=1)
    titles = [unquoted(cell) for cell in split(header[0][1])] if header else None
    names = tuple(title for column, title in enumerate(titles) if column != label) if titles else None
    index_note, index_dropped = None, False
    first = names[0] if names else None
    if (
        label != 0
        and table.shape[1] > 1
        and first is not None
        and _unnamed(first)
        and not any(map(_unnamed, names[1:]))
    ):
        # a first column the header leaves unnamed above named ones: the index pandas' to_csv writes, whatever
        # rows it numbers (a subset's are not 0, 1, 2, ...): a feature would be named as the others are
        index_note = (
            f"column 1 ({f'{first!r}' if first else 'unnamed'}) dropped: an index (the header names "
            "every other column)"
        )
        table, names, index_dropped = table[:, 1:], names[1:], True
    elif label != 0 and table.shape[1] > 1 and _row_numbers(table[:, 0]):
        numbers = f"the row numbers {int(table[0, 0])} to {int(table[-1, 0])}"
        index_note = (
            f"column 1{f' ({printable(repr(first), 40)})' if first else ''} holds {numbers}; kept as a "
            "feature (if it is an index, it carries nothing to learn: remove it from the file)"
        )
    return Table(
        x=table,
        y=y,
        label=label,
        delimiter=delimiter,
        detected=detected,
        header_line=header[0][0] if header else None,
        class_names=class_names,
        index_note=index_note,
        index_dropped=index_dropped,
        names=names,
        label_name=titles[label] if titles else None,
    )


def _storable(names):
    """A header's feature names where ``predict`` can match columns by them (each given, once, of a bounded
    length), else None."""
    if not names or len(set(names)) != len(names) or any(_unnamed(n) or len(n) > MAX_NAME for n in names):
        return None
    return tuple(names)


def _unnamed(title):
    """Whether a header cell names no column: empty, or pandas' ``Unnamed: N``."""
    return not title or re.fullmatch(r"Unnamed: \d+", title) is not None


def _row_numbers(column):
    """Whether ``column`` is 0, 1, 2, ... or 1, 2, 3, ...: the row numbers an index column holds."""
    start = column[0]
    return start in (0, 1) and np.array_equal(column, np.arange(start, start + len(column)))


def read_names(path, rows, split, width, label, checked=True):
    """``(classes, names)`` of a label column of class names: the sorted distinct names are classes 0 to
    K-1.

    ``checked``: refused where training would refuse them (one class, too many, a name too long); ``predict``
    leaves the column out, so the labels of a few rows may well be one class.
    """
    codes, seen = np.empty(len(rows), np.int64), {}
    for row, (line_no, line) in enumerate(rows):
        cells = split(line)
        if len(cells) != width:
            raise UsageError(
                f"{path}: row {line_no} has {len(cells)} columns but row {rows[0][0]} has {width}"
            )
        name = unquoted(cells[label])
        if not name:
            raise UsageError(
                f"{path}: row {line_no}, column {label + 1} is empty; the label column holds class "
                "names, and every row needs one"
            )
        if is_number(name):
            raise UsageError(mixed(path, label, name, line_no))
        codes[row] = seen.setdefault(name, len(seen))
    names = tuple(sorted(seen))
    if checked:
        _, names = checked_names(path, f"the label column (column {label + 1})", names)
    order = {name: index for index, name in enumerate(names)}
    return np.array([order[name] for name in seen], np.int64)[codes], names


def from_csv(path, label_column, test_fraction, seed, task, delimiter="auto"):
    """One sample per row; ``(splits, num_classes, facts)``: the class names, the delimiter, the header
    line."""
    table = read_csv(path, label_column, delimiter)
    key = f"the label column (column {table.label + 1})"
    if table.class_names is not None:
        if task == "regression":
            raise UsageError(
                f"{path}: {key} holds text (class names such as "
                f"{printable(repr(table.class_names[0]), 60)}); --task regression needs numbers"
            )
        y, num_classes = table.y, len(table.class_names)
    else:
        y, num_classes = infer_task(table.y, task, path, key)
    facts = {
        "class_names": table.class_names,
        "delimiter": SHOWN[table.delimiter],
        "delimiter_detected": table.detected,
        "header_line": table.header_line,
        "index_note": table.index_note,
        "feature_names": _storable(table.names),
    }
    return split_train_test(table.x.astype(np.float32), y, test_fraction, seed), num_classes, facts
