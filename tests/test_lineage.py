"""A checkpoint directory shared by runs: lineages, pruning only one's own, the lock, stale temporary
files."""

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
    return checkpoint.save(
        directory,
        np.full(4, float(step)),
        {"m": np.zeros(4)},
        step,
        step,
        0,
        step,
        "{}",
        seed=0,
        workers=1,
        lineage=run,
        parent=parent,
    )


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
    assert names(tmp_path) == [
        "ckpt-00000010-bbbbbbbb.h5",
        "ckpt-00000015-bbbbbbbb.h5",
        "ckpt-00000060-aaaaaaaa.h5",
        "ckpt-00000065-aaaaaaaa.h5",
        "ckpt-00000066-aaaaaaaa.h5",
    ]
    assert CheckpointDir(tmp_path).prune("bbbbbbbb", keep=0, newest=newest) == []  # 0 keeps everything


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
    started = claim(settings(tmp_path, new_lineage=True), None)  # the lock was given back: a new claim works
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
        DirectoryLock(tmp_path).acquire().release()  # the kernel dropped the dead holder's lock
    finally:
        holder.kill()
        holder.wait()


def test_temporary_files_of_killed_writers_are_removed_by_the_next_claim(tmp_path):
    write(tmp_path, 5, "aaaaaaaa")
    (tmp_path / ".ckpt-00000010-aaaaaaaa.h5.tmp-4242").write_bytes(b"x" * 100)
    (tmp_path / "notes.txt").write_text("kept")
    claimed = claim(
        settings(tmp_path, resume="auto"), checkpoint.load(tmp_path / "ckpt-00000005-aaaaaaaa.h5")
    )
    claimed.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".mpidist-lock",
        "ckpt-00000005-aaaaaaaa.h5",
        "notes.txt",
    ]
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
    assert [e.step for e in place.entries()] == [99_999_999, 100_000_000, 100_000_001]  # not by the names
    assert place.newest_of("0000abcd").step == 100_000_001
    place.prune("0000abcd", keep=2, newest=place.newest_of("0000abcd").path)
    assert names(tmp_path) == ["ckpt-100000000-0000abcd.h5", "ckpt-100000001-0000abcd.h5"]
    # a trailing newline, or a step of more digits than any checkpoint may have, names no checkpoint
    assert (
        lineage.parse_name("ckpt-00000066.h5\n") is None and lineage.parse_name(f"ckpt-{'9' * 20}.h5") is None
    )


def test_a_lineage_attribute_with_a_newline_is_refused_when_loaded(tmp_path):
    import h5py

    path = write(tmp_path, 5, "0000abcd")
    with h5py.File(path, "a") as handle:
        handle.attrs["lineage"] = "0000abcd\n"
    with pytest.raises(UsageError, match="a lineage id is 8 hex digits"):
        checkpoint.load(path)


# -- special files under a checkpoint's name (issue 41, item 2) ---------------------------------------------
class WatchedFifo:
    """A named pipe at ``path`` that records whether anyone opened it to read, without letting them hang.

    A process of its own (h5py holds Python's lock while it opens a file, so a thread could not run) keeps
    trying to open the write end without blocking, which succeeds only while a reader waits on the other: it
    then counts the opening and closes, so the reader reads end-of-file and goes on.  The code under test must
    never have opened it: on the old code the test fails instead of hanging.
    """

    WATCH = (
        "import os, sys, time\n"
        "path, opened = sys.argv[1], 0\n"
        "while not os.path.exists(path + '.stop'):\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))\n"
        "        opened += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.005)\n"
        "print(opened)\n"
    )

    def __init__(self, path):
        self.path = path
        os.mkfifo(path)
        self.watcher = subprocess.Popen(
            [sys.executable, "-c", self.WATCH, str(path)], stdout=subprocess.PIPE, text=True
        )

    def stop(self):
        """How many times it was opened to read."""
        open(f"{self.path}.stop", "w").close()
        out, _ = self.watcher.communicate(timeout=30)
        os.unlink(f"{self.path}.stop")
        return int(out)


def special_files(directory, step=4, run="abcdef01"):
    """A pipe, a socket, a directory and a link to a pipe, each named like a checkpoint of ``run``."""
    import socket

    fifo = WatchedFifo(directory / lineage.file_name(step, run))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(directory / lineage.file_name(step + 1, run)))
    (directory / lineage.file_name(step + 2, run)).mkdir()
    (directory / lineage.file_name(step + 3, run)).symlink_to(fifo.path)
    return fifo, unix


def test_a_pipe_socket_or_directory_named_like_a_checkpoint_is_no_checkpoint(tmp_path):
    fifo, unix = special_files(tmp_path)
    try:
        place = CheckpointDir(tmp_path)
        assert place.entries() == [] and place.last_written() is None and place.latest_lineage() is None
        assert lineage.newest_checkpoint(tmp_path) is None
        assert checkpoint.newest_valid(tmp_path) == (None, [])
        claim(settings(tmp_path), None).release()  # a fresh run: nothing there is another run's checkpoint
        newest = write(tmp_path, 1, "abcdef01")
        assert [e.path for e in place.entries("abcdef01")] == [newest]
        assert lineage.newest_checkpoint(tmp_path) == newest
        newer = write(tmp_path, 9, "abcdef01")
        assert place.prune("abcdef01", keep=1, newest=newer) == [newest]
        assert names(tmp_path) == [lineage.file_name(step, "abcdef01") for step in (4, 5, 6, 7, 9)]
    finally:
        assert fifo.stop() == 0, "a pipe named like a checkpoint was opened"
        unix.close()


def test_the_indexes_read_for_parts_folders_and_a_claim_never_open_a_pipe(tmp_path):
    from mpidist.store import parts_debris

    fifos = [WatchedFifo(tmp_path / "ckpt-00000004-abcdef01.h5"), WatchedFifo(tmp_path / "best-abcdef01.h5")]
    (tmp_path / ".ckpt-00000003-abcdef01.h5.tmp-12").mkdir()  # a directory is never removed as a temporary
    try:
        assert (
            parts_debris.naming(tmp_path).named == set()
            and parts_debris.naming(tmp_path, "best-*.h5").named == set()
        )
        assert parts_debris.remove_unnamed_folders(tmp_path).removed == []
        claim(settings(tmp_path, resume="auto"), None).release()
        assert checkpoint.settings_of(fifos[0].path) is None
        with pytest.raises(UsageError, match=r"cannot be read: it is a named pipe \(FIFO\), not a file"):
            checkpoint.load(fifos[0].path)
    finally:
        assert [fifo.stop() for fifo in fifos] == [0, 0]


def test_a_run_beside_a_pipe_named_like_a_checkpoint_finishes(tmp_path):
    """The pipe hung every run after its first checkpoint (the claim and the pruning opened it); now every
    run, --resume auto, fresh or --new-lineage, passes over it and leaves it as it was."""
    import stat

    from conftest import mpidist

    directory = tmp_path / "D"
    directory.mkdir()
    os.mkfifo(directory / "ckpt-00000004-abcdef01.h5")
    common = [
        "train",
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        "1",
        "--keep",
        "1",
        "--steps",
        "3",
        "--run-dir",
        "",
        "--metrics",
        "",
    ]
    best = ["--resume", "auto", "--steps", "6", "--keep-best", "val_loss", "--val-fraction", "0.1"]
    for extra in (["--resume", "auto"], ["--new-lineage"], best):
        done, _ = mpidist(2, *common, *extra, timeout=60)
        assert done.returncode == 0, done.stderr
    assert stat.S_ISFIFO(os.stat(directory / "ckpt-00000004-abcdef01.h5").st_mode)
    written = [entry for entry in CheckpointDir(directory).entries()]
    assert sorted(entry.step for entry in written) == [3, 6] and list(directory.glob("best-*.h5"))


def test_a_dataset_directory_with_a_pipe_named_like_a_part_is_refused(tmp_path):
    from mpidist import data

    learnable = np.random.default_rng(0).random((40, 3))
    from mpidist.tools.ingest import write_dataset

    write_dataset(
        tmp_path / "a.h5",
        "a",
        {"train": (learnable[:30], np.arange(30) % 2), "test": (learnable[30:], np.arange(10) % 2)},
        2,
        "test",
    )
    fifo = WatchedFifo(tmp_path / "b.h5")
    try:
        with pytest.raises(UsageError, match=r"b.h5 is a named pipe \(FIFO\), not a file"):
            data.inspect(tmp_path)
    finally:
        assert fifo.stop() == 0
