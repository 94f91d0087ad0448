"""Writing datasets a block of rows at a time: directories of shards, streaming-friendly chunks, synthetic
data.

``ingest --shard-size N`` writes a directory of files in the mpidist layout:
train rows cut into consecutive files of ``N`` rows, the test (and val) rows
spread over the same files in proportion, so the files concatenated in name
order are the single file ``ingest`` would write; they are named after the
dataset's name as a label (:func:`mpidist.runtime.text.file_label`: ``--name
../x`` names files ``x-00000.h5`` inside the directory).  Every file carries
the attributes, statistics and class names.  ``x`` and ``y`` are chunked by whole
samples, about :data:`CHUNK_BYTES` a chunk, so a stream reads whole chunks.
The directory is written aside and renamed into place once whole.

``synthetic:ROWS,FEATURES,CLASSES`` generates a learnable classification task
(Gaussian classes around random means) of any size, :data:`GENERATED_ROWS` rows
at a time from a generator seeded by ``(seed, block)``: the same bytes whatever
the writing, and memory bounded whatever ``ROWS``.
"""

import math
import os
import re
import shutil
import uuid
from pathlib import Path

import h5py
import numpy as np

from ..runtime import leftovers
from ..runtime.errors import UsageError
from ..runtime.text import file_label
from ..store import atomic, new_hdf5
from ..store.outputs import unwritable

CHUNK_BYTES = 1 << 20  # a chunk of x: a stream's block is whole chunks of it
WRITE_BYTES = 64 << 20  # rows written (and generated) at once
GENERATED_ROWS = 4096  # rows of one generator block of synthetic data: its seed is (seed, block)
COMPRESSIONS = ("gzip", "lzf", "none")
SYNTHETIC = re.compile(r"synthetic:(\d+),(\d+),(\d+)")
SEPARATION = 0.25  # class means of synthetic data: N(0, 1) x this per feature, plus N(0, 1) noise


def chunks_for(shape, itemsize):
    """Chunk shape for an array of ``shape``: whole samples, about :data:`CHUNK_BYTES` (None for no rows)."""
    if not shape[0]:
        return None
    row = max(1, itemsize * int(np.prod(shape[1:], dtype=np.int64)))
    return (int(min(shape[0], max(1, CHUNK_BYTES // row))),) + tuple(int(d) for d in shape[1:])


def filters(compression):
    """h5py keyword arguments for ``--compression``: gzip at level 4 (fast to write; 9 saves little more),
    lzf, none."""
    if compression not in COMPRESSIONS:
        raise UsageError(f"--compression {compression!r}: choose from {', '.join(COMPRESSIONS)}")
    return {
        "gzip": {"compression": "gzip", "compression_opts": 4, "shuffle": True},
        "lzf": {"compression": "lzf", "shuffle": True},
        "none": {},
    }[compression]


def check_shard_size(shard_size):
    if shard_size is not None and (
        isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1
    ):
        raise UsageError(f"--shard-size {shard_size!r}: give a positive number of training rows per file")


class Rows:
    """A dataset to write: ``sizes`` per split, ``read(split, lo, hi) -> (x, y)``, and what the files say."""

    def __init__(
        self,
        sizes,
        read,
        x_meta,
        y_meta,
        name,
        num_classes,
        source,
        stats=None,
        class_names=None,
        feature_names=None,
    ):
        self.sizes, self.read, self.x_meta, self.y_meta = sizes, read, x_meta, y_meta  # meta: (shape, dtype)
        self.name, self.num_classes, self.source = name, num_classes, source
        self.stats, self.class_names, self.feature_names = stats, class_names, feature_names

    @classmethod
    def of_arrays(cls, splits, **facts):
        """Rows held in memory: ``splits = {"train": (x, y), ...}``."""
        x, y = splits["train"]
        return cls(
            {s: len(splits[s][0]) for s in splits},
            lambda s, lo, hi: (splits[s][0][lo:hi], splits[s][1][lo:hi]),
            (np.shape(x)[1:], np.asarray(x).dtype),
            (np.shape(y)[1:], np.asarray(y).dtype),
            **facts,
        )


def write_file(path, rows, parts, compression):
    """Write ``rows`` to ``path``: ``parts[split] = (lo, hi)`` of each split, copied :data:`WRITE_BYTES` at a
    time."""
    with new_hdf5.created(path) as handle:
        handle.attrs.update(name=rows.name, num_classes=int(rows.num_classes), source=rows.source)
        for split, (lo, hi) in parts.items():
            made = {}
            for key, (shape, dtype) in (("x", rows.x_meta), ("y", rows.y_meta)):
                full = (hi - lo,) + tuple(shape)
                made[key] = handle.create_dataset(
                    f"{split}/{key}",
                    shape=full,
                    dtype=dtype,
                    chunks=chunks_for(full, np.dtype(dtype).itemsize),
                    **(filters(compression) if hi > lo else {}),
                )
            step = max(
                1, WRITE_BYTES // max(1, np.dtype(rows.x_meta[1]).itemsize * int(np.prod(rows.x_meta[0])))
            )
            for at in range(lo, hi, step):
                x, y = rows.read(split, at, min(hi, at + step))
                made["x"][at - lo : at - lo + len(x)] = x
                made["y"][at - lo : at - lo + len(y)] = y
        for key, value in zip(("mean", "std"), rows.stats if rows.stats is not None else ()):
            handle.create_dataset(f"stats/{key}", data=np.asarray(value, np.float64))
        for key, names in (("class_names", rows.class_names), ("feature_names", rows.feature_names)):
            if names is not None:
                handle.create_dataset(key, data=list(names), dtype=h5py.string_dtype())
    atomic.sync_file(path)  # on disk before the directory is renamed into place


def write_shards(out, rows, shard_size, compression="gzip"):
    """Write ``rows`` as a directory ``out`` of files of ``shard_size`` training rows each; returns the
    files."""
    check_shard_size(shard_size)
    filters(compression)
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UsageError(
            f"{out}: exists{' and is not empty' if out.is_dir() else ' and is not a directory'}; "
            "--shard-size writes a new directory: remove it, or choose another"
        )
    count = max(1, math.ceil(rows.sizes["train"] / shard_size))
    digits = max(5, len(str(count - 1)))
    aside, made = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}", False
    try:
        aside.mkdir(parents=False)  # (fails on anything already there, which is then never removed)
        made = True
        with leftovers.pending(aside, tree=True):  # (a signal that ends the command removes it too)
            names = []
            for k in range(count):
                parts = {
                    split: (
                        (k * n // count, (k + 1) * n // count)
                        if split != "train"
                        else (k * shard_size, min(n, (k + 1) * shard_size))
                    )
                    for split, n in rows.sizes.items()
                }
                names.append(f"{file_label(rows.name)}-{k:0{digits}d}.h5")  # (a name is a label, not a path)
                write_file(aside / names[-1], rows, parts, compression)
            if out.is_dir():
                out.rmdir()  # (empty: checked above)
            os.replace(aside, out)
            atomic.sync_directory(out.parent)  # the rename on disk too
    except OSError as err:
        raise unwritable(out, "the dataset", err) from None
    finally:
        if made:  # (a folder this call made: all in it is its own; rmtree never follows a link)
            shutil.rmtree(aside, ignore_errors=True)
    return [out / name for name in names]


def synthetic(spec, test_fraction, seed, name=None):
    """:class:`Rows` of ``synthetic:ROWS,FEATURES,CLASSES``; None if ``spec`` is not such a source."""
    match = SYNTHETIC.fullmatch(str(spec))
    if not match:
        if str(spec).startswith("synthetic"):
            raise UsageError(
                f"ingest: {spec!r}: write synthetic:ROWS,FEATURES,CLASSES, e.g. synthetic:1700000,784,10"
            )
        return None
    total, features, classes = (int(v) for v in match.groups())
    if total < 2 or features < 1 or not 2 <= classes <= 1 << 16 or features > 1 << 24:
        raise UsageError(f"ingest: {spec}: needs at least 2 rows, 1 feature and 2 to 65,536 classes")
    test = min(total - 1, max(1, math.ceil(test_fraction * total)))
    means = (np.random.default_rng([seed, 0x5E9]).normal(size=(classes, features)) * SEPARATION).astype(
        np.float32
    )

    def generate(block):
        rng = np.random.default_rng([seed, block])
        labels = rng.integers(0, classes, GENERATED_ROWS)
        return means[labels] + rng.standard_normal((GENERATED_ROWS, features), dtype=np.float32), labels

    def read(split, lo, hi):
        first = lo + (total - test if split == "test" else 0)  # test rows are the last ones generated
        start, xs, ys = first - first % GENERATED_ROWS, [], []
        for block in range(start // GENERATED_ROWS, (first + hi - lo - 1) // GENERATED_ROWS + 1):
            x, y = generate(block)
            xs.append(x)
            ys.append(y)
        at = first - start
        return np.concatenate(xs)[at : at + hi - lo], np.concatenate(ys)[at : at + hi - lo]

    source = (
        f"synthetic: {total:,} rows of {features:,} features, {classes} Gaussian classes around random means "
        f"(N(0, {SEPARATION}^2) per feature) with N(0, 1) noise; seed {seed}; the last {test:,} rows are test"
    )
    return Rows(
        {"train": total - test, "test": test},
        read,
        ((features,), np.float32),
        ((), np.int64),
        name=name or "synthetic",
        num_classes=classes,
        source=source,
    )
