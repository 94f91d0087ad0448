"""Write datasets in the mpidist HDF5 layout from common sources.

Sources: ``.npz`` files (read with ``allow_pickle=False``: a file never runs
code), ``.csv`` files, and the named sources the bundled datasets are built
from (``digits``, ``mnist1d``, ``mnist-5k``), and ``lee-text``, a text corpus
as a character-level language-modelling dataset (:mod:`mpidist.tools.text`).  Files are written aside and
renamed into place, so an interrupted ingest never leaves a half-written
dataset under the target name.

Ingest never writes a file ``train`` would refuse: bad input, or an output that
cannot be written, is a :class:`UsageError` naming the file, the item and the
value.  Float samples are stored as float32 (training's default dtype, and the
range it is checked against); integer samples are kept as they are.

Preparing raw files: labels given as text are class names (the sorted distinct
names are classes 0 to K-1, stored in ``class_names``); a CSV file's delimiter
and header row are detected (and reported); ``standardize`` stores the
per-feature mean and standard deviation of the training rows in ``stats/``,
which :class:`mpidist.data.Shard` applies when the data is read (``x`` is
stored as it was).  :func:`ingest` returns an :class:`Ingested`: the facts of
what it wrote, and its summary.

This module is the command; what it reads and writes is in modules of their
own: :mod:`~mpidist.tools.sources` (``.npz`` files, the named sources),
:mod:`~mpidist.tools.csv_table` (CSV files), :mod:`~mpidist.tools.labels`
(the train/test cut, classes and class names), :mod:`~mpidist.tools.dataset_file`
(the checks, and a single file written whole) and :mod:`mpidist.data.writer`
(directories of shards, synthetic data).
"""

import contextlib
import dataclasses
import os
from pathlib import Path

import numpy as np

from ..data import writer
from ..runtime.errors import UsageError
from ..runtime.text import check_utf8, printable
from ..store.kept import refuse_kept
from ..store.outputs import claimed
from .csv_table import DELIMITERS, from_csv
from .dataset_file import check_extras, check_splits, train_stats, write_dataset
from .labels import TEST_FRACTION, check_test_fraction
from .sources import SOURCES, TOKEN_SOURCES, build_source, from_npz

NAMES_SHOWN = 20  # class names listed in the summary


@dataclasses.dataclass
class Ingested:
    """What :func:`ingest` wrote: the facts its summary shows.  It is also the path (``os.fspath``).

    ``delimiter`` (``','``, ``';'``, ``tab`` or ``whitespace``), ``delimiter_detected``
    and ``header_line`` (the line skipped as column names, or None) are None/False
    for sources other than CSV files.
    """

    path: Path
    name: str
    source: str
    sizes: dict  # split -> samples
    sample_shape: tuple
    num_classes: int  # 0: regression
    target_width: int = 1
    class_names: tuple = None  # where the labels were text
    standardized: bool = False  # stats/mean and stats/std stored
    delimiter: str = None
    delimiter_detected: bool = False
    header_line: int = None
    index_note: str = None  # what was done with a CSV's first column of row numbers, or None
    feature_names: tuple = None  # a CSV header's names of the features, stored in the file

    def __fspath__(self):
        return os.fspath(self.path)

    def summary(self):
        """The lines ``python -m mpidist ingest`` prints."""
        held = f", {self.sizes['val']:,} val" if "val" in self.sizes else ""
        rows = [
            ("samples", f"{self.sizes['train']:,} train{held}, {self.sizes['test']:,} test"),
            ("features", f"{int(np.prod(self.sample_shape)):,} per sample, sample shape {self.sample_shape}"),
        ]
        if self.num_classes and self.class_names:
            more = len(self.class_names) - NAMES_SHOWN
            names = ", ".join(
                f"{i} {printable(name, 60)!r}" for i, name in enumerate(self.class_names[:NAMES_SHOWN])
            )
            rows.append(
                (
                    "classes",
                    f"{self.num_classes:,} named by the text labels: {names}"
                    + (f", ... ({more:,} more)" if more > 0 else ""),
                )
            )
        elif self.num_classes:
            rows.append(("classes", f"{self.num_classes:,} (labels 0 to {self.num_classes - 1})"))
        else:
            rows.append(
                ("task", f"regression, {self.target_width} target{'s' * (self.target_width != 1)} per sample")
            )
        if self.num_classes and self.target_width > 1:
            rows.append(("labels", f"{self.target_width} per sample, one per position"))
        if self.delimiter is not None:
            rows.append(
                ("delimiter", f"{self.delimiter} ({'detected' if self.delimiter_detected else 'given'})")
            )
            rows.append(
                (
                    "header",
                    f"line {self.header_line} skipped (column names)"
                    if self.header_line
                    else "none: the first line is data",
                )
            )
            if self.index_note:
                rows.append(("index", self.index_note))
        rows.append(
            (
                "standardised",
                "yes: stats/mean and stats/std of the training rows stored; train, eval and "
                "predict read (x - mean) / std"
                if self.standardized
                else "no",
            )
        )
        return "\n".join(
            [
                f"mpidist ingest: wrote {self.path} (dataset {printable(self.name)!r} from "
                f"{printable(self.source)})"
            ]
            + [f"  {key:<13} {value}" for key, value in rows]
        )


def check_options(test_fraction, seed=0, task="auto", delimiter="auto"):
    """Refuse options that would otherwise fail deep inside numpy."""
    if delimiter not in DELIMITERS:
        raise UsageError(
            f"--delimiter must be auto, ',', ';', tab or whitespace, got {printable(repr(delimiter))}"
        )
    check_test_fraction(test_fraction)
    if seed < 0:  # numpy's generators take no negative seeds
        raise UsageError(f"--seed must be 0 or more, got {seed}")
    if task not in ("auto", "classification", "regression"):
        raise UsageError(f"--task must be auto, classification or regression, got {task!r}")


def ingest(
    source,
    out,
    name=None,
    test_fraction=None,
    seed=0,
    task="auto",
    label_column=-1,
    standardize=False,
    delimiter="auto",
    shard_size=None,
    compression="gzip",
):
    """Write ``source`` (a named source, .npz or .csv path) to ``out``; returns an :class:`Ingested`.

    The result is path-like (``os.fspath`` gives ``out``) and carries what was
    written: samples per split, sample shape, classes and their names, and for
    a CSV file the delimiter and the header line.  ``standardize`` stores the
    per-feature mean and standard deviation of the training rows (after the
    split), which :class:`mpidist.data.Shard` applies when the data is read.
    ``delimiter``: ``auto`` (detected), ``,``, ``;``, ``tab`` or ``whitespace``.
    ``test_fraction``: the test split's share where the source has none
    (``None``: :data:`~mpidist.tools.labels.TEST_FRACTION`); refused where it has one.
    """
    named = source in SOURCES or str(source).startswith("synthetic")
    for value, what, path in (
        (source, "ingest SOURCE", not named),
        (out, "ingest OUTPUT", True),
        (name, "--name", False),
    ):
        check_utf8(value, what, absolute=path)
    fraction = TEST_FRACTION if test_fraction is None else test_fraction
    check_options(fraction, seed, task, delimiter)
    _refuse_what_the_source_ignores(source, named, task, label_column, delimiter, test_fraction is not None)
    if standardize and source in TOKEN_SOURCES:
        raise UsageError(
            f"ingest {source} --standardize: its samples are token ids (an Embedding's input), which "
            "standardising would turn into other numbers (negative and fractional ones); leave "
            "--standardize out"
        )
    writer.check_shard_size(shard_size)
    writer.filters(compression)
    refuse_kept(out, "ingest: the output", [source] if Path(source).is_file() else [])
    generated = writer.synthetic(source, fraction, seed, name)
    if generated is not None:
        return _write_generated(generated, source, out, shard_size, compression, standardize)
    path = Path(source)
    if source not in SOURCES:
        if not path.is_file():
            raise UsageError(
                f"ingest: {source!r} is neither a file nor a known source ({', '.join(SOURCES)})"
            )
        if path.suffix not in (".npz", ".csv"):
            raise UsageError(f"ingest: {source}: unsupported file type {path.suffix!r} (use .npz or .csv)")
    # (an unwritable output fails now, before the source is read)
    with claimed(out, "the dataset") if shard_size is None else contextlib.nullcontext():
        if source in SOURCES:
            splits, num_classes, text, facts = build_source(source, seed)
            name = name or source
        else:
            if path.suffix == ".npz":
                splits, num_classes, facts = from_npz(path, test_fraction, seed, task)
            else:
                splits, num_classes, facts = from_csv(path, label_column, fraction, seed, task, delimiter)
            text, name = f"ingested from {path.name}", name or path.stem
        (x, y), stats = splits["train"], None
        if standardize:
            check_splits(splits, num_classes, source)  # numbers of the layout, before they are summed
            stats = train_stats(x)
        if shard_size is None:
            written = write_dataset(
                out,
                name,
                splits,
                num_classes,
                text,
                where=source,
                check_values=True,
                stats=stats,
                class_names=facts.get("class_names"),
                compression=compression,
                feature_names=facts.get("feature_names"),
            )
        else:
            check_splits(splits, num_classes, source, True)
            check_extras(
                splits, num_classes, source, stats, facts.get("class_names"), facts.get("feature_names")
            )
            writer.write_shards(
                out,
                writer.Rows.of_arrays(
                    splits,
                    name=name,
                    num_classes=num_classes,
                    source=text,
                    stats=stats,
                    class_names=facts.get("class_names"),
                    feature_names=facts.get("feature_names"),
                ),
                shard_size,
                compression,
            )
            written = Path(out)
    return Ingested(
        path=written,
        name=name,
        source=str(source),
        sizes={s: len(splits[s][0]) for s in splits},
        sample_shape=tuple(int(d) for d in np.shape(x)[1:]),
        num_classes=int(num_classes),
        target_width=1 if np.ndim(y) == 1 else int(np.shape(y)[1]),
        standardized=stats is not None,
        **facts,
    )


def _refuse_what_the_source_ignores(source, named, task, label_column, delimiter, fraction_given):
    """Refuse an option that ``source`` would pass over without a word: a user who asked for regression, a
    label column, a delimiter or a test fraction must not get a file that silently has none of them.

    A named source (``digits``, ``synthetic:...``) is classes by construction: ``--task classification`` says
    what it is, ``--task regression`` cannot be honoured.  ``--label-column`` and ``--delimiter`` are the
    cells of a CSV file: nothing else has them.  A named dataset (``digits``) comes with its own test split
    (as does an ``.npz`` file with ``x_test``: :func:`~mpidist.tools.sources.from_npz` refuses it there).
    """
    if fraction_given and source in SOURCES:
        raise UsageError(
            f"ingest: --test-fraction applies where the source has no test split; {source} comes "
            "with its own: ingest it without --test-fraction"
        )
    if named and task == "regression":
        raise UsageError(
            f"ingest: --task regression applies to .npz and .csv files; {printable(source)} is a "
            "named source of classes (its task is fixed): ingest it without --task"
        )
    csv = not named and Path(source).suffix == ".csv"
    for flag, given in (("--label-column", label_column != -1), ("--delimiter", delimiter != "auto")):
        if given and not csv:
            raise UsageError(f"ingest: {flag} applies to .csv files, not to {printable(source)}")


def _write_generated(rows, source, out, shard_size, compression, standardize):
    """``ingest synthetic:...``: rows generated block by block, to a file or a directory of shards."""
    if standardize:
        raise UsageError(
            "ingest: --standardize needs the training rows in memory; synthetic data is standardised "
            "already (features of about unit variance)"
        )
    if shard_size is None:
        whole = {split: (0, n) for split, n in rows.sizes.items()}
        with claimed(out, "the dataset") as claim:
            claim.write(lambda aside: writer.write_file(aside, rows, whole, compression))
    else:
        writer.write_shards(out, rows, shard_size, compression)
    return Ingested(
        path=Path(out),
        name=rows.name,
        source=str(source),
        sizes=dict(rows.sizes),
        sample_shape=tuple(rows.x_meta[0]),
        num_classes=rows.num_classes,
    )
