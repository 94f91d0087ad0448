"""Which columns of a CSV file ``predict`` takes as the model's features (issue 61, item 7): the decision, by
literal tables of files and models."""

import re

import numpy as np
import pytest

from mpidist.runtime.errors import UsageError
from mpidist.tools.csv_columns import Model, choose

FEATURES = [[0.5, -1.25, 2.0], [1.5, 0.75, -3.0], [2.5, 0.25, 4.5], [-0.5, 1.0, 0.125]]  # 4 rows, 3 features
ROWS = len(FEATURES)
CLASSES = Model(3, classes=3, dataset="'toy', the dataset it trained on")
REGRESSION = Model(3, classes=0)
NAMED = Model(3, names=("a", "b\u00a0c", "d"), classes=3)


def table(*columns):
    """The file's columns of numbers: ``"x"`` for the features, anything else a column of its own."""
    parts = [
        np.array(FEATURES) if column == "x" else np.array(column, float).reshape(ROWS, 1)
        for column in columns
    ]
    return np.hstack(parts)


INDEX = [0, 1, 2, 3]  # pandas' index of a frame of its own
FROM_ONE = [1, 2, 3, 4]
SUBSET = [100, 101, 102, 103]  # df.iloc[100:]
SHUFFLED = [7, 2, 11, 0]  # df.sample(frac=1)
LABELS = [2, 0, 1, 1]  # classes of CLASSES
VALUES = [0.25, -1.5, 3.0, 7.75]  # no label of CLASSES: a feature, or a regression's target
FLOATS = [0.5, 1.5, 2.25, 3.0]  # no index
FIRST, SECOND = ([row[k] for row in FEATURES] for k in (0, 1))


@pytest.mark.parametrize(
    "model,columns,taken,note",
    [
        # as many columns as features: the features, whatever they hold
        (CLASSES, ["x"], [0, 1, 2], None),
        (REGRESSION, ["x"], [0, 1, 2], None),
        # one more, no index: the features, then the label column
        (CLASSES, ["x", LABELS], [0, 1, 2], "column 4 (0 to 2) left out as the label column"),
        (REGRESSION, ["x", VALUES], [0, 1, 2], "column 4 (-1.5 to 7.75) left out as the label column"),
        # one more, no label after them: pandas' index before the features (issue 61, item 7:
        # df.to_csv(header=False) of the features; the index was read as the first feature and the last
        # feature dropped)
        (CLASSES, [INDEX, "x"], [1, 2, 3], "column 1 (0 to 3) left out as pandas' index"),
        (CLASSES, [FROM_ONE, "x"], [1, 2, 3], "column 1 (1 to 4) left out as pandas' index"),
        (CLASSES, [SUBSET, "x"], [1, 2, 3], "column 1 (100 to 103) left out as pandas' index"),
        (CLASSES, [SHUFFLED, "x"], [1, 2, 3], "column 1 (0 to 11) left out as pandas' index"),
        # two more: the index, the features and the label (df.to_csv(header=False) of the whole frame)
        (
            CLASSES,
            [INDEX, "x", LABELS],
            [1, 2, 3],
            "column 1 (0 to 3) left out as pandas' index, and column 5 (0 to 2) as the label column",
        ),
        (
            REGRESSION,
            [SHUFFLED, "x", VALUES],
            [1, 2, 3],
            "column 1 (0 to 11) left out as pandas' index, and column 5 (-1.5 to 7.75) as the label column",
        ),
    ],
)
def test_a_file_without_a_header_is_read_where_one_reading_is_left_and_says_what_it_left_out(
    model, columns, taken, note
):
    chosen = choose("f.csv", table(*columns), model)
    assert chosen.features == taken
    assert chosen.notes == ((f"f.csv: {note}",) if note else ())


@pytest.mark.parametrize(
    "model,columns,message",
    [
        # one more, and it could be either: refused, naming both readings and what to do
        (
            CLASSES,
            [INDEX, FIRST, SECOND, LABELS],
            re.escape(
                "4 columns of numbers, one more than the model's 3 features, and no header to tell which is "
                "extra: column 4 (0 to 2) could be a label column after them, and column 1 (0 to 3) pandas' "
                "index before them; write the file without the index (to_csv(index=False)), without the "
                "label column, or with its header"
            ),
        ),
        (REGRESSION, [INDEX, "x"], "one more than the model's 3 features, and no header to tell which"),
        (
            REGRESSION,
            [SUBSET, "x"],
            r"column 4 \(-3 to 4.5\) could be a label column after them, and column 1",
        ),
        # too many, and neither an index nor a label
        (
            CLASSES,
            [FLOATS, "x"],
            re.escape(
                "4 columns of numbers, but the model takes 3 features (as in 'toy', the dataset it trained "
                "on): predict reads the features in the model's order, a label column after them or not, and "
                "pandas' index before them or not; column 1 (0.5 to 3) is no index (distinct whole numbers "
                "from 0), and column 4 (-3 to 4.5) is no label (classes 0 to 2)"
            ),
        ),
        (CLASSES, [[0, 1, 1, 2], "x"], r"column 1 \(0 to 2\) is no index"),  # (repeated: no index)
        (CLASSES, [[-1, 0, 1, 2], "x"], r"column 1 \(-1 to 2\) is no index"),
        (CLASSES, ["x", [0, 1, 2, 3]], r"column 4 \(0 to 3\) is no label \(classes 0 to 2\)"),
        (
            CLASSES,
            [INDEX, "x", VALUES],
            r"5 columns of numbers, but .* column 5 \(-1.5 to 7.75\) is no label",
        ),
        (CLASSES, [FLOATS, "x", LABELS], r"5 columns of numbers, but .* column 1 \(0.5 to 3\) is no index"),
        (CLASSES, [INDEX, INDEX, "x", LABELS], "6 columns of numbers, but the model takes 3 features"),
        # too few: refused with the counts (the columns were taken in order, the last as a label)
        (
            CLASSES,
            [FIRST, SECOND],
            r"2 columns of numbers, but the model takes 3 features \(as in 'toy'",
        ),
        (REGRESSION, [INDEX], "1 column of numbers, but the model takes 3 features"),
    ],
)
def test_a_file_without_a_header_is_refused_with_the_counts_where_none_or_two_readings_are_left(
    model, columns, message
):
    with pytest.raises(UsageError, match=f"f.csv: .*{message}"):
        choose("f.csv", table(*columns), model)


def test_a_label_column_of_class_names_leaves_only_an_index_to_guess():
    labelled = dict(labelled=True)
    assert choose("f.csv", table("x"), CLASSES, **labelled).features == [0, 1, 2]
    chosen = choose("f.csv", table(INDEX, "x"), CLASSES, **labelled)
    assert chosen.features == [1, 2, 3] and chosen.notes == (
        "f.csv: column 1 (0 to 3) left out as pandas' index",
    )
    with pytest.raises(
        UsageError, match=r"4 columns of numbers and a label column of class names, but the model"
    ):
        choose("f.csv", table(FLOATS, "x"), CLASSES, **labelled)
    with pytest.raises(UsageError, match="0 columns of numbers and a label column of class names"):
        choose("f.csv", np.zeros((ROWS, 0)), CLASSES, **labelled)


def test_a_header_names_every_column_it_keeps_so_no_index_is_guessed_in_a_file_with_one():
    """(pandas' index has no name in its header, and read_csv drops it: a named first column is a feature)"""
    names = ("p", "q", "r", "label")
    chosen = choose("f.csv", table("x", LABELS), CLASSES, names=names)
    assert chosen.features == [0, 1, 2]
    assert chosen.notes == ("f.csv: column 4 ('label': 0 to 2) left out as the label column",)
    with pytest.raises(UsageError, match="4 columns of numbers, but the model takes 3 features") as caught:
        choose("f.csv", table(INDEX, "x"), CLASSES, names=("id", "p", "q", "r"))
    assert "pandas' index before them" not in str(caught.value)


@pytest.mark.parametrize(
    "names,taken,note",
    [
        (("a", "b\u00a0c", "d"), [0, 1, 2], None),
        (("d", "a", "b\u00a0c"), [1, 2, 0], None),  # another order: by name
        (("a", "b\u00a0c", "d", "label"), [0, 1, 2], "column 4 ('label') left out as the label column"),
        (("b\u00a0c", "d", "a", "y"), [2, 0, 1], "column 4 ('y') left out as the label column"),
    ],
)
def test_a_header_is_matched_by_the_names_ingest_stored(names, taken, note):
    chosen = choose("f.csv", np.zeros((ROWS, len(names))), NAMED, names=names)
    assert chosen.features == taken and chosen.notes == ((f"f.csv: {note}",) if note else ())


@pytest.mark.parametrize(
    "names,message",
    [
        (
            ("a", "b c", "d"),
            r"lacks the model's features, by the names ingest stored: 'b\\xa0c' \(the header has 'b c' for "
            r"'b\\xa0c'\) \(3 features",
        ),
        (  # (issue 63, item 8: another case, named beside the one it stands for)
            ("A", "b\u00a0c", "d"),
            r"lacks the model's features, by the names ingest stored: 'a' \(the header has 'A' for 'a'\) "
            r"\(3 ",
        ),
        (("x", "b\u00a0c", "d"), r"lacks the model's features, by the names ingest stored: 'a' \(3 features"),
        (
            ("a", "id", "b\u00a0c", "d"),
            "has columns the model does not take, by the names ingest stored: 'id'",
        ),
        (("a", "b\u00a0c", "d", "a"), "names columns twice, by the names ingest stored: 'a'"),
        (("a", "a", "b\u00a0c", "d", "label"), "names columns twice, by the names ingest stored: 'a'"),
    ],
)
def test_a_header_that_does_not_name_the_models_features_is_refused_named(names, message):
    with pytest.raises(UsageError, match=f"f.csv: {message}"):
        choose("f.csv", np.zeros((ROWS, len(names))), NAMED, names=names)


@pytest.mark.parametrize(
    "lines, header",
    [
        (["sepal,petal,kind", "1.5,2,0", "3,4.5,1"], True),
        (["abc,2.5,3.25,4", "1.5,2,3,4", "3,4.5,5,6"], False),  # (a mistyped cell in a row of data: refused)
        (["a,b,3,4", "1.5,2,3,4", "3,4.5,5,6"], True),  # (half its cells text: names, two of them numbers)
        (["0,1,2,3", "1.5,2,3,4", "3,4.5,5,6"], True),  # (pandas' names of unnamed columns)
        (["1,2,3", "4,5,6"], False),  # (counting rows below: data with a pattern)
        (["1.5,2,3,4", "3,4.5,5,6"], False),
    ],
)
def test_the_first_row_is_a_header_where_half_its_cells_are_names_or_it_counts_the_columns(lines, header):
    from mpidist.tools.csv_cells import cells_of, has_header

    assert has_header(list(enumerate(lines, 1)), cells_of(",")) == header


def test_predict_says_when_it_read_a_row_that_counts_the_columns_as_their_names(tmp_path):
    from mpidist.tools.prediction_inputs import CsvSamples

    (tmp_path / "n.csv").write_text("0,1,2\n1.5,2,3.25\n2.5,3,4.75\n")
    samples = CsvSamples(tmp_path / "n.csv")
    assert samples.count == 2
    assert any(
        "line 1 counts the columns (0, 1, 2 ...): read as their names" in note for note in samples.notes
    )
