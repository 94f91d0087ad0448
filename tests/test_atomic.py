"""Files written whole or not at all (mpidist.store.atomic)."""

import os

import pytest

from mpidist.store import atomic


def test_a_file_written_aside_replaces_the_old_one_whole(tmp_path):
    final = tmp_path / "results.json"
    final.write_text("old")
    with atomic.replacing(final) as aside:
        assert aside.parent == tmp_path and aside.name == f".results.json.tmp-{os.getpid()}"
        aside.write_text("new")
        assert final.read_text() == "old"  # nothing visible until the body returns
    assert final.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_failing_write_leaves_the_old_file_and_no_aside(tmp_path):
    final = tmp_path / "ckpt.h5"
    final.write_text("old")
    with pytest.raises(OSError, match="disk full"):
        with atomic.replacing(final) as aside:
            aside.write_text("half")
            raise OSError(28, "disk full")
    assert final.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.h5"]


def test_a_failing_rename_leaves_the_target_and_no_aside(tmp_path):
    final = tmp_path / "taken"
    (final / "inside").mkdir(parents=True)  # a non-empty directory: the rename over it fails
    with pytest.raises(OSError):
        with atomic.replacing(final) as aside:
            aside.write_text("new")
    assert final.is_dir() and (final / "inside").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_data_is_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    final, calls = tmp_path / "settings.toml", []
    monkeypatch.setattr(atomic, "sync_file", lambda path: calls.append(("file", path.name, final.exists())))
    monkeypatch.setattr(
        atomic, "sync_directory", lambda path: calls.append(("directory", path, final.exists()))
    )
    with atomic.replacing(final) as aside:
        aside.write_text("x = 1\n")
    assert calls == [("file", aside.name, False), ("directory", tmp_path, True)]
