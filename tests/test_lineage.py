"""A checkpoint directory shared by runs: lineages, pruning only one's own, the lock, stale temporary files."""

import os
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from mpidist.runtime.errors import UsageError
from mpidist.store import checkpoint, lineage
from mpidist.store.lineage import CheckpointDir, DirectoryLock, claim


def write(directory, step, run, parent=""):
    return checkpoint.save(directory, np.full(4, float(step)), {"m": np.zeros(4)}, step, step, 0, step, "{}",
                           seed=0, workers=1, lineage=run, parent=parent)


def settings(directory, resume="", new_lineage=False):
    return types.SimpleNamespace(checkpoint_dir=str(directory), resume=resume, new_lineage=new_lineage)


def names(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("ckpt-"))


def test_a_run_prunes_only_its_own_lineage_and_never_the_file_it_just_wrote(tmp_path):
    for step in (60, 65, 66):
        write(tmp_path, step, "aaaaaaaa")
    for step in (5, 10, 15):
        newest = write(tmp_path, step, "bbbbbbbb")
        CheckpointDir(tmp_path).prune("bbbbbbbb", keep=2, newest=newest)
    assert names(tmp_path) == ["ckpt-00000010-bbbbbbbb.h5", "ckpt-00000015-bbbbbbbb.h5",
                               "ckpt-00000060-aaaaaaaa.h5", "ckpt-00000065-aaaaaaaa.h5", "ckpt-00000066-aaaaaaaa.h5"]
    assert CheckpointDir(tmp_path).prune("bbbbbbbb", keep=0, newest=newest) == []   # 0 keeps everything


def test_resume_auto_follows_the_lineage_written_last_past_its_unreadable_files(tmp_path):
    write(tmp_path, 66, "aaaaaaaa")
    time.sleep(0.01)
    write(tmp_path, 5, "bbbbbbbb")
    time.sleep(0.01)
    cut = write(tmp_path, 10, "bbbbbbbb")
    cut.write_bytes(cut.read_bytes()[:300])
    os.utime(cut)
    loaded, skipped = checkpoint.newest_valid(tmp_path)
    assert (loaded.step, loaded.lineage) == (5, "bbbbbbbb") and [p.name for p, _ in skipped] == [cut.name]


def test_a_fresh_run_in_a_directory_of_another_run_is_refused_with_the_ways_on(tmp_path):
    write(tmp_path, 66, "aaaaaaaa")
    with pytest.raises(UsageError) as refused:
        claim(settings(tmp_path), None)
    message = str(refused.value)
    assert "holds the checkpoints of another run" in message and "ckpt-00000066-aaaaaaaa.h5" in message
    assert all(way in message for way in ("--resume auto", "another --checkpoint-dir", "--new-lineage"))
    started = claim(settings(tmp_path, new_lineage=True), None)   # the lock was given back: a new claim works
    assert started.lineage not in ("", "aaaaaaaa") and "beside 1 checkpoint(s)" in started.notes[0]
    started.release()


def test_resuming_the_newest_continues_its_lineage_and_an_older_one_branches(tmp_path):
    write(tmp_path, 15, "aaaaaaaa")
    write(tmp_path, 66, "aaaaaaaa")
    newest = claim(settings(tmp_path, resume="auto"), checkpoint.load(tmp_path / "ckpt-00000066-aaaaaaaa.h5"))
    assert (newest.lineage, newest.parent, newest.notes) == ("aaaaaaaa", None, [])
    newest.release()
    older = claim(settings(tmp_path, resume="x"), checkpoint.load(tmp_path / "ckpt-00000015-aaaaaaaa.h5"))
    assert older.lineage != "aaaaaaaa" and older.parent == "aaaaaaaa" and "branching" in older.notes[0]
    older.release()


def test_files_of_older_versions_form_a_lineage_of_their_own(tmp_path):
    write(tmp_path, 20, "")
    assert names(tmp_path) == ["ckpt-00000020.h5"]
    resumed = claim(settings(tmp_path, resume="auto"), checkpoint.load(tmp_path / "ckpt-00000020.h5"))
    assert resumed.lineage == ""
    resumed.release()


HOLD = """
import sys, time
from mpidist.store.lineage import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_two_live_runs_cannot_share_a_directory_and_a_dead_holder_keeps_no_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"is in use by another run \(pid {holder.pid} on "):
            DirectoryLock(tmp_path).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        DirectoryLock(tmp_path).acquire().release()   # the kernel dropped the dead holder's lock
    finally:
        holder.kill()
        holder.wait()


def test_temporary_files_of_killed_writers_are_removed_by_the_next_claim(tmp_path):
    write(tmp_path, 5, "aaaaaaaa")
    (tmp_path / ".ckpt-00000010-aaaaaaaa.h5.tmp-4242").write_bytes(b"x" * 100)
    (tmp_path / "notes.txt").write_text("kept")
    claimed = claim(settings(tmp_path, resume="auto"), checkpoint.load(tmp_path / "ckpt-00000005-aaaaaaaa.h5"))
    claimed.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".mpidist-lock", "ckpt-00000005-aaaaaaaa.h5",
                                                          "notes.txt"]
    assert "removed 1 temporary file(s)" in claimed.notes[0]


def test_lineage_ids_in_names_round_trip():
    assert lineage.parse_name(lineage.file_name(66, "3fa2c1d0")) == (66, "3fa2c1d0")
    assert lineage.parse_name("ckpt-00000066.h5") == (66, "")
    assert lineage.parse_name("ckpt-66.h5") is None and lineage.parse_name("ckpt-00000066-xyz.h5") is None


def test_steps_past_eight_digits_are_found_and_ordered_by_number_and_names_match_whole(tmp_path):
    for step in (99_999_999, 100_000_000, 100_000_001):
        write(tmp_path, step, "0000abcd")
    assert lineage.file_name(100_000_000, "0000abcd") == "ckpt-100000000-0000abcd.h5"
    assert lineage.parse_name("ckpt-100000000-0000abcd.h5") == (100_000_000, "0000abcd")
    place = CheckpointDir(tmp_path)
    assert [e.step for e in place.entries()] == [99_999_999, 100_000_000, 100_000_001]   # not by the names
    assert place.newest_of("0000abcd").step == 100_000_001
    place.prune("0000abcd", keep=2, newest=place.newest_of("0000abcd").path)
    assert names(tmp_path) == ["ckpt-100000000-0000abcd.h5", "ckpt-100000001-0000abcd.h5"]
    # a trailing newline, or a step of more digits than any checkpoint may have, names no checkpoint
    assert lineage.parse_name("ckpt-00000066.h5\n") is None and lineage.parse_name(f"ckpt-{'9' * 20}.h5") is None


def test_a_lineage_attribute_with_a_newline_is_refused_when_loaded(tmp_path):
    import h5py
    path = write(tmp_path, 5, "0000abcd")
    with h5py.File(path, "a") as handle:
        handle.attrs["lineage"] = "0000abcd\n"
    with pytest.raises(UsageError, match="a lineage id is 8 hex digits"):
        checkpoint.load(path)
