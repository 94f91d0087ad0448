"""The parts folders of sharded checkpoints that a checkpoint directory no longer needs, and their removal.

A sharded checkpoint (:mod:`mpidist.store.sharded`) is an index over a folder of parts beside it.  A write
that never completed (a rank killed before the index was renamed into place), a checkpoint pruned, or one
written again under the same name leave a folder no index names: debris, removed where no write is in flight
(at start-up with the directory's lock held, or by the chief after its index is in place).  A folder is
debris only where that is provable: no index under its name exists, or the one there names another folder,
and no index that might name it (its own, or a ``best-*.h5``) cannot be read -- a checkpoint passed over is
left as it is, parts and all.  Removing goes through :mod:`mpidist.store.removal`: the parts' own names
only, never through a link.
"""

import dataclasses
import json
import os
import re
from pathlib import Path, PurePosixPath

import h5py

from . import bounded, removal
from .outputs import is_regular_file
from .sharded import FORMAT, PARTS, PARTS_BYTES, index_problem

#: the names a parts folder's writers make: each rank's part, and the file aside it is written in
PART_FILES = re.compile(r"rank-\d{5,}\.h5|\.rank-\d{5,}\.h5\.tmp-\d+")


def remove_parts(folder):
    """Remove a checkpoint's folder of parts (pruned, or left by a write that never completed): the parts
    and asides in it, then the folder; a folder that is a link, or holds anything else, is left (see
    :mod:`mpidist.store.removal`).  Returns the :class:`~mpidist.store.removal.Removal`."""
    return removal.remove_folder(folder, PART_FILES)


FOLDER = re.compile(r"(?:ckpt|best)-.+\.parts-[0-9a-f]{1,32}")
BEST = "best-*.h5"  # a kept copy of an index (a hard link): it may name any checkpoint's parts folder


@dataclasses.dataclass
class Naming:
    """What the indexes of a directory say about its parts folders: the folders they name, and the indexes
    that could not be read (their stems), which may name folders no one can tell."""

    named: set
    unread: set

    def unread_owner(self, folder):
        """Why the parts folder named ``folder``, which no index that was read names, may still be a
        checkpoint's (an index that could name it cannot be read), in words; None where none could."""
        stem = folder.rpartition(".parts-")[0]
        if stem in self.unread:
            return f"its index {stem}.h5 cannot be read: a checkpoint passed over is left as it is"
        best = sorted(name for name in self.unread if name.startswith("best-"))
        if best:
            return f"{best[0]}.h5 cannot be read, and may name it"
        return None


def naming(directory, pattern="*.h5"):
    """The :class:`Naming` of the indexes in ``directory`` that match ``pattern``."""
    named, unread = set(), set()
    for index in Path(directory).glob(pattern):
        if not is_regular_file(index):  # (a named pipe under an index's name would block the open forever)
            unread.add(index.stem)
            continue
        try:
            with h5py.File(index, "r") as handle:
                attrs = bounded.Attributes(handle, index_problem, limits={PARTS: PARTS_BYTES})
                kind = attrs.get("format")
                listed = json.loads(attrs.get(PARTS, "[]")) if kind == FORMAT else []
        except (OSError, ValueError, TypeError, KeyError, RuntimeError):
            unread.add(index.stem)
            continue
        folders = [_folder_of(record) for record in listed] if isinstance(listed, list) else [None]
        if None in folders or _later(kind):
            unread.add(index.stem)
        named.update(folder for folder in folders if folder)
    return Naming(named, unread)


def _later(kind):
    """Whether ``kind`` (an index's ``format``) is a later mpidist's checkpoint format than this one reads: it
    may name parts folders as this one cannot tell."""
    found = re.fullmatch(r"mpidist-checkpoint-(\d{1,9})", str(kind))
    return found is not None and int(found.group(1)) > int(FORMAT.rsplit("-", 1)[1])


def _folder_of(record):
    """The parts folder a record of an index's parts names, or None where it names none readably."""
    if not isinstance(record, dict) or not isinstance(record.get("file"), str):
        return None
    parts = PurePosixPath(record["file"]).parts
    return parts[0] if len(parts) > 1 else None


def remove_unnamed_folders(directory):
    """Remove the parts folders in ``directory`` that are provably debris: no index names them, and none
    that might cannot be read -- those of pruned checkpoints, and those a write that never completed left
    (call where no write is in flight: the chief after its index is in place, or at start-up with the
    directory's lock held).  Returns the :class:`~mpidist.store.removal.Removal`: what was removed, and what
    was left and why."""
    directory = Path(directory)
    if not directory.is_dir():  # (the directory the user named may be a link: what is in it, never)
        return removal.Removal()
    return _remove_debris(directory, naming(directory), lambda stem: True)


def remove_replaced_folders(directory, current, folder, pruned):
    """After the index ``current`` (over the parts in ``folder``) is in place and the indexes ``pruned`` were
    deleted: remove their parts folders, and those of an earlier write under ``current``'s name, unless a
    ``best-*.h5`` index (a kept link to a checkpoint's index) names them or cannot be read.  What
    :func:`remove_unnamed_folders` does after each write, for a directory listing and a read of the best
    indexes rather than a read of every index; returns the
    :class:`~mpidist.store.removal.Removal`."""
    current = Path(current)
    stems = {Path(index).stem for index in pruned} | {current.stem}
    kept = naming(directory, BEST)
    kept.named.add(Path(folder).name)
    return _remove_debris(Path(directory), kept, stems.__contains__)


def _remove_debris(directory, known, candidate):
    """Remove the parts folders in ``directory`` whose stem is a ``candidate`` and that ``known`` (a
    :class:`Naming`) does not keep."""
    done = removal.Removal()
    for name in sorted(os.listdir(directory)):
        stem, _, token = name.rpartition(".parts-")
        if not (token and FOLDER.fullmatch(name) and candidate(stem)) or name in known.named:
            continue
        why = known.unread_owner(name)
        if why is not None:
            done.left.append((name, why))
            continue
        found = remove_parts(directory / name)
        done.removed += found.removed
        done.left += found.left
    return done
