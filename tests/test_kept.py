"""No output a user names replaces the command's own input, a run's file or a checkpoint."""

import pytest

from mpidist.runtime.errors import UsageError
from mpidist.store.kept import RUN_FILES, refuse_kept


def test_an_output_that_is_an_input_by_path_link_or_hard_link_is_refused(tmp_path):
    source = tmp_path / "calibration.json"
    source.write_text("{}")
    (tmp_path / "hard.json").hardlink_to(source)
    (tmp_path / "link.json").symlink_to(source)
    for output in (
        source,
        tmp_path / "." / "calibration.json",
        tmp_path / "hard.json",
        tmp_path / "link.json",
    ):
        with pytest.raises(UsageError, match=r"--output .*: is .*calibration.json, an input of this command"):
            refuse_kept(output, "--output", [source])
    refuse_kept(tmp_path / "plan.json", "--output", [source])  # (another file: written)


@pytest.mark.parametrize("name", ["ckpt-00000066-3fa2c1d0.h5", "ckpt-00000066.h5"])
def test_an_output_named_as_a_checkpoint_is_refused_existing_or_not(tmp_path, name):
    with pytest.raises(UsageError, match=r"is named as a checkpoint is \(ckpt-<step>.h5\)"):
        refuse_kept(tmp_path / name, "ingest: the output")
    refuse_kept(tmp_path / "ckpt-notes.h5", "ingest: the output")


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_runs_own_files_are_refused_where_a_run_wrote_them(tmp_path, name):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "start"}\n')
    (run / name).write_text("kept\n")
    with pytest.raises(UsageError, match=f"an existing {name}, the file a run keeps its .* in"):
        refuse_kept(run / name, "--output")
    assert (run / name).read_text() == "kept\n"
    # (a log of that name where no run keeps its files, or another name: written)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "log.txt").write_text("mine\n")
    refuse_kept(tmp_path / "elsewhere" / "log.txt", "--output")
    refuse_kept(run / "results.json", "--output")
    # (settings and metrics are refused wherever they are: --run-dir '' keeps its metrics anywhere)
    with pytest.raises(UsageError, match="an existing metrics.jsonl"):
        (tmp_path / "elsewhere" / "metrics.jsonl").write_text("{}\n")
        refuse_kept(tmp_path / "elsewhere" / "metrics.jsonl", "--output")
