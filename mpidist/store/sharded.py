"""Sharded checkpoints (format 2): each rank's slices in a part file, one index of virtual datasets over them.

A model no rank holds whole is written by the ranks that hold it: each writes
the regions it writes (its :class:`~mpidist.nn.placement.Placement`'s, as the
int64 table ``describe`` gives) into a part file of its own, and when every
part is on disk one small index is written last and renamed into place, so
the checkpoint exists whole or not at all.  The index is an HDF5 file of
*virtual datasets* mapping the parts' values into whole-model arrays:

* ``params`` and ``optimizer/<name>``: flat arrays of the whole model, as in a
  format-1 checkpoint, so everything that reads one reads this one;
* ``parameters/<name>``: each parameter in its own shape, by name
  (``0003.Dense.W``: its layer's number as the role table numbers layers, the
  layer, its name), for users reading a checkpoint with h5py, as a whole
  checkpoint holds them too (:func:`name_parameters`).

The part files sit in a folder beside the index, named in it relative to the
index's folder (HDF5 looks for a relative source beside the file that names
it), so the checkpoint directory can be moved or copied.  Each part's size
and SHA-256 are in the index; :func:`verify` checks them, that every
virtual dataset reads from the listed parts alone, and that nothing in the
index or a part reads another file (an external link, external storage, a
part that is a symbolic link out of the folder), before anything is read
(HDF5 itself fills a missing source with zeros, silently, and follows
whatever a file names).  Nothing here is
proportional to the whole model: a rank writes its slices, the index holds
mappings, a few integers per region.
"""

import hashlib
import json
import os
from pathlib import Path, PurePosixPath

import h5py
import numpy as np

from ..runtime.text import printable
from . import atomic, bounded, contained, new_hdf5

FORMAT = "mpidist-checkpoint-2"
PARTS = "parts"  # the index's attribute listing the part files: [{"file", "bytes", "sha256"}]
REGIONS = "regions"  # a part's table of the regions it holds (Placement.describe's rows)
PARAMETERS = "parameters"  # the index's group of each parameter in its own shape
HASHED = 1 << 22  # bytes read at a time for a checksum
PARTS_BYTES = 16 << 20  # the parts attribute's bound: about 190 bytes a part, some 88,000 parts


def part_name(rank):
    return f"rank-{int(rank):05d}.h5"


def write_part(path, rows, arrays):
    """Write a rank's part: its ``rows`` (int64 region table) and ``arrays`` (``"params"`` or
    ``"optimizer/<name>"`` -> the written regions' values in the table's order: one 1-D array, or a list of
    them written one after the other, so that regions apart in a rank's buffer need no joined copy).

    Written aside, synced and renamed into place; returns ``{"bytes", "sha256"}`` of the file.
    """
    aside = atomic.fresh_aside(path)
    try:
        write_part_aside(aside, rows, arrays)
        return commit_part(aside, path)
    finally:
        atomic.remove_aside(aside)


def write_part_aside(aside, rows, arrays):
    """:func:`write_part`'s first half: the part's content in the file ``aside``, handed to the operating
    system but not yet synced (a copy in the page cache: the caller's arrays may change once this returns)."""
    with new_hdf5.created(aside) as handle:
        handle.attrs["format"] = FORMAT
        handle.create_dataset(REGIONS, data=np.asarray(rows, dtype=np.int64))
        for key, values in arrays.items():
            pieces = values if isinstance(values, (list, tuple)) else [values]
            dtype = pieces[0].dtype if pieces else np.float64
            dataset = handle.create_dataset(key, shape=(sum(len(piece) for piece in pieces),), dtype=dtype)
            at = 0
            for piece in pieces:
                if len(piece):
                    dataset[at : at + len(piece)] = np.ascontiguousarray(piece)
                at += len(piece)


def commit_part(aside, path):
    """:func:`write_part`'s second half (a thread may do it while training goes on): ``aside`` synced and
    renamed to ``path``; returns ``{"bytes", "sha256"}`` of the file."""
    atomic.commit(aside, path)
    return {"bytes": Path(path).stat().st_size, "sha256": checksum(path)}


def checksum(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(HASHED), b""):
            digest.update(block)
    return digest.hexdigest()


def _axes(rows):
    return (rows.shape[1] - 2) // 2


def _rectangle(row, axes):
    ndim = int(np.count_nonzero(row[2 : 2 + axes] >= 0))
    start, stop = row[2 : 2 + ndim], row[2 + axes : 2 + axes + ndim]
    return [int(a) for a in start], [int(b) for b in stop]


def flat_selection(space, offset, shape, start, stop):
    """Select in ``space`` (1-D, the whole model) the elements of rectangle ``[start, stop)`` of the parameter
    of ``shape`` at ``offset``, in C order: one strided block per combination of the leading axes that do not
    span their parameter's axis, the trailing axes that do merged into each block."""
    ndim = len(shape)
    tail = ndim  # the trailing axes, from here on, that the rectangle spans whole
    while tail > 0 and start[tail - 1] == 0 and stop[tail - 1] == shape[tail - 1]:
        tail -= 1
    inner = int(np.prod(shape[tail:], dtype=np.int64))
    if tail == 0:  # the whole parameter
        space.select_hyperslab((offset,), (1,), block=(inner,), op=h5py.h5s.SELECT_OR)
        return
    # axis tail-1 is cut: a block of (stop - start) x inner elements, stride shape[tail-1] x inner, for each
    # combination of the axes before it (one regular hyperslab where those span their axes whole)
    step = int(shape[tail - 1]) * inner
    block = (stop[tail - 1] - start[tail - 1]) * inner
    if all(start[axis] == 0 and stop[axis] == shape[axis] for axis in range(tail - 1)):
        count = int(np.prod(shape[: tail - 1], dtype=np.int64))
        space.select_hyperslab(
            (offset + start[tail - 1] * inner,),
            (count,),
            stride=(step,),
            block=(block,),
            op=h5py.h5s.SELECT_OR,
        )
        return
    outer = [range(start[axis], stop[axis]) for axis in range(tail - 1)]
    strides = [int(np.prod(shape[axis + 1 :], dtype=np.int64)) for axis in range(tail - 1)]
    for index in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        base = offset + sum((outer[a][i]) * strides[a] for a, i in enumerate(index)) + start[tail - 1] * inner
        space.select_hyperslab((base,), (1,), block=(block,), op=h5py.h5s.SELECT_OR)


def _virtual(group, name, shape, dtype, mappings):
    """A virtual dataset ``name`` of ``shape`` in ``group``; ``mappings``: ``(select(space), file, key, lo,
    count)``: the elements ``select`` picks come from ``file``'s 1-D dataset ``key`` at ``[lo, lo +
    count)``."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    # (a source that cannot be read shows as NaN, not 0)
    dcpl.set_fill_value(np.full((), np.nan, dtype=dtype))
    for select, file, key, lo, count, total in mappings:
        virtual = h5py.h5s.create_simple(tuple(int(n) for n in shape))
        virtual.select_none()
        select(virtual)
        source = h5py.h5s.create_simple((int(total),))
        source.select_hyperslab((int(lo),), (1,), block=(int(count),))
        dcpl.set_virtual(virtual, file.encode(), key.encode(), source)
    space = h5py.h5s.create_simple(tuple(int(n) for n in shape))
    h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(np.dtype(dtype)), space, dcpl=dcpl)


def name_parameters(handle, parameters, dtype, total):
    """``parameters/<name>`` in ``handle`` (a whole checkpoint's file, being written): each parameter of
    ``parameters`` (``(name, shape, offset)``) in its own shape, a virtual dataset over its slice of this
    file's own ``params`` (``total`` elements); no value is copied."""
    group = handle.create_group(PARAMETERS)
    for name, shape, offset in parameters:
        size = int(np.prod(shape, dtype=np.int64))
        _virtual(group, name, shape, dtype, [(_all, ".", "params", offset, size, total)])


def _all(space):
    space.select_all()


def write_index(path, parameters, parts, keys, dtype, attrs):
    """Write the index over ``parts``; the checkpoint is complete once it is renamed into place.

    Args:
        parameters: the whole model's ``(name, shape, offset)`` in entry order.
        parts: ``(file, rows, record)`` for each part: its path relative to the index's folder (POSIX), its
            region table, and :func:`write_part`'s record of it.
        keys: the arrays every part holds (``"params"``, ``"optimizer/m"``, ...).
        dtype: their dtype.
        attrs: the checkpoint's attributes beside the format and the parts (step, config, ...); a value that
            is
            a dict is stored as JSON.  ``optimizer/`` attributes go in ``attrs["optimizer"]``.
    """
    total = sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in parameters)
    flat = {key: [] for key in keys}
    whole = {index: [] for index in range(len(parameters))}
    for file, rows, _ in parts:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:  # (a rank that writes nothing: a replica past the first)
            continue
        held, lo = int(rows[:, 1].sum()), 0
        for row in rows:
            entry, size = int(row[0]), int(row[1])
            start, stop = _rectangle(row, _axes(rows))
            _, shape, offset = parameters[entry]

            def select_flat(space, offset=offset, shape=shape, start=start, stop=stop):
                flat_selection(space, offset, shape, start, stop)

            def select_shaped(space, start=start, stop=stop):
                space.select_hyperslab(
                    tuple(start),
                    (1,) * len(start),
                    block=tuple(b - a for a, b in zip(start, stop)),
                    op=h5py.h5s.SELECT_OR,
                )

            for key in keys:
                flat[key].append((select_flat, file, key, lo, size, held))
            whole[entry].append((select_shaped, file, "params", lo, size, held))
            lo += size
    with atomic.replacing(path) as aside:
        with new_hdf5.created(aside) as handle:
            handle.attrs["format"] = FORMAT
            handle.attrs[PARTS] = json.dumps([{"file": file, **record} for file, _, record in parts])
            for name, value in attrs.items():
                if name != "optimizer":
                    handle.attrs[name] = json.dumps(value) if isinstance(value, dict) else value
            handle.create_group("optimizer").attrs.update(attrs.get("optimizer", {}))
            for key in keys:
                _virtual(handle, key, (total,), dtype, flat[key])
            group = handle.create_group(PARAMETERS)
            for entry, (name, shape, _) in enumerate(parameters):
                _virtual(group, name, shape, dtype, whole[entry])


def verify(path, handle, share=(0, 1)):
    """Check a format-2 index ``handle`` (open, at ``path``) before anything is read through it: its parts are
    files in the checkpoint's folder of the size it records, every virtual dataset reads from them alone, no
    item of the index or of a part reads any other file (:func:`~mpidist.store.contained.outside`), and no
    part's array is stored in chunks far larger than it (:func:`~mpidist.store.bounded.oversized_chunks`).
    Returns None, or what is wrong, in words.

    Checksums, and what each part's items read, are checked for a ``share`` ``(i, n)`` of the parts, every
    n-th from the i-th: ``(0, 1)`` all of them, ``(0, 0)`` none; ``n`` ranks that each check their share, and
    agree on it before any reads, read the checkpoint once between them.
    """
    folder = Path(path).parent
    try:
        text = bounded.Attributes(handle, index_problem, limits={PARTS: PARTS_BYTES}).get(PARTS, "")
    except IndexProblem as err:
        return str(err)
    try:
        listed = json.loads(text)
    except (TypeError, ValueError):
        return f"attribute {PARTS} is not a JSON list of the part files"
    if not isinstance(listed, list) or not listed:
        return f"attribute {PARTS} lists no part files"
    files, (first, every) = set(), share
    for number, record in enumerate(listed):
        if not (
            isinstance(record, dict)
            and isinstance(record.get("file"), str)
            and isinstance(record.get("bytes"), int)
            and isinstance(record.get("sha256"), str)
        ):
            return f"attribute {PARTS} has an entry that is not {{file, bytes, sha256}}"
        problem = _part_problem(folder, record, every and number % every == first)
        if problem:
            return problem
        files.add(record["file"])
    return contained.outside(handle, allowed=files)


class IndexProblem(ValueError):
    """What is wrong with an index, in words (an attribute too large to read)."""


def index_problem(item, problem):
    return IndexProblem(f"{item} {problem}")


def _part_problem(folder, record, hashed):
    """What is wrong with the part ``record`` names in ``folder``, in words (None where nothing is); with
    ``hashed``, its checksum and its items are checked too."""
    name = PurePosixPath(record["file"])
    # (HDF5 expands "%b" and "%%" in a virtual dataset's source names: the file it opened would not be this)
    if name.is_absolute() or ".." in name.parts or not name.parts or "%" in record["file"]:
        return f"part {printable(record['file'])!r} is not a file inside the checkpoint's folder"
    part = folder / name
    if not part.is_file():
        return f"part {printable(record['file'])} is missing"
    real, home = os.path.realpath(part), os.path.realpath(folder)
    if os.path.commonpath([real, home]) != home:
        return (
            f"part {printable(record['file'])} is a symbolic link, or lies under one, that leads out of the "
            f"checkpoint's folder (to {printable(real)}): refused, as it reads another file"
        )
    if part.stat().st_size != record["bytes"] or (hashed and checksum(part) != record["sha256"]):
        return (
            f"part {printable(record['file'])} is not the file that was written (its size or checksum "
            "differs)"
        )
    if hashed:
        try:
            with h5py.File(part, "r") as opened:
                problem = contained.outside(opened) or bounded.oversized_chunks(opened)
        except (OSError, RuntimeError, ValueError, KeyError) as err:
            return f"part {printable(record['file'])} is not a readable HDF5 file ({printable(err)})"
        if problem:
            return f"part {printable(record['file'])}: {problem}"
    return None


def parts_folder(index, token):
    """The folder of the parts of the checkpoint ``index`` written with ``token`` (a fresh one for every
    write, so a checkpoint written again under the same name never overwrites the parts its old index
    names)."""
    index = Path(index)
    return index.with_name(f"{index.stem}.parts-{token}")
