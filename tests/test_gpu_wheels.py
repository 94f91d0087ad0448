"""gpu/wheels.sh without a registry: PYTHON is a stand-in whose ``pip download`` writes made-up wheels, or
fails.

A download goes to a new folder beside DIR and replaces the wheels an earlier
run wrote only once it succeeded and fits; nothing else in DIR is removed or
overwritten (issue 61, item 1).
"""

import os
import subprocess

import pytest

from conftest import ROOT

WHEELS_SH = ROOT / "gpu" / "wheels.sh"

# `-m pip download ... -d FOLDER ...`: the names in $STUB_WHEELS written into FOLDER (each holding its name,
# the first $STUB_MIB MiB of zeros where that is set), or exit 1 where it is "fail"
STUB = """#!/usr/bin/env bash
[ "$1 $2 $3" = "-m pip download" ] || exit 99
while [ $# -gt 0 ]; do
    if [ "$1" = -d ]; then folder=$2; fi
    shift
done
if [ "$STUB_WHEELS" = fail ]; then
    echo "ERROR: Could not find a version that satisfies the requirement mpich==5.0.2" >&2
    exit 1
fi
for name in $STUB_WHEELS; do printf '%s' "$name" >"$folder/$name"; done
if [ -n "${STUB_MIB:-}" ]; then head -c "${STUB_MIB}M" /dev/zero >"$folder/${STUB_WHEELS%% *}"; fi
"""

OLD = ["mpich-5.0.1-py3-none-manylinux_2_28_x86_64.whl", "mpi4py-4.1.1-cp312-cp312-manylinux_2_28_x86_64.whl"]
NEW = ["mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl", "mpi4py-4.1.2-cp312-cp312-manylinux_2_28_x86_64.whl"]


def fetch(tmp_path, wheels, folder="wheels", mib=None):
    """``gpu/wheels.sh FOLDER`` (in ``tmp_path``) with a pip that writes ``wheels`` (or fails: ``"fail"``)."""
    stub = tmp_path / "stub-python"
    if not stub.exists():
        stub.write_text(STUB)
        stub.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(stub),
        "STUB_WHEELS": wheels if isinstance(wheels, str) else " ".join(wheels),
    }
    if mib:
        env["STUB_MIB"] = str(mib)
    return subprocess.run(
        [WHEELS_SH, folder], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
    )


def tree(folder):
    """Everything under ``folder``, links not followed: ``{name: (kind, content or target)}``."""
    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.is_file():
            found[name] = ("file", path.read_bytes())
        else:
            found[name] = ("folder", None)
    return found


def wheels_in(folder):
    return sorted(path.name for path in folder.glob("*.whl"))


def error_line(done):
    """Its one line on stderr, the last (after what pip said, where it failed)."""
    ours = [line for line in done.stderr.splitlines() if line.startswith("gpu/wheels.sh: ")]
    assert len(ours) == 1 and done.stderr.endswith(ours[0] + "\n"), done.stderr
    assert ours[0].startswith("gpu/wheels.sh: error: "), done.stderr
    return ours[0]


@pytest.mark.parametrize("case", ["the download fails", "the download is over the limit"])
def test_a_download_that_fails_leaves_the_old_wheels_as_they_were(tmp_path, case):
    """The old wheels were removed before the download: a registry out of reach left none to install."""
    assert fetch(tmp_path, OLD).returncode == 0
    before = tree(tmp_path)
    done = fetch(tmp_path, "fail") if case == "the download fails" else fetch(tmp_path, NEW, mib=41)
    assert done.returncode == 1, done.stdout + done.stderr
    line = error_line(done)
    assert line.endswith("wheels left as it was"), line
    assert ("pip download failed (exit 1)" if case == "the download fails" else "over the 40 MiB") in line
    assert tree(tmp_path) == before  # (the download's own folder gone with it)


def test_a_download_replaces_only_the_wheels_an_earlier_run_wrote(tmp_path):
    """It removed every ``*.whl`` in DIR by its name alone: a user's wheel, a link to one."""
    assert fetch(tmp_path, OLD).returncode == 0
    folder = tmp_path / "wheels"
    (folder / "mine-1.0-py3-none-any.whl").write_text("the user's wheel")
    (folder / "notes.txt").write_text("the user's notes")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "theirs-1.0-py3-none-any.whl").write_text("a wheel elsewhere")
    (folder / "theirs-1.0-py3-none-any.whl").symlink_to(
        tmp_path / "elsewhere" / "theirs-1.0-py3-none-any.whl"
    )
    (tmp_path / "outside.whl").write_text("beside the folder")
    with open(folder / ".wheels.sh-wrote", "a") as listed:  # (the list is a file like any other)
        listed.write("../outside.whl\nnotes.txt\n.wheels.sh-wrote\n")
    done = fetch(tmp_path, NEW)
    assert done.returncode == 0, done.stdout + done.stderr
    assert wheels_in(folder) == sorted(NEW + ["mine-1.0-py3-none-any.whl", "theirs-1.0-py3-none-any.whl"])
    assert (folder / "mine-1.0-py3-none-any.whl").read_text() == "the user's wheel"
    assert (folder / "notes.txt").read_text() == "the user's notes"
    assert os.readlink(folder / "theirs-1.0-py3-none-any.whl") == str(
        tmp_path / "elsewhere" / "theirs-1.0-py3-none-any.whl"
    )
    assert (tmp_path / "elsewhere" / "theirs-1.0-py3-none-any.whl").read_text() == "a wheel elsewhere"
    assert (tmp_path / "outside.whl").read_text() == "beside the folder"
    assert sorted((folder / ".wheels.sh-wrote").read_text().split()) == sorted(NEW)
    notes = [line for line in done.stderr.splitlines() if line.startswith("gpu/wheels.sh: note: left ")]
    assert len(notes) == 3 and all("which it did not write" in note for note in notes), done.stderr
    assert sum("check.sh installs every wheel" in note for note in notes) == 2, done.stderr
    assert done.stdout == "gpu/wheels.sh: 2 wheels, 0 MiB, in wheels (Python 3.12)\n"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "outside.whl", "stub-python", "wheels"]


def test_a_wheel_is_never_written_over_a_file_it_did_not_write(tmp_path):
    """The same bytes under a new wheel's name are taken as that wheel; other bytes are left, and said so."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / NEW[0]).write_text(NEW[0])  # (what the download brings)
    (folder / NEW[1]).write_text("something else under that name")
    done = fetch(tmp_path, NEW)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"another {NEW[1]} that this script did not write" in done.stderr.splitlines()[-1]
    assert (folder / NEW[1]).read_text() == "something else under that name"
    assert (folder / ".wheels.sh-wrote").read_text().split() == [NEW[0]]


@pytest.mark.parametrize("case", ["a link", "a file", "two folders"])
def test_a_dir_it_may_not_use_is_refused_with_nothing_changed(tmp_path, case):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "kept-1.0-py3-none-any.whl").write_text("a wheel through the link")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "notes.txt").write_text("the user's notes")
    before = tree(tmp_path)
    folder, message = {
        "a link": ("link/", f"link is a symbolic link (to {tmp_path / 'real'}): name the folder itself"),
        "a file": ("notes.txt", "notes.txt exists and is not a folder"),
        "two folders": (["one", "two"], "one DIR at most, not 2 arguments (usage: gpu/wheels.sh [DIR])"),
    }[case]
    stub = tmp_path / "stub-python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    before["stub-python"] = ("file", STUB.encode())
    done = subprocess.run(
        [WHEELS_SH, *([folder] if isinstance(folder, str) else folder)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": str(stub), "STUB_WHEELS": " ".join(NEW)},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert error_line(done) == f"gpu/wheels.sh: error: {message}"
    assert tree(tmp_path) == before
