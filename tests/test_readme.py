"""The README and docs/ are the user's manual: they must stay true to the code."""

import dataclasses
import re

import pytest

from mpidist.nn import MODELS
from mpidist.settings.config import Settings

from conftest import ROOT

README = (ROOT / "README.rst").read_text()
DOCS = {path.name: path.read_text() for path in sorted((ROOT / "docs").glob("*.rst"))}
MANUAL = README + "\n".join(DOCS.values())


def test_ci_runs_the_readmes_test_command_verbatim():
    command = next(
        line.strip() for line in README.splitlines() if "python -m pytest" in line and "venv" in line
    )
    assert command in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", ["README.rst", "slurm/README"])
def test_the_manuals_render_without_a_warning(path):
    """A malformed table or section renders as an error message in the middle of the manual."""
    import io

    import docutils.core

    warnings = io.StringIO()
    docutils.core.publish_string(
        (ROOT / path).read_text(),
        writer="null",
        settings_overrides={"warning_stream": warnings, "report_level": 1},
    )
    assert warnings.getvalue() == ""


def test_every_flag_and_its_default_is_documented():
    for field in dataclasses.fields(Settings):
        flag = "--" + Settings.flag(field.name)
        row = next(
            (line for line in DOCS["commands.rst"].splitlines() if re.match(rf"``{flag}``\s{{2,}}``", line)),
            None,
        )
        assert row is not None, f"{flag} is not in the flag table of docs/commands.rst"
        default = field.default if field.default != "" else "''"
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert f"``{shown}``" in row, f"{flag}: README row does not show the default {shown}"


def test_every_zoo_model_is_documented():
    for name in MODELS:
        assert re.search(rf"^``{re.escape(name)}``\s", DOCS["models.rst"], re.MULTILINE), name


def test_the_stated_accuracy_is_the_one_the_tests_assert():
    from test_cli import STATED_ACCURACY

    assert f"at least {STATED_ACCURACY:.0%} test accuracy" in README


def test_the_schedule_pictures_are_what_the_schedule_functions_draw():
    from mpidist.parallel.pipeline.schedule import render

    for name in ("gpipe", "1f1b"):
        picture = "\n".join("    " + line for line in render(name, 4, 8).splitlines())
        assert f"    {name}\n{picture}\n" in DOCS["strategies.rst"]


def fault_table():
    """The rows ``(case, exit code, what happens)`` of the README's table of faults."""
    section = DOCS["faults.rst"].split("What mpidist does when something goes wrong\n")[1]
    lines = section.splitlines()
    borders = [index for index, line in enumerate(lines) if line.startswith("=====")]
    return [re.split(r"\s{2,}", line, maxsplit=2) for line in lines[borders[1] + 1 : borders[2]]]


def test_the_fault_table_is_the_tested_catalogue():
    """Each row of the README's table is a row of tests/test_faults.py, with its exit code, and back."""
    from test_faults import FAULTS

    rows = fault_table()
    assert [row[0] for row in rows] == list(FAULTS)
    assert [int(row[1]) for row in rows] == [fault.code for fault in FAULTS.values()]
    assert len(rows) >= 20


def test_the_docs_build_without_a_warning(tmp_path):
    """Sphinx with warnings as errors: a broken reference or docstring fails here, not on a user's screen."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(ROOT / "docs"),
            str(tmp_path / "html"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "html" / "api.html").read_text().count("mpidist.train") > 0


def test_the_readmes_example_trains_a_layer_of_its_own_on_4_ranks(tmp_path):
    from conftest import run_mpi

    block = README.split("Your own model\n")[1].split("::\n\n", 1)[1].splitlines()
    end = next(index for index, line in enumerate(block) if line and not line.startswith("    "))
    lines = [line[4:] for line in block[:end]]
    assert lines[0] == "import mpidist"
    script = tmp_path / "my_script.py"
    script.write_text("\n".join(lines) + "\n")
    runs = tmp_path / "runs"
    done, _ = run_mpi(4, [str(script)], timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    accuracy = float(done.stdout.rsplit("test accuracy ", 1)[1].split("%")[0])
    assert accuracy >= 95.0
    assert done.stdout.count("mpidist: done") == 1 and len(list(runs.iterdir())) == 1  # it trained once
    # the same file as --model: loading it defines the builder and trains nothing; the command trains once
    cli, _ = run_mpi(
        4,
        ["-m", "mpidist", "train", "--model", f"{script}:build", "--epochs", "2"],
        timeout=120,
        cwd=tmp_path,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.count("mpidist: done") == 1 and len(list(runs.iterdir())) == 2
    # (the command's run, not the file's)
    assert "ps-sync" not in cli.stdout.split("mpidist: done")[0].splitlines()[0]


def test_a_builder_file_that_trains_when_loaded_is_refused_with_the_fix(tmp_path):
    from conftest import mpidist

    block = README.split("Your own model\n")[1].split("::\n\n", 1)[1].splitlines()
    end = next(index for index, line in enumerate(block) if line and not line.startswith("    "))
    lines = [line[4:] for line in block[:end]]
    guard = next(index for index, line in enumerate(lines) if line.startswith("if __name__"))
    unguarded = lines[:guard] + [line[4:] for line in lines[guard + 1 :]]  # the training at module level
    script = tmp_path / "trains_when_loaded.py"
    script.write_text("\n".join(unguarded) + "\n")
    refused, _ = mpidist(2, "train", "--model", f"{script}:build", "--epochs", "1", cwd=tmp_path, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("calls mpidist.train() when it is loaded") == 1, refused.stderr
    assert 'if __name__ == "__main__":' in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing trained


def test_the_readmes_commands_write_nothing_into_the_checkout():
    """Run verbatim from a fresh clone, the README's commands leave ``git status`` clean: what they write goes
    to new paths, or to ``runs/`` (ignored), never over a tracked file or into a tracked folder."""
    import subprocess
    from pathlib import Path

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = {str(Path(name).parent) for name in tracked.splitlines()} - {"."}
    text = (ROOT / "README.rst").read_text()
    written = re.findall(r"(?:--output|--run-dir|--checkpoint-dir) (\S+)", text)
    written += re.findall(r"ingest \S+ (\S+)", text)
    assert "runs/plots" in written and len(written) >= 6, written
    for path in written:
        assert path not in tracked.splitlines() and str(Path(path).parent) not in folders, path
