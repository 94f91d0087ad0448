"""The file ``predict`` writes, by its suffix (HDF5, ``.csv``, ``.npy``), and the outputs it refuses.

:mod:`mpidist.tools.predictions` computes the predictions and gathers them to
rank 0, which writes them here into the file its claim renames into place
(:func:`mpidist.store.outputs.claimed`): the layout of the file is one concept,
apart from how the ranks come by what goes in it.  The HDF5 file holds, for
classification, ``class`` (int64, the highest output, first on ties: as
``eval`` counts) and ``probabilities`` (softmax, float32); for regression
``values`` (``(N, W)``, the model's dtype); and attributes ``format``,
``checkpoint``, ``step``, ``model``, ``data``, ``split``, ``task``,
``samples`` and ``class_names`` where the dataset names its classes.
"""

import csv
import io
from pathlib import Path

import h5py
import numpy as np

from ..data.sources import SUFFIXES
from ..runtime.errors import UsageError
from ..store import new_hdf5
from ..store.kept import refuse_kept
from .csv_table import spreadsheet_safe

#: The HDF5 file's ``format`` attribute: the layout above, by name.
FORMAT = "mpidist-predictions-1"


def refuse_an_input(target, inputs):
    """Refuse an output that is a file this run reads (it would be replaced by what is read from it), a file a
    run keeps (:func:`~mpidist.store.kept.refuse_kept`), or a new part of a dataset directory it reads (the
    next read of that dataset would take it for one)."""
    refuse_kept(target, "--output", inputs)
    for source in inputs:
        source = Path(source)
        if (
            source.is_dir()
            and target.resolve().parent == source.resolve()
            and target.suffix.lower() in SUFFIXES
        ):
            raise UsageError(
                f"--output {target}: is in {source}, a dataset directory this run reads, whose "
                f"{' and '.join(SUFFIXES)} files are its parts; write the predictions elsewhere"
            )


def write_predictions(aside, result, checkpoint_path, reader):
    """Rank 0: the predictions into the file ``aside`` (its claim renames it into place once whole), as the
    output's suffix says: ``.csv`` (a header, then a row per sample), ``.npy`` (the classes, or the values),
    else HDF5."""
    suffix = Path(result.output).suffix.lower()
    if suffix == ".csv":
        return _write_csv(aside, result)
    if suffix == ".npy":
        # np.save into a real file writes with C's fwrite, whose short write on a full disk went unseen (a cut
        # file renamed into place); into memory, then written by Python, which raises for it
        image = io.BytesIO()
        np.save(image, result.classes if result.task == "classification" else result.values)
        with open(aside, "wb") as handle:
            handle.write(image.getbuffer())
        return None
    with new_hdf5.created(aside) as handle:
        if result.task == "classification":
            handle.create_dataset("class", data=result.classes)
            handle.create_dataset("probabilities", data=result.probabilities)
        else:
            handle.create_dataset("values", data=result.values)
        handle.attrs.update(
            {
                "format": FORMAT,
                "checkpoint": str(Path(checkpoint_path).resolve()),
                "step": int(result.step),
                "model": result.model,
                "data": reader.data,
                "split": reader.split or "",
                "task": result.task,
                "samples": int(result.samples),
            }
        )
        if result.class_names is not None:
            handle.attrs["class_names"] = np.array(result.class_names, dtype=h5py.string_dtype())


def _write_csv(aside, result):
    """A row per sample: the class (and its name, where the dataset names them) and each class's probability;
    for regression, the values.  The names come from the user's data: each is made
    :func:`~mpidist.tools.csv_table.spreadsheet_safe`; the figures are numbers mpidist formats, left as they
    are."""
    with open(aside, "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        if result.task == "classification":
            names = result.class_names
            width = result.probabilities.shape[1]
            writer.writerow(["class"] + (["name"] if names else []) + [f"p{k}" for k in range(width)])
            for label, row in zip(result.classes, result.probabilities):
                named = [spreadsheet_safe(names[label])] if names else []
                writer.writerow([int(label)] + named + [f"{p:.6g}" for p in row])
        else:
            width = result.values.shape[1]
            writer.writerow(["value"] if width == 1 else [f"value{k}" for k in range(width)])
            writer.writerows(
                [[f"{v:.9g}" for v in row] for row in result.values.reshape(len(result.values), -1)]
            )
