"""gpu/check.sh, the GPU check a lent GPU machine runs in one call, run here without a GPU so that it cannot
rot.

Here it installs the wheels gpu/wheels.sh fetches (for this interpreter) into a
scratch prefix, runs ``info`` and the CPU reference of every strategy and
layout, and reports the GPU steps as not run.
"""

import importlib.util
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT

GPU = ROOT / "gpu"


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _check_module()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    """The wheels gpu/wheels.sh fetches, for this interpreter (the GPU machine's is 3.12)."""
    folder = tmp_path_factory.mktemp("wheels")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    done = subprocess.run(
        [GPU / "wheels.sh", folder],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MPIDIST_WHEELS_PYTHON": version, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stderr
    return folder


def test_without_a_gpu_the_check_runs_every_cpu_step_and_reports_the_gpu_steps_not_run(
    wheels, tmp_path, monkeypatch
):
    out = tmp_path / "out"  # given relative to where the check starts, as a user would
    done = subprocess.run(
        [GPU / "check.sh", "out"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "MPIDIST_GPU_WHEELS": str(wheels), "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpu"] is False
    assert summary["total_limit_s"] < 8 * 60
    parts = {part["part"]: part for part in summary["parts"]}
    assert [
        parts[name]["status"]
        for name in ("install", "gpu", "info", "unit tests", "strategies", "resume", "benchmark")
    ] == ["pass", "not run", "pass", "not run", "not run", "not run", "not run"]
    # the MPI the check runs is the one it installed from the wheels, not this environment's
    library = next(row for row in parts["info"]["rows"] if row.startswith("MPI library"))
    assert "/mpidist-gpu." in library, library
    rows = parts["strategies"]["rows"]
    assert [row["strategy"] for row in rows] == [case for case, _, _ in check.CASES]
    assert all(row["cpu reference"] == "ok" and row["verdict"] == "not run" for row in rows)
    text = (out / "summary.txt").read_text()
    for name in (
        "allreduce",
        "ps-sync",
        "ps-async",
        "local-sgd",
        "pipeline (1f1b)",
        "pipeline --schedule gpipe",
        "hybrid",
        "--tensor",
        "pipeline x tensor",
        "--shard",
    ):
        assert f"strategy {name}" in text
    # each CPU reference trained: six finite losses and a checkpoint, in float32 and float64
    # its mpiexec
    monkeypatch.setenv("PATH", f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    for dtype in ("float32", "float64"):
        losses, params = check.train(out, "probe", 2, ["--strategy", "allreduce"], "cpu", dtype, 120)
        assert len(losses) == 6 and np.all(np.isfinite(losses)) and params.size > 0
    # the resume part's runs: the reader takes steps 4 to 6 from the writer's step-3 checkpoint and ends
    # where the writer, which never stopped, ended
    losses, params = check.resume_runs(out, "cpu", "float64", 240)
    (writer, _, _), _ = check.RESUME
    final = sorted((check.run_dir_of(out, writer, "cpu", "float64") / "ck").glob("ckpt-00000006*.h5"))[0]
    with h5py.File(final, "r") as file:
        never_stopped = np.asarray(file["params"])
    assert len(losses) == 3 and np.allclose(params, never_stopped, rtol=0, atol=1e-9)


def test_the_check_stops_with_a_message_where_there_are_no_wheels(tmp_path):
    done = subprocess.run(
        [GPU / "check.sh", tmp_path / "out"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MPIDIST_GPU_WHEELS": str(tmp_path)},
    )
    assert done.returncode == 2
    assert "run gpu/wheels.sh" in done.stderr


def _run(losses, params):
    return np.array(losses, dtype=np.float64), np.array(params, dtype=np.float64)


def test_a_gpu_run_passes_within_float32_rounding_of_the_cpu_and_fails_beyond_it():
    exact = _run([2.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    cpu = _run([2.0 * (1 + 1e-5), 1.0], [1.0, 1.0, 1.0, 1.0])  # float32 costs 1e-5 of the loss here
    near = _run([2.0 * (1 + 5e-5), 1.0], [1.0, 1.0, 1.0, 1.0])  # 4e-5 off the CPU: under 10x rounding
    far = _run([2.0 * (1 + 5e-4), 1.0], [1.0, 1.0, 1.0, 1.0])  # 4.9e-4 off: over it
    row = check.compare("allreduce", near, cpu, exact)
    assert row["verdict"] == "pass"
    assert row["loss bound"] == pytest.approx(
        check.ROUNDING_FACTOR * np.linalg.norm(cpu[0] - exact[0]) / np.linalg.norm(exact[0])
    )
    assert row["params bound"] == check.FLOOR  # no rounding at all: the floor
    assert check.compare("allreduce", far, cpu, exact)["verdict"] == "fail"
    nan = _run([2.0, float("nan")], [1.0, 1.0, 1.0, 1.0])
    assert check.compare("allreduce", nan, cpu, exact)["verdict"] == "fail"
    assert check.compare("allreduce", _run([2.0], [1.0]), cpu, exact)["verdict"] == "fail"


def test_an_asynchronous_run_is_compared_on_its_first_step_alone():
    case = "ps-async (ps on the host)"
    assert case in check.FIRST_STEP_ONLY
    exact = _run([2.0, 1.0], [1.0, 1.0])
    later_differs = _run([2.0, 0.5], [3.0, 1.0])
    assert check.compare(case, later_differs, exact, exact)["verdict"] == "pass"
    assert check.compare(case, _run([2.5, 1.0], [1.0, 1.0]), exact, exact)["verdict"] == "fail"
    assert check.compare(case, _run([2.0, float("inf")], [1.0, 1.0]), exact, exact)["verdict"] == "fail"


def test_a_part_that_breaks_is_reported_failed_with_its_log(tmp_path, monkeypatch):
    # the benchmark's program missing: each of its runs exits non-zero, the GPU or not (the last one said)
    monkeypatch.setattr(check, "HERE", tmp_path / "nowhere")
    part = check.benchmark_part(tmp_path, True).as_dict()
    assert part["status"] == "fail"
    assert "see bench-precision.log" in part["reason"]
    assert "bench.py" in (tmp_path / "bench-models.log").read_text()


def test_a_check_that_cannot_start_a_program_reports_why(tmp_path):
    code, _ = check.run([str(tmp_path / "no-such-program")], 10, tmp_path / "log")
    assert isinstance(code, str) and "could not start" in code


def test_a_program_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    marker = tmp_path / "child"
    script = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        f"'import time; time.sleep(60)']); open({str(marker)!r}, 'w').close(); time.sleep(60)"
    )
    code, seconds = check.run([sys.executable, "-c", script], 4, tmp_path / "log")
    assert code is None and seconds < 15
    assert marker.exists()
    survivors = subprocess.run(
        ["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True
    ).stdout.split()
    assert not survivors


def _load(name):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


out_folder = _load("out_folder")


def _tree(folder):
    """Everything under ``folder`` as it is, links not followed: ``{path: (kind, content or target)}``."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            found[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            found[str(path)] = ("file", path.read_bytes())
        else:
            found[str(path)] = ("folder", None)
    return found


def _bad_out(tmp_path, case):
    """``(check.sh's arguments, what its one line must say)`` for one OUT the check may not fill."""
    (tmp_path / "notes.txt").write_text("the user's notes")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "summary.txt").write_text("the user's summary")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    return {
        "an existing file": (["notes.txt"], "OUT notes.txt: it exists and is a regular file, not a folder"),
        "a link to a folder": (["link"], f"OUT link: it is a symbolic link (to {tmp_path / 'elsewhere'})"),
        "a folder of the user's files": (
            ["results"],
            "OUT results: it holds 1 file(s) the check did not write (summary.txt)",
        ),
        "a path under a file": (["notes.txt/out"], "OUT notes.txt/out: cannot make it: Not a directory"),
        "a place no one may write": (["/proc/mpidist/out"], "OUT /proc/mpidist/out: cannot make it"),
        "an option": (["--out"], "unknown option --out"),
        "two folders": (["one", "two"], "one OUT folder at most, not 2 arguments"),
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "an existing file",
        "a link to a folder",
        "a folder of the user's files",
        "a path under a file",
        "a place no one may write",
        "an option",
        "two folders",
    ],
)
def test_an_out_the_check_may_not_fill_is_refused_in_one_line_before_anything_is_written(tmp_path, case):
    """It ran on past the shell's errors into pip and a traceback (a file), or wrote its logs and summary
    wherever a link pointed and over a user's files; now: exit 2, one line, nothing installed or written."""
    arguments, message = _bad_out(tmp_path, case)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "fake-1.0-py3-none-any.whl").write_text("not a wheel: never installed")
    before = _tree(tmp_path)
    done = subprocess.run(
        [GPU / "check.sh", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "MPIDIST_GPU_WHEELS": str(tmp_path / "wheels"), "PYTHON": sys.executable},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("gpu/check.sh: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr and done.stdout == ""
    assert _tree(tmp_path) == before


def test_check_py_refuses_an_out_that_is_a_file_in_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("the user's notes")
    done = subprocess.run(
        [
            sys.executable,
            GPU / "check.py",
            "--out",
            "notes.txt",
            "--install-exit",
            "0",
            "--install-seconds",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (
        "gpu/check.py: error: --out notes.txt: it exists and is a regular file, not a folder: name a folder\n"
    )
    assert (tmp_path / "notes.txt").read_text() == "the user's notes"


def test_out_is_made_where_missing_and_a_folder_the_check_wrote_is_claimed_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made = out_folder.claim("new/sub")
    assert made == tmp_path / "new" / "sub" and (made / out_folder.MARK).is_file()
    (made / "summary.txt").write_text("an earlier check's")
    assert out_folder.claim(made) == made  # (its own: written again)
    (tmp_path / "empty").mkdir()
    assert out_folder.claim("empty") == tmp_path / "empty"
    assert sorted(os.listdir(tmp_path / "empty")) == [out_folder.MARK]  # (nothing left aside)


def test_out_that_cannot_be_written_in_is_refused_and_what_was_made_for_it_removed(tmp_path):
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked").chmod(0o555)
    try:
        if os.access(tmp_path / "locked", os.W_OK):  # (root writes there all the same: so may the check)
            assert out_folder.claim(tmp_path / "locked" / "a" / "b").is_dir()
        else:
            with pytest.raises(out_folder.Refused, match="cannot make it: Permission denied"):
                out_folder.claim(tmp_path / "locked" / "a" / "b")
            assert os.listdir(tmp_path / "locked") == []
    finally:
        (tmp_path / "locked").chmod(0o755)
    (tmp_path / "marked").mkdir()
    (tmp_path / "marked" / out_folder.MARK).mkdir()  # (a folder where the mark goes: it cannot be written)
    with pytest.raises(out_folder.Refused, match="cannot write in it: Is a directory"):
        out_folder.claim(tmp_path / "marked")
    assert os.listdir(tmp_path / "marked") == [out_folder.MARK]


def test_a_run_folder_of_an_earlier_check_is_removed_never_through_a_link(tmp_path):
    """OUT/runs, or a run's folder, that is a symbolic link (to the user's files) is refused, not followed:
    the check removed the run folder it led to before making it again."""
    out, user = tmp_path / "out", tmp_path / "user"
    mine = user / check.run_dir_of(out, "local", "cpu", "float32").name  # (where OUT/runs leads)
    mine.mkdir(parents=True)
    (mine / "keep.txt").write_text("the user's")
    out.mkdir()
    (out / "runs").symlink_to(user)
    why = check.train(out, "local", 1, [], "cpu", "float32", 30)
    assert isinstance(why, str) and "is a symbolic link, which the check never follows" in why
    assert (mine / "keep.txt").read_text() == "the user's"
