"""Where a dataset's files are: what ``--data`` names, the files of a directory or a glob, and opening one.

``--data`` may name a file, a directory or a glob of files, or a bundled
dataset by its name; :func:`resolve` says which, and :func:`members` lists the
files in the order their rows are concatenated, opening none of them (an entry
of a directory that is not a regular file is refused: opening a pipe could
wait forever).  :func:`open_source` opens one, for the checks
(:mod:`mpidist.data.layout`) and the reads (:mod:`mpidist.data.rows`) alike.
Finding the files is apart from checking what they hold: the names a user
gives are resolved once, before any file is trusted or read.
"""

import glob
import os
import re
import sys
from pathlib import Path

import h5py

from ..runtime.errors import UsageError
from ..store.outputs import is_regular_file, special_kind
from .arrays import ArrayData

MAX_FILES = 100_000  # files in one dataset: more is a wrong directory, and each is opened by every rank
SUFFIXES = (".h5", ".hdf5")
CHUNK_CACHE = 1 << 20  # HDF5's own chunk cache per dataset


def data_dirs():
    """Where bundled datasets are looked for, in order."""
    dirs = []
    if os.environ.get("MPIDIST_DATA_DIR"):
        dirs.append(Path(os.environ["MPIDIST_DATA_DIR"]))
    dirs.append(Path(__file__).resolve().parent.parent.parent / "data")  # a checkout / editable install
    dirs.append(Path(sys.prefix) / "share" / "mpidist" / "data")  # a wheel install
    return dirs


def bundled_names():
    """Names of the bundled datasets that can be found."""
    return sorted({p.stem for d in data_dirs() if d.is_dir() for p in d.glob("*.h5")})


def resolve(spec):
    """What ``--data`` names: a file, a directory or a glob of files, or a bundled dataset (arrays pass
    through)."""
    if isinstance(spec, ArrayData):
        return spec
    if not isinstance(spec, (str, os.PathLike)):  # (numpy arrays: ArrayData(train=..., test=...) takes them)
        raise UsageError(
            f"data: a dataset file, directory or bundled name, or an ArrayData of arrays, not "
            f"{type(spec).__name__}"
        )
    spec = os.fspath(spec)  # (a Path is a name as a string is)
    if not str(spec).strip():  # (Path("") is the working directory: an unset "$DATA" read every .h5 there)
        raise UsageError(f"--data {spec!r}: empty; name a dataset file, directory or bundled dataset")
    path = Path(spec).expanduser()
    if path.is_file() or path.is_dir():
        return path
    if glob.has_magic(str(spec)):
        return Path(os.path.expanduser(spec))  # expanded by members(): it must match files
    if path.suffix == "" and os.sep not in spec:
        for directory in data_dirs():
            candidate = directory / f"{spec}.h5"
            if candidate.is_file():
                return candidate
        names = ", ".join(bundled_names()) or "none found"
        raise UsageError(
            f"--data {spec!r}: no such file, and no bundled dataset of that name (bundled: {names})"
        )
    raise UsageError(f"--data {spec}: no such file")


def _natural(path):
    """Sort key: digits compare as numbers (``part-2`` before ``part-10``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", path.name)]


def members(path):
    """The files of dataset ``path`` in order: itself, a directory's ``*.h5``/``*.hdf5`` files, or a glob's
    matches."""
    if isinstance(path, ArrayData) or path.is_file():
        return [path]
    if path.is_dir():
        found = [p for p in path.iterdir() if p.suffix.lower() in SUFFIXES and not p.name.startswith(".")]
        what = f"{path}: a directory with no .h5 or .hdf5 files"
        odd = next((p for p in found if not is_regular_file(p)), None)
        # (refused, not passed over: training on fewer parts than given is silently wrong)
        if odd is not None:
            raise UsageError(
                f"{path}: {odd.name} is {special_kind(odd) or 'a directory'}, not a file; the .h5 and "
                ".hdf5 files of a dataset directory are its parts, and opening it could wait forever"
            )
    else:
        found = [Path(p) for p in glob.glob(str(path)) if os.path.isfile(p)]
        what = f"--data {path}: matches no files"
    if not found:
        raise UsageError(what)
    if len(found) > MAX_FILES:
        raise UsageError(f"{path}: {len(found):,} files, more than one dataset may have ({MAX_FILES:,})")
    return sorted(found, key=_natural)


def open_source(path, cache=0):
    """An HDF5 file, or an :class:`~mpidist.data.arrays.ArrayData`'s image, open for reading.

    ``cache``: bytes of a compressed chunk span reads must not decompress again and again (reading part of a
    compressed chunk decompresses all of it): each dataset's chunk cache holds one, where HDF5's is smaller.
    """
    if isinstance(path, ArrayData):
        return path.open()
    if cache > CHUNK_CACHE:
        return h5py.File(path, "r", rdcc_nbytes=cache + CHUNK_CACHE)
    return h5py.File(path, "r")
