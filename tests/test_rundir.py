"""Run directories: where a run's files go, what a resumed run continues, the settings written back."""

import dataclasses
import datetime
import io
import json
import os
from pathlib import Path

import pytest

from mpidist.runtime.errors import UsageError
from mpidist.settings.config import Settings
from mpidist.settings.sources import load_toml, settings_from
from mpidist.store import rundir, settings_file

from conftest import events, mpidist

NOW = datetime.datetime(2026, 11, 25, 9, 30, 5)


def test_a_run_is_named_by_model_data_and_strategy_in_safe_characters():
    config = Settings(model="mlp:256,256", data="/data/sets/big 2.h5", strategy="ps-async")
    assert rundir.run_name(config) == "mlp-256-256-big-2-ps-async"
    # a builder by its file's (or module's) name and function, not by the path that leads to it
    assert (
        rundir.run_name(Settings(model="examples/net.py:build", data="digits", strategy="allreduce"))
        == "net-build-digits-allreduce"
    )
    assert (
        rundir.run_name(
            Settings(model="/tmp/newcomer/work/my_script.py:build", data="digits", strategy="ps-sync")
        )
        == "my_script-build-digits-ps-sync"
    )
    assert (
        rundir.run_name(Settings(model="mypkg.models:build_net", data="digits", strategy="local"))
        == "models-build_net-digits-local"
    )


def test_new_run_directories_are_stamped_and_never_shared(tmp_path):
    config = Settings(strategy="allreduce")
    first = rundir.make(config, None, NOW, root=tmp_path / "runs")
    second = rundir.make(config, None, NOW, root=tmp_path / "runs")
    assert Path(first).name == "mlp-digits-allreduce-20261125-093005" and Path(first).is_dir()
    assert Path(second).name == "mlp-digits-allreduce-20261125-093005-2" and Path(second).is_dir()
    assert os.path.isabs(first)
    assert rundir.make(dataclasses.replace(config, run_dir=""), "") == ""
    given = rundir.make(config, str(tmp_path / "mine" / "deep"))
    assert given == str(tmp_path / "mine" / "deep") and Path(given).is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        UsageError, match="--run-dir .*file/run: cannot create the run directory \\(Not a directory\\)"
    ):
        rundir.make(config, str(tmp_path / "file" / "run"))
    with pytest.raises(UsageError, match="--run-dir .*file: is a file, not a directory"):
        rundir.make(config, str(tmp_path / "file"))


def fake_run(root, name, checkpoint=True):
    path = root / name
    (path / rundir.CHECKPOINTS).mkdir(parents=True)
    (path / rundir.SETTINGS).write_text("")
    if checkpoint:
        (path / rundir.CHECKPOINTS / "ckpt-00000010-0000abcd.h5").write_bytes(b"")
    return path


def test_a_dataset_file_names_its_runs_by_the_name_it_records(tmp_path):
    import h5py

    def dataset(name, value):
        with h5py.File(tmp_path / name, "w") as handle:
            if value is not None:
                handle.attrs["name"] = value
        return str(tmp_path / name)

    def named(path):
        return rundir.run_name(Settings(model="mlp", data=path, strategy="allreduce"))

    assert named(dataset("data.h5", "diabetes")) == "mlp-diabetes-allreduce"  # (ingest wrote the source's)
    assert named(dataset("none.h5", None)) == "mlp-none-allreduce"  # no name: the file's
    # untrusted: made safe and short, or the file's where nothing is left of it
    assert (
        named(dataset("odd.h5", "\x1b[2J../../etc" + "x" * 500))
        == "mlp-2J..-..-etc" + "x" * 29 + "-allreduce"
    )
    assert (
        named(dataset("bad.h5", "//..")) == "mlp-bad-allreduce"
        and named(dataset("int.h5", 7)) == "mlp-int-allreduce"
    )
    os.mkfifo(tmp_path / "pipe.h5")  # (never opened: a named pipe would wait for a writer)
    assert named(str(tmp_path / "pipe.h5")) == "mlp-pipe-allreduce"
    # --resume auto finds the runs named by the file, as they were before, and by the name
    config = Settings(model="mlp", data=str(tmp_path / "data.h5"), strategy="allreduce", resume="auto")
    older = fake_run(tmp_path / "runs", "mlp-data-allreduce-20261124-100000")
    os.chdir(tmp_path)
    assert rundir.planned(config) == str(Path("runs") / older.name)
    newer = fake_run(tmp_path / "runs", "mlp-diabetes-allreduce-20261125-100000")
    assert rundir.planned(config) == str(Path("runs") / newer.name)


def test_a_resumed_run_continues_the_run_directory_it_resumes_from(tmp_path):
    config = Settings(strategy="allreduce")
    older = fake_run(tmp_path / "runs", "mlp-digits-allreduce-20261124-100000")
    fake_run(tmp_path / "runs", "mlp-digits-allreduce-20261125-080000")
    fake_run(tmp_path / "runs", "mlp-digits-allreduce-20261125-090000", checkpoint=False)  # nothing to resume
    fake_run(tmp_path / "runs", "cnn-digits-allreduce-20261126-000000")  # another run's
    fake_run(tmp_path / "runs", "mlp-digits-allreduce-20261125-080000-9")
    newest = fake_run(tmp_path / "runs", "mlp-digits-allreduce-20261125-080000-10")  # -10 after -9
    os.chdir(tmp_path)
    assert rundir.planned(dataclasses.replace(config, resume="auto")) == str(Path("runs") / newest.name)
    checkpoint = older / rundir.CHECKPOINTS / "ckpt-00000010-0000abcd.h5"
    assert rundir.planned(dataclasses.replace(config, resume=str(checkpoint))) == str(older)
    assert rundir.planned(
        dataclasses.replace(config, resume="auto", checkpoint_dir=str(older / rundir.CHECKPOINTS))
    ) == str(older)
    assert rundir.planned(config) is None  # a new run: a new directory
    assert rundir.planned(dataclasses.replace(config, resume="auto", checkpoint_dir=str(tmp_path))) is None
    assert rundir.planned(Settings(strategy="ps-sync", resume="auto")) is None  # no run of that name yet


def test_auto_metrics_and_checkpoints_go_into_the_run_directory_and_given_ones_stay_put():
    resolved = rundir.resolved(Settings(), "/r/run")
    assert (resolved.metrics, resolved.checkpoint_dir) == ("/r/run/metrics.jsonl", "/r/run/checkpoints")
    resolved = rundir.resolved(Settings(metrics="m.jsonl", checkpoint_dir=""), "/r/run")
    assert (resolved.metrics, resolved.checkpoint_dir) == ("m.jsonl", "")
    resolved = rundir.resolved(Settings(), "")
    assert (resolved.metrics, resolved.checkpoint_dir, resolved.run_dir) == ("metrics.jsonl", "", "")
    assert (
        rundir.resume_flags(rundir.resolved(Settings(), "/r/my run")) == "--resume auto --run-dir '/r/my run'"
    )
    assert (
        rundir.resume_flags(rundir.resolved(Settings(checkpoint_dir="c"), "/r/run"))
        == "--resume auto --checkpoint-dir c"
    )


def test_the_settings_written_are_the_settings_read_back(tmp_path):
    config = Settings(
        model="mlp:64,64",
        lr=1e-05,
        clip_norm=float("inf"),
        keep_best="val_loss",
        elastic=False,
        data='odd "name"\\with\nnewline',
        seed=7,
        run_dir=str(tmp_path),
        metrics="x.jsonl",
    )
    settings_file.write_settings(config, tmp_path)
    back = settings_from(Settings(), **load_toml(str(tmp_path / rundir.SETTINGS)))
    for field in dataclasses.fields(Settings):
        if field.name not in rundir.WHERE:
            assert getattr(back, field.name) == getattr(config, field.name), field.name
    assert (back.run_dir, back.metrics) == ("auto", "auto")  # where the files went is not carried over
    assert not list(tmp_path.glob(".*tmp*"))


def test_the_log_holds_the_terminal_lines_without_the_redrawn_bar(tmp_path):
    terminal = io.StringIO()
    log = rundir.LogCopy(terminal, tmp_path / "log.txt")
    log.write("mpidist: start\n")
    log.write("\r epoch 1 [##..] step 1")
    log.write("\r epoch 1 [###.] step 2")
    log.write("\repoch   1/1  loss 0.5\n")
    log.write("mpidist: done\n  a  1\n  b")
    log.close()
    assert terminal.getvalue().count("\r") == 3
    assert (
        tmp_path / "log.txt"
    ).read_text() == "mpidist: start\nepoch   1/1  loss 0.5\nmpidist: done\n  a  1\n  b\n"


def test_a_run_writes_its_directory_and_a_resumed_one_continues_it_time_included(tmp_path):
    done, _ = mpidist(2, "train", "--epochs", "2", "--progress", "lines", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert run.name.startswith("mlp-digits-allreduce-")
    assert {p.name for p in run.iterdir()} == {"settings.toml", "metrics.jsonl", "log.txt", "checkpoints"}
    assert f"run directory        {run}" in done.stdout
    log = (run / "log.txt").read_text()
    assert "mpidist: done" in log and "\r" not in log and "epoch   2/2" in log
    first = events(run / "metrics.jsonl", "step")

    done, _ = mpidist(2, "train", "--epochs", "4", "--resume", "auto", "--progress", "none", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run.name]  # no new directory
    assert "resumed from" in done.stdout and str(run / "checkpoints") in done.stdout
    steps = events(run / "metrics.jsonl", "step")
    assert (
        len(events(run / "metrics.jsonl", "start")) == 2 and len(events(run / "metrics.jsonl", "done")) == 2
    )
    assert [s["step"] for s in steps] == sorted({s["step"] for s in steps})
    assert events(run / "metrics.jsonl", "done")[1]["steps"] == 88
    times = [s["time"] for s in steps]
    assert times == sorted(times) and times[len(first)] > first[-1]["time"]  # time goes on, not from 0

    # the settings written start the same run (in a directory of its own)
    again, _ = mpidist(2, "train", "--config", str(run / "settings.toml"), "--progress", "none", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    (other,) = set((tmp_path / "runs").iterdir()) - {run}
    assert (
        events(other / "metrics.jsonl", "done")[0]["test_loss"]
        == events(run / "metrics.jsonl", "done")[1]["test_loss"]
    )


def test_without_a_run_directory_metrics_go_where_they_did(tmp_path):
    done, _ = mpidist(2, "train", "--epochs", "1", "--run-dir", "", "--progress", "none", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    assert events(tmp_path / "metrics.jsonl", "done") and not events(tmp_path / "metrics.jsonl", "checkpoint")
    done, _ = mpidist(
        2,
        "train",
        "--epochs",
        "1",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--progress",
        "none",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["event"] == "done"
    assert not (run / "metrics.jsonl").exists() and list((run / "checkpoints").glob("ckpt-*.h5"))


def test_a_refused_run_changes_no_run_directory_and_leaves_no_new_one(tmp_path):
    done, _ = mpidist(2, "train", "--steps", "5", "--run-dir", "shared", "--progress", "none", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    settings = (tmp_path / "shared" / "settings.toml").read_text()
    log = (tmp_path / "shared" / "log.txt").read_text()
    done, _ = mpidist(
        2, "train", "--steps", "5", "--run-dir", "shared", "--lr", "0.5", "--progress", "none", cwd=tmp_path
    )
    assert done.returncode == 2 and "holds the checkpoints of another run" in done.stderr
    assert (tmp_path / "shared" / "settings.toml").read_text() == settings
    assert (tmp_path / "shared" / "log.txt").read_text() == log
    done, _ = mpidist(2, "train", "--resume", "nowhere.h5", "--progress", "none", cwd=tmp_path)
    assert done.returncode == 2 and "nowhere.h5" in done.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_a_run_refused_for_a_taken_checkpoint_directory_leaves_no_run_directory(tmp_path):
    """Refused after it opened its metrics file, the new run directory goes with the empty file."""
    done, _ = mpidist(
        2, "train", "--steps", "5", "--checkpoint-dir", "ckpt", "--progress", "none", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    first = sorted((tmp_path / "runs").iterdir())
    refused, _ = mpidist(
        2, "train", "--steps", "5", "--checkpoint-dir", "ckpt", "--progress", "none", cwd=tmp_path
    )
    assert refused.returncode == 2 and "holds the checkpoints of another run" in refused.stderr
    assert sorted((tmp_path / "runs").iterdir()) == first and (first[0] / "metrics.jsonl").stat().st_size > 0


def test_a_resume_from_a_checkpoint_directory_elsewhere_continues_the_run_directory_it_recorded(tmp_path):
    done, _ = mpidist(
        2, "train", "--epochs", "1", "--checkpoint-dir", "ckpt", "--progress", "none", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    [run] = (tmp_path / "runs").iterdir()
    first = events(run / "metrics.jsonl", "done")[-1]
    resumed, _ = mpidist(
        2,
        "train",
        "--epochs",
        "2",
        "--checkpoint-dir",
        "ckpt",
        "--resume",
        "auto",
        "--progress",
        "none",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert list((tmp_path / "runs").iterdir()) == [run]  # no new run directory
    assert [e["step"] for e in events(run / "metrics.jsonl", "start")] == [0, first["steps"]]
    steps = events(run / "metrics.jsonl", "step")
    assert steps[-1]["time"] > first["train_time"]  # its clock goes on
    # a run directory that is gone is not recreated: the resumed run gets a new one
    run.rename(tmp_path / "moved")
    again, _ = mpidist(
        2,
        "train",
        "--epochs",
        "3",
        "--checkpoint-dir",
        "ckpt",
        "--resume",
        "auto",
        "--progress",
        "none",
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    # a fresh directory (named by the time, which may be the first run's second: fast runs share one)
    [new] = (tmp_path / "runs").iterdir()
    second = events(tmp_path / "moved" / "metrics.jsonl", "done")[-1]["steps"]
    assert [e["step"] for e in events(new / "metrics.jsonl", "start")] == [second]
    assert len(events(tmp_path / "moved" / "metrics.jsonl", "start")) == 2  # the moved one is left as it was


def test_without_a_run_directory_the_run_says_where_its_metrics_go_and_what_they_follow(tmp_path):
    """Issue 63, item 11: ``--run-dir ''`` appended to ./metrics.jsonl without a word."""
    import io

    import mpidist

    said = []
    for _ in range(2):
        stream = io.StringIO()
        mpidist.train("mlp:8", "digits", steps=2, run_dir="", progress="none", eval_every=0, stream=stream)
        said.append([line for line in stream.getvalue().splitlines() if "metrics go to" in line])
    path = tmp_path / "metrics.jsonl"  # (each test runs in a directory of its own)
    assert said[0] == [f"mpidist: note: metrics go to {path} (no run directory: --run-dir '')"]
    (second,) = said[1]
    assert second.startswith(
        f"mpidist: note: metrics go to {path} (no run directory: --run-dir ''), after the "
    )
    assert "of lines already there (each run's begin with its start event" in second
    assert sum('"event": "start"' in line for line in path.read_text().splitlines()) == 2


def test_settings_that_say_something_else_are_kept_before_a_run_writes_its_own(tmp_path):
    first, second = Settings(model="mlp:8", seed=1), Settings(model="mlp:8", seed=2)
    assert settings_file.write_settings(first, tmp_path) is None  # (nothing there)
    written = (tmp_path / rundir.SETTINGS).read_bytes()
    assert settings_file.write_settings(first, tmp_path) is None  # (the same settings: nothing to keep)
    assert sorted(path.name for path in tmp_path.iterdir()) == [rundir.SETTINGS]
    assert settings_file.write_settings(second, tmp_path) == "settings-1.toml"
    assert (tmp_path / "settings-1.toml").read_bytes() == written
    (tmp_path / rundir.SETTINGS).write_text("# a user's own\nseed = 9\n")
    assert settings_file.write_settings(first, tmp_path) == "settings-2.toml"
    assert (tmp_path / "settings-2.toml").read_text() == "# a user's own\nseed = 9\n"
    assert (tmp_path / rundir.SETTINGS).read_bytes() == written
    assert (tmp_path / "settings-1.toml").read_bytes() == written  # (each kept file left as it was)


def test_settings_are_kept_by_a_copy_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted")  # (as some network file systems answer)

    (tmp_path / rundir.SETTINGS).write_text("seed = 9\n")
    (tmp_path / "settings-1.toml").write_text("an earlier one\n")
    monkeypatch.setattr(settings_file.os, "link", no_links)
    assert settings_file.write_settings(Settings(model="mlp:8"), tmp_path) == "settings-2.toml"
    assert (tmp_path / "settings-2.toml").read_text() == "seed = 9\n"
    assert (tmp_path / "settings-1.toml").read_text() == "an earlier one\n"


@pytest.mark.parametrize("name", ["settings.toml", "log.txt", "trace.json"])
def test_metrics_that_name_another_of_the_run_directorys_files_are_refused(tmp_path, name):
    """Metrics appended to the run's settings (kept aside as settings-1.toml when the run wrote its own) or
    interleaved with its log (found by a hostile sweep)."""
    where = tmp_path / "run"
    config = Settings(metrics=str(where / name))
    with pytest.raises(UsageError, match=f"--metrics .*: is the run directory's {name}, which the run"):
        rundir.make(config, str(where))
    assert not where.exists()  # (refused before it was made)
    assert rundir.make(Settings(metrics=str(where / "mine.jsonl")), str(where)) == str(where)
