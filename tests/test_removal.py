"""mpidist removes only what it wrote: never through a link, only names its own writes make, only from folders
it made; anything else is left, and said (issue: a link named like a parts folder had its target's files
deleted, then the run crashed).

Each place that removes is tried with what a user may have put under mpidist's names: a symbolic link to
their archive, a folder of their own, a file of their own in a folder mpidist made, a special file.
"""

import json
import os
import re

import h5py
import numpy as np
import pytest

from conftest import mpidist
from mpidist.store import lineage, parts_debris, removal, rundir, sharded

LINEAGE = "abcdef12"


def archive(tmp_path, name="archive"):
    """A user's folder that must come through untouched: files named as mpidist names its own."""
    folder = tmp_path / name
    folder.mkdir()
    for file in ("rank-00000.h5", ".rank-00001.h5.tmp-7", "ckpt-00000001-abcdef12.h5", "notes.txt"):
        (folder / file).write_text(f"the user's {file}")
    return folder


def intact(folder):
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["rank-00000.h5", ".rank-00001.h5.tmp-7", "ckpt-00000001-abcdef12.h5", "notes.txt"]
    )
    assert all(p.read_text() == f"the user's {p.name}" for p in folder.iterdir())


def test_a_folder_is_emptied_of_its_own_names_only_and_a_link_is_never_followed(tmp_path):
    own = re.compile(r"rank-\d{5}\.h5")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rank-00000.h5").write_text("part")
    (mine / "rank-00001.h5").write_text("part")
    done = removal.remove_folder(mine, own)
    assert done.removed == ["mine"] and done.left == [] and not mine.exists()

    user = archive(tmp_path)
    (tmp_path / "linked").symlink_to(user)
    done = removal.remove_folder(tmp_path / "linked", own)
    assert done.removed == [] and done.left == [("linked", "a symbolic link, not a folder mpidist made")]
    assert (tmp_path / "linked").is_symlink()
    intact(user)

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "rank-00000.h5").write_text("part")
    (mixed / "rank-00001.h5").symlink_to(user / "rank-00000.h5")  # a link under a part's name
    (mixed / "theirs.txt").write_text("keep")
    done = removal.remove_folder(mixed, own)
    # its own part goes; the link and the foreign file stay, and so does the folder, said
    assert sorted(p.name for p in mixed.iterdir()) == ["rank-00001.h5", "theirs.txt"]
    assert done.left == [("mixed", "holds what mpidist did not write: rank-00001.h5, theirs.txt")]
    intact(user)
    assert "left in D, as mpidist removes only what it wrote: mixed (holds" in done.note("D")


@pytest.mark.parametrize("special", ["link", "folder", "fifo"])
def test_a_file_removal_removes_regular_files_only(tmp_path, special):
    target = tmp_path / "target.h5"
    target.write_text("the user's")
    path = tmp_path / "ckpt-00000001-abcdef12.h5"
    {"link": lambda: path.symlink_to(target), "folder": path.mkdir, "fifo": lambda: os.mkfifo(path)}[
        special
    ]()
    done = removal.remove_file(path)
    assert done.removed == [] and len(done.left) == 1 and os.path.lexists(path)
    assert target.read_text() == "the user's"


def sharded_checkpoint(directory, step, token="0a"):
    """A format-2 checkpoint of ``step`` as a run writes it: two parts in its folder, the index over them."""
    index = directory / lineage.file_name(step, LINEAGE)
    folder = sharded.parts_folder(index, token)
    folder.mkdir(parents=True)
    parts = []
    for rank in range(2):
        rows = np.array([[0, 2, rank * 2, -1, rank * 2 + 2, -1]], dtype=np.int64)
        record = sharded.write_part(folder / sharded.part_name(rank), rows, {"params": np.ones(2)})
        parts.append((f"{folder.name}/{sharded.part_name(rank)}", rows, record))
    sharded.write_index(index, [("0000.Dense.W", (4,), 0)], parts, ["params"], np.float64, {"step": step})
    return index, folder


def test_start_up_leaves_a_link_named_like_a_parts_folder_and_its_target_untouched(tmp_path):
    directory = tmp_path / "ck"
    directory.mkdir()
    user = archive(tmp_path)
    (directory / f"ckpt-00000001-{LINEAGE}.parts-0a").symlink_to(user)
    (directory / f".ckpt-00000002-{LINEAGE}.h5.tmp-99").symlink_to(user / "notes.txt")  # a temporary's name
    stale = directory / f".ckpt-00000003-{LINEAGE}.h5.tmp-98"
    stale.write_text("a killed writer's")
    done = lineage.CheckpointDir(directory).remove_stale_temporaries()
    assert done.removed == [stale.name] and not stale.exists()
    assert sorted(name for name, _ in done.left) == sorted(
        [f".ckpt-00000002-{LINEAGE}.h5.tmp-99", f"ckpt-00000001-{LINEAGE}.parts-0a"]
    )
    intact(user)


def test_pruning_after_a_write_leaves_links_and_foreign_files(tmp_path):
    directory = tmp_path / "ck"
    old, old_folder = sharded_checkpoint(directory, 1)
    user = archive(tmp_path)
    (old_folder / "theirs.txt").write_text("keep")  # the user's file in a folder mpidist made
    (directory / f"ckpt-00000002-{LINEAGE}.parts-0b").symlink_to(user)  # named like a pruned one's folder
    newest, folder = sharded_checkpoint(directory, 3)
    place = lineage.CheckpointDir(directory)
    (directory / f"ckpt-00000002-{LINEAGE}.h5").symlink_to(user / "ckpt-00000001-abcdef12.h5")
    pruned = place.prune(LINEAGE, keep=1, newest=newest)
    assert pruned == [old]  # the link under a checkpoint's name is neither pruned nor counted
    done = parts_debris.remove_replaced_folders(
        directory, newest, folder, [*pruned, directory / f"ckpt-00000002-{LINEAGE}.h5"]
    )
    assert old_folder.is_dir() and sorted(p.name for p in old_folder.iterdir()) == ["theirs.txt"]
    assert [name for name, _ in done.left] == [old_folder.name, f"ckpt-00000002-{LINEAGE}.parts-0b"]
    assert (directory / f"ckpt-00000002-{LINEAGE}.h5").is_symlink()
    intact(user)


def test_a_parts_folder_is_debris_only_when_provably_an_interrupted_write(tmp_path):
    """Item 2: a folder whose index cannot be read is a checkpoint passed over, not debris; one whose index
    never reached its name, or was replaced, is."""
    directory = tmp_path / "ck"
    corrupt, corrupt_folder = sharded_checkpoint(directory, 1)
    corrupt.write_bytes(b"not HDF5 any more")  # the index, bit-rotted: its parts are the data
    _, interrupted = sharded_checkpoint(directory, 2)
    (directory / lineage.file_name(2, LINEAGE)).unlink()  # killed before the index was renamed into place
    replaced_index, kept = sharded_checkpoint(directory, 3, token="0c")
    stale = sharded.parts_folder(replaced_index, "0d")
    stale.mkdir()
    (stale / sharded.part_name(0)).write_text("an earlier write's part")
    done = parts_debris.remove_unnamed_folders(directory)
    assert sorted(done.removed) == sorted([interrupted.name, stale.name])
    assert corrupt_folder.is_dir() and kept.is_dir() and len(list(corrupt_folder.iterdir())) == 2
    assert done.left == [
        (
            corrupt_folder.name,
            f"its index {corrupt.stem}.h5 cannot be read: a checkpoint passed over is left as it is",
        )
    ]


def test_a_best_index_that_cannot_be_read_keeps_every_unnamed_folder(tmp_path):
    directory = tmp_path / "ck"
    _, folder = sharded_checkpoint(directory, 1)
    (directory / lineage.file_name(1, LINEAGE)).unlink()
    (directory / f"best-{LINEAGE}.h5").write_bytes(b"garbage")  # it may have named that folder
    done = parts_debris.remove_unnamed_folders(directory)
    assert done.removed == [] and folder.is_dir()
    assert done.left == [(folder.name, f"best-{LINEAGE}.h5 cannot be read, and may name it")]


def test_an_empty_run_directory_is_removed_but_never_through_a_link(tmp_path):
    empty = tmp_path / "empty"
    (empty / rundir.CHECKPOINTS).mkdir(parents=True)
    (empty / rundir.METRICS).write_text("")
    rundir.remove_if_empty(empty)
    assert not empty.exists()

    user = tmp_path / "user"
    user.mkdir()
    (user / lineage.LOCK_NAME).write_text("the user's")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / rundir.CHECKPOINTS).symlink_to(user)
    target = tmp_path / "metrics-elsewhere"
    target.write_text("")
    (linked / rundir.METRICS).symlink_to(target)
    rundir.remove_if_empty(linked)
    assert (linked / rundir.CHECKPOINTS).is_symlink() and (linked / rundir.METRICS).is_symlink()
    assert (user / lineage.LOCK_NAME).read_text() == "the user's" and target.exists()


@pytest.mark.parametrize("layout", [["--strategy", "pipeline", "--stages", "2"], ["--strategy", "allreduce"]])
def test_a_run_beside_links_named_like_its_debris_finishes_and_leaves_them(tmp_path, layout):
    """The issue's case: a user's archive linked back into the checkpoint directory under a parts folder's
    name, a temporary's and a checkpoint's.  The run trains, prunes and finishes (exit 0), says what it left,
    and the archive is as it was."""
    directory = tmp_path / "ck"
    directory.mkdir()
    user = archive(tmp_path)
    for name in (f"ckpt-00000001-{LINEAGE}.parts-0a", f"best-{LINEAGE}.parts-1b"):
        (directory / name).symlink_to(user)
    (directory / f".ckpt-00000001-{LINEAGE}.h5.tmp-5").symlink_to(user / "notes.txt")
    done, _ = mpidist(
        2,
        "train",
        "--model",
        "mlp:8",
        "--steps",
        "6",
        "--checkpoint-every",
        "1",
        "--keep",
        "1",
        "--eval-every",
        "0",
        "--progress",
        "none",
        "--checkpoint-dir",
        str(directory),
        "--run-dir",
        str(tmp_path / "run"),
        *layout,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "as mpidist removes only what it wrote" in done.stdout + done.stderr
    intact(user)
    assert len(list(directory.glob("ckpt-*.h5"))) == 1
    with h5py.File(next(directory.glob("ckpt-*.h5")), "r") as handle:
        assert int(handle.attrs["step"]) == 6


def test_directories_made_for_a_run_are_taken_back_only_while_they_hold_nothing_else(tmp_path):
    made = removal.make_directories(tmp_path / "a" / "b" / "c")
    assert made == [tmp_path / "a" / "b" / "c", tmp_path / "a" / "b", tmp_path / "a"]
    assert removal.make_directories(tmp_path / "a" / "b") == []  # (there already: none made)
    (tmp_path / "a" / "b" / "c" / lineage.LOCK_NAME).write_text("")
    (tmp_path / "a" / "theirs").write_text("keep")  # the user's, written meanwhile beside it
    removal.remove_made(made, own=re.compile(re.escape(lineage.LOCK_NAME)))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["theirs"]


@pytest.mark.parametrize(
    "given", [["--run-dir", "new/deep"], ["--run-dir", "", "--checkpoint-dir", "ck/deep"]]
)
def test_a_run_refused_at_start_up_leaves_no_directory_it_made(tmp_path, given):
    """Refused on every rank (a file that is not HDF5), or on one worker only after the chief opened its
    outputs (a label out of range in worker 1's shard): either way, nothing made for the run is left."""
    (tmp_path / "bad.h5").write_text("not HDF5")
    done, _ = mpidist(2, "train", "--data", str(tmp_path / "bad.h5"), *given, cwd=tmp_path)
    assert done.returncode == 2 and "not a readable HDF5 file" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.h5"]
    labels = np.arange(100) % 3
    labels[86] = 9  # (worker 1's shard at 2 ranks)
    with h5py.File(tmp_path / "label.h5", "w") as handle:
        handle.attrs.update(name="label", num_classes=3, source="")
        handle["train/x"], handle["train/y"] = np.zeros((100, 4)), labels
        handle["test/x"], handle["test/y"] = np.zeros((6, 4)), np.arange(6) % 3
    done, _ = mpidist(2, "train", "--data", str(tmp_path / "label.h5"), *given, cwd=tmp_path)
    assert done.returncode == 2 and "mpidist: error (rank 1): " in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.h5", "label.h5"]


@pytest.mark.parametrize(
    "listed,kind",
    [
        ([{"file": "", "bytes": 0, "sha256": ""}], sharded.FORMAT),  # (a record naming no folder: it crashed)
        ([{"file": 7}], sharded.FORMAT),
        ([], "mpidist-checkpoint-3"),  # (a later mpidist's index: what it names is not known here)
    ],
)
def test_an_index_whose_parts_cannot_be_told_keeps_its_folders(tmp_path, listed, kind):
    directory = tmp_path / "ck"
    index, folder = sharded_checkpoint(directory, 1)
    with h5py.File(index, "r+") as handle:
        handle.attrs["format"] = kind
        handle.attrs[sharded.PARTS] = json.dumps(listed)
    done = parts_debris.remove_unnamed_folders(directory)
    assert done.removed == [] and folder.is_dir()
    assert done.left == [
        (folder.name, f"its index {index.stem}.h5 cannot be read: a checkpoint passed over is left as it is")
    ]


def test_a_checkpoint_directory_named_through_a_link_is_cleaned_inside_never_through_its_links(tmp_path):
    """--checkpoint-dir is often a link to scratch: the directory the user named is followed, what is in it
    never."""
    scratch = tmp_path / "scratch"
    _, folder = sharded_checkpoint(scratch, 2)
    (scratch / lineage.file_name(2, LINEAGE)).unlink()  # (an interrupted write's parts)
    stale = scratch / f".ckpt-00000003-{LINEAGE}.h5.tmp-98"
    stale.write_text("a killed writer's")
    user = archive(tmp_path)
    (scratch / f"ckpt-00000001-{LINEAGE}.parts-0a").symlink_to(user)
    (tmp_path / "ck").symlink_to(scratch)
    done = lineage.CheckpointDir(tmp_path / "ck").remove_stale_temporaries()
    assert sorted(done.removed) == sorted([stale.name, folder.name])
    assert [name for name, _ in done.left] == [f"ckpt-00000001-{LINEAGE}.parts-0a"]
    intact(user)
