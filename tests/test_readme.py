"""The README is the user's manual: it must stay true to the code."""

import dataclasses
import re

import pytest

from conftest import ROOT
from mpidist.config import RunConfig
from mpidist.nn import MODELS

README = (ROOT / "README.rst").read_text()


def test_ci_runs_the_readmes_test_command_verbatim():
    command = next(line.strip() for line in README.splitlines() if "python -m pytest" in line and "venv" in line)
    assert command in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", ["README.rst", "slurm/README"])
def test_the_manuals_render_without_a_warning(path):
    """A malformed table or section renders as an error message in the middle of the manual."""
    import io

    import docutils.core
    warnings = io.StringIO()
    docutils.core.publish_string((ROOT / path).read_text(), writer="null",
                                 settings_overrides={"warning_stream": warnings, "report_level": 1})
    assert warnings.getvalue() == ""


def test_every_flag_and_its_default_is_documented():
    for field in dataclasses.fields(RunConfig):
        flag = "--" + RunConfig.flag(field.name)
        row = next((line for line in README.splitlines() if re.match(rf"``{flag}``\s{{2,}}``", line)), None)
        assert row is not None, f"{flag} is not in the README's flag table"
        default = field.default if field.default != "" else "''"
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert f"``{shown}``" in row, f"{flag}: README row does not show the default {shown}"


def test_every_zoo_model_is_documented():
    for name in MODELS:
        assert re.search(rf"^``{re.escape(name)}``\s", README, re.MULTILINE), name


def test_the_stated_accuracy_is_the_one_the_tests_assert():
    from test_cli import STATED_ACCURACY
    assert f"at least {STATED_ACCURACY:.0%} test accuracy" in README


def test_the_schedule_pictures_are_what_the_schedule_functions_draw():
    from mpidist.parallel.schedule import render
    for name in ("gpipe", "1f1b"):
        picture = "\n".join("    " + line for line in render(name, 4, 8).splitlines())
        assert f"    {name}\n{picture}\n" in README


def fault_table():
    """The rows ``(case, exit code, what happens)`` of the README's table of faults."""
    section = README.split("What mpidist does when something goes wrong\n")[1]
    lines = section.splitlines()
    borders = [index for index, line in enumerate(lines) if line.startswith("=====")]
    return [re.split(r"\s{2,}", line, maxsplit=2) for line in lines[borders[1] + 1:borders[2]]]


def test_the_fault_table_is_the_tested_catalogue():
    """Each row of the README's table is a row of tests/test_faults.py, with its exit code, and back."""
    from test_faults import FAULTS
    rows = fault_table()
    assert [row[0] for row in rows] == list(FAULTS)
    assert [int(row[1]) for row in rows] == [fault.code for fault in FAULTS.values()]
    assert len(rows) >= 20
