"""One rule for every output mpidist writes (issue 41, item 7): a symbolic link at the output is replaced
itself, and the file it points to -- anywhere, outside the chosen directory -- is never written; a file that
is appended to (the metrics, a run's log, a checkpoint directory's lock) refuses a link."""

import json
import os

import pytest

from mpidist.runtime.errors import UsageError

from conftest import mpidist


@pytest.fixture
def linked(tmp_path):
    """``make(name)``: ``tmp_path/out/name``, a link to ``tmp_path/elsewhere/victim`` (which holds
    ``keep``)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    victim = tmp_path / "elsewhere" / "victim"

    def make(name):
        victim.write_text("keep")
        link = tmp_path / "out" / name
        link.unlink(missing_ok=True)
        link.symlink_to(victim)
        return link

    make.victim = victim
    return make


def replaced_itself(link, victim):
    assert not link.is_symlink() and link.is_file(), "the link was written through, not replaced"
    assert victim.read_text() == "keep", "the file the link pointed to was written"


def test_bench_and_plan_results_replace_a_link_itself(linked):
    from mpidist.bench.output import check_output, write_results

    link = linked("plan.json")
    check_output(str(link))
    write_results(str(link), {"rows": [1]})
    replaced_itself(link, linked.victim)
    assert json.loads(link.read_text()) == {"rows": [1]}


def test_a_calibration_file_replaces_a_link_itself(linked):
    from mpidist.plan import calibration
    from test_plan import made_up

    link = linked("c.json")
    calibration.save(made_up(), link)
    replaced_itself(link, linked.victim)
    assert calibration.load(link) == made_up()


def test_a_claimed_output_replaces_a_link_itself_even_to_a_pipe_or_a_directory(linked, tmp_path):
    from mpidist.store import outputs

    for name, target in (("to-file.h5", None), ("to-pipe.h5", "pipe"), ("to-dir.h5", "dir")):
        link = linked(name)
        if target == "pipe":
            link.unlink()
            os.mkfifo(tmp_path / "elsewhere" / "pipe")
            link.symlink_to(tmp_path / "elsewhere" / "pipe")
        elif target == "dir":
            link.unlink()
            (tmp_path / "elsewhere" / "dir").mkdir()
            link.symlink_to(tmp_path / "elsewhere" / "dir")
        with outputs.claimed(link, "the predictions") as claim:
            claim.write(lambda aside: aside.write_text("new"))
        assert not link.is_symlink() and link.read_text() == "new"
    assert linked.victim.read_text() == "keep"
    assert (tmp_path / "elsewhere" / "dir").is_dir() and os.path.exists(tmp_path / "elsewhere" / "pipe")


def test_a_link_planted_at_the_aside_name_is_never_written_through(linked, tmp_path):
    from mpidist.store import atomic, outputs

    final = tmp_path / "out" / "preds.h5"
    os.symlink(linked.victim, atomic.aside_path(final))
    linked.victim.write_text("keep")
    with outputs.claimed(final, "the predictions") as claim:
        claim.write(lambda aside: aside.write_text("new"))
    assert final.read_text() == "new" and linked.victim.read_text() == "keep"
    os.symlink(linked.victim, atomic.aside_path(final))
    with atomic.replacing(final) as aside:
        aside.write_text("newer")
    assert final.read_text() == "newer" and linked.victim.read_text() == "keep"


def test_a_figure_replaces_a_link_itself(linked):
    from mpidist.tools.plotting import new_figure, save_png

    link = linked("loss.png")
    figure, _ = new_figure(1)
    save_png(figure, link)
    replaced_itself(link, linked.victim)


def test_the_run_settings_replace_a_link_and_an_appended_file_refuses_one(linked, tmp_path):
    from mpidist.loop.metrics import MetricsLog
    from mpidist.store import lineage, rundir, settings_file
    from mpidist.settings.config import Settings

    link = linked(rundir.SETTINGS)
    settings_file.write_settings(Settings(), str(tmp_path / "out"))
    replaced_itself(link, linked.victim)
    metrics = linked("m.jsonl")
    with pytest.raises(UsageError, match="is a symbolic link; mpidist appends to a file itself"):
        MetricsLog(str(metrics))
    lock = linked(lineage.LOCK_NAME)
    with pytest.raises(UsageError, match="it is a symbolic link, which mpidist never writes through"):
        lineage.DirectoryLock(tmp_path / "out").acquire()
    assert linked.victim.read_text() == "keep" and metrics.is_symlink() and lock.is_symlink()


def test_train_predict_and_ingest_replace_links_and_refuse_a_linked_log(linked, tmp_path):
    """Through the commands: a run directory whose settings.toml is a link, predict and ingest outputs."""
    run = tmp_path / "out"
    settings = linked("settings.toml")
    done, _ = mpidist(
        1,
        "train",
        "--steps",
        "2",
        "--run-dir",
        str(run),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    replaced_itself(settings, linked.victim)
    (checkpoint,) = (tmp_path / "ck").glob("ckpt-*.h5")
    for command, name in (
        (["predict", str(checkpoint), "--output"], "p.csv"),
        (["ingest", "synthetic:50,3,2"], "d.h5"),
    ):
        link = linked(name)
        done, _ = mpidist(1, *command, str(link), timeout=120)
        assert done.returncode == 0, done.stderr
        replaced_itself(link, linked.victim)
    log = linked("log.txt")
    done, _ = mpidist(
        1,
        "train",
        "--steps",
        "2",
        "--run-dir",
        str(run),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--resume",
        "auto",
        timeout=120,
    )
    assert (
        done.returncode == 2
        and "log.txt is a symbolic link, which appending would write through" in done.stderr
    ), done.stderr
    assert log.is_symlink() and linked.victim.read_text() == "keep"
