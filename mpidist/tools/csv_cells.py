"""A CSV file's lines as cells: the delimiter that cuts them, each cell's quotes dropped, numbers told from
text, and whether the first row is a header (:mod:`mpidist.tools.csv_table` reads the file with them)."""

#: first lines of a CSV file the delimiter and the header are judged from
SNIFFED = 20


def is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def cells_of(delimiter):
    """A function cutting one line into its cells at ``delimiter`` (None: at runs of whitespace), each
    without the double quotes around it (``csv.QUOTE_ALL`` quotes every number)."""
    cut = str.split if delimiter is None else lambda line: line.split(delimiter)
    # (a cell at a time only in a line that holds a quote: most hold none, and are cut by str.split alone)
    return lambda line: [unquoted(cell) for cell in cut(line)] if '"' in line else cut(line)


def detect_delimiter(lines):
    """Of ',', ';', tab and whitespace, the one cutting ``lines`` into the most numbers.

    Ties go to the one that cuts every line (but the first, maybe a header)
    into as many cells, then to the first in that order; one that leaves every
    line whole is never chosen.  ``','`` when none cuts (the error then says
    the file has 1 column).
    """
    best, found = None, ","
    for rank, delimiter in enumerate((",", ";", "\t", None)):
        cut = [cells_of(delimiter)(line) for line in lines]
        widths = {len(cells) for cells in cut[1:] or cut}
        if max(widths, default=0) < 2:
            continue
        score = (sum(is_number(cell) for cells in cut for cell in cells), len(widths) == 1, -rank)
        if best is None or score > best:
            best, found = score, delimiter
    return found


def has_header(rows, split, label_column=-1):
    """Whether the first row names the columns.

    It does where it has text above a column of numbers, and at least half
    its cells are text (a row of data with one mistyped cell is data, refused
    at that cell, not a header that would drop the row without a word); or
    where its cells count the columns, ``0, 1, 2 ...`` or ``1, 2, 3 ...``
    (pandas' names of unnamed columns: ``to_csv(index=False)``).  The only
    row of a file (``predict`` reads a file of one sample) is a header where
    it holds text outside the label column, or nothing but text: a row of
    data holds text in the label column alone (a class name) beside its features.
    """
    below = [split(line) for _, line in rows[1:SNIFFED]]
    cells = split(rows[0][1])
    text = [bool(cell.strip()) and not is_number(cell) for cell in cells]
    if not below:
        label = label_column % len(cells) if -len(cells) <= label_column < len(cells) else None
        return all(text) or any(is_text for column, is_text in enumerate(text) if column != label)
    if counts_columns(cells) and not any(counts_columns(row, start=None) for row in below):
        return True  # (rows below that count too, 1,2,3 above 4,5,6: data with a pattern, not names)
    filled = sum(1 for cell in cells if cell.strip())
    above_numbers = any(
        is_text and all(is_number(row[column]) for row in below if column < len(row) and row[column].strip())
        for column, is_text in enumerate(text)
    )
    return above_numbers and 2 * sum(text) >= filled


def counts_columns(cells, start=(0, 1)):
    """Whether ``cells`` (two or more) are integers one apart, from one of ``start`` (None: any)."""
    try:
        numbers = [float(unquoted(cell)) for cell in cells]
    except ValueError:
        return False
    if len(numbers) < 2 or (start is not None and numbers[0] not in start):
        return False
    return numbers == [numbers[0] + step for step in range(len(numbers))]


def unquoted(cell):
    """A cell's text without surrounding blanks and double quotes."""
    cell = cell.strip()
    if len(cell) >= 2 and cell[0] == cell[-1] == '"':
        cell = cell[1:-1].replace('""', '"').strip()
    return cell
