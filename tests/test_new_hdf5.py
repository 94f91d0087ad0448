"""New HDF5 files (mpidist.store.new_hdf5): whole when the disk has room; one OSError, and a process that
exits cleanly, when it has not (issue 41, item 6)."""

import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from mpidist.store import new_hdf5

from conftest import ROOT, child_environ
from writes import left_aside, made_up_calibration, one_line_and_no_traceback, run_hooked

STORED_CHECKPOINT = ROOT / "tests" / "checkpoints" / "format1-mlp8-digits.h5"


def test_a_file_written_through_the_guard_is_an_ordinary_hdf5_file(tmp_path):
    values = np.random.default_rng(0).random((3000, 20)).astype(np.float32)
    with new_hdf5.created(tmp_path / "a.h5", alignment_threshold=1 << 16, alignment_interval=4096) as handle:
        handle.create_dataset("x", data=values, chunks=(300, 20), compression="gzip")
        handle.attrs["name"] = "a"
    with h5py.File(tmp_path / "a.h5", "r") as handle:
        assert handle.attrs["name"] == "a" and np.array_equal(handle["x"][...], values)


# Each writer of HDF5 files, in a process whose files may not grow past a limit (as a disk with that much
# free): the write must fail with the file system's OSError, and the process must then exit as it chooses (0
# here). With h5py's own file driver the failure came at the close, and the process died at its exit (exit
# 139).
WRITERS = {
    "new_hdf5.created": """
        from mpidist.store import new_hdf5
        with new_hdf5.created(folder / "a.h5") as handle:
            handle.create_dataset("x", data=np.ones((30000, 20), np.float32), chunks=(3000, 20))
    """,
    "ingest's dataset file": """
        from mpidist.tools.dataset_file import write_dataset
        splits = {"train": (np.random.default_rng(0).random((30000, 20), np.float32), np.zeros(30000, int)),
                  "test": (np.ones((10, 20), np.float32), np.zeros(10, int))}
        write_dataset(folder / "a.h5", "a", splits, 3, "test")
    """,
    "a checkpoint": """
        from mpidist.store import checkpoint
        checkpoint.save(folder, np.ones(100000, np.float32), {"m": np.ones(100000, np.float32)},
                        1, 1, 0, 1, "{}",
                        0, 1, lineage="0badcafe")
    """,
    "a checkpoint's part": """
        from mpidist.store import sharded
        sharded.write_part(folder / "part.h5", np.zeros((1, 4), np.int64),
                           {"params": np.ones(100000, np.float32)})
    """,
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_the_disk_refuses_is_one_oserror_and_the_process_exits_cleanly(tmp_path, writer):
    script = tmp_path / "write.py"
    script.write_text(
        textwrap.dedent("""
        import errno, os, resource, signal, sys
        from pathlib import Path
        import numpy as np
        from mpidist.runtime.errors import RunError, UsageError
        folder = Path(sys.argv[1])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        try:
    """)
        + textwrap.indent(textwrap.dedent(WRITERS[writer]), "    ")
        + textwrap.dedent("""
        except OSError as err:
            print("failed:", errno.errorcode[err.errno])
        except (RunError, UsageError) as err:
            print("failed:", err)
        print("left:", sorted(name for name in os.listdir(folder) if name != "write.py"))
    """)
    )
    (tmp_path / "out").mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_environ(PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failed: EFBIG" in done.stdout or "File too large" in done.stdout, done.stdout
    # (writers aside remove theirs)
    assert "left: []" in done.stdout or writer == "new_hdf5.created", done.stdout
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


# Every command that writes a file, where no file may grow past ``limit`` bytes: one line naming the file,
# exit 2, nothing aside, the previous file as it was.  (command line, output, limit, what the line says)
COMMANDS = {
    "ingest": (["ingest", "synthetic:30000,20,3", "out.h5"], "out.h5", 200_000, "the dataset"),
    "ingest, a few KiB free": (["ingest", "synthetic:30000,20,3", "out.h5"], "out.h5", 4096, "the dataset"),
    "ingest lee-text": (["ingest", "lee-text", "out.h5"], "out.h5", 20_000, "the dataset"),
    "ingest --shard-size": (
        ["ingest", "synthetic:30000,20,3", "shards", "--shard-size", "10000"],
        "shards",
        200_000,
        "the dataset",
    ),
    "predict --output .h5": (
        ["predict", str(STORED_CHECKPOINT), "--output", "p.h5"],
        "p.h5",
        4096,
        "the predictions",
    ),
    "predict --output .csv": (
        ["predict", str(STORED_CHECKPOINT), "--output", "p.csv"],
        "p.csv",
        4096,
        "the predictions",
    ),
    "predict --output .npy": (
        ["predict", str(STORED_CHECKPOINT), "--output", "p.npy"],
        "p.npy",
        200,
        "the predictions",
    ),
    "plan --output": (
        ["plan", "--calibration", "c.json", "--link", "25GB/s,2us", "--output", "plan.json"],
        "plan.json",
        1000,
        "the results",
    ),
    "plan --calibrate": (
        ["plan", "--calibrate", "--seconds", "0.1", "--calibration", "cal.json"],
        "cal.json",
        1000,
        "the calibration",
    ),
    # (the disk full from the start: the run it times fails first, writing its scratch run directory)
    "plan --calibrate, before the calibration": (
        ["plan", "--calibrate", "--seconds", "0.1", "--calibration", "cal.json"],
        "cal.json",
        1000,
        "settings.toml",
    ),
}


@pytest.mark.parametrize("case", list(COMMANDS))
def test_every_command_on_a_full_disk_says_so_in_one_line_and_keeps_the_previous_file(tmp_path, case):
    args, output, limit, what = COMMANDS[case]
    made_up_calibration(tmp_path)
    if output != "shards":
        (tmp_path / output).write_text("the previous file")
    # (once measured: the calibration's write)
    hook = "fsize" if case != "plan --calibrate" else "fsize-at-save"
    done = run_hooked(tmp_path, f"{hook}={limit}", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_line_and_no_traceback(done.stderr)
    wanted = (
        f"cannot write {what} (File too large)"
        if what.endswith(".toml")
        else f"{output}: cannot write {what} there: File too large"
    )
    assert wanted in line, line
    assert not left_aside(tmp_path), left_aside(tmp_path)
    if output == "shards":
        assert not (tmp_path / output).exists()
    else:
        assert (tmp_path / output).read_text() == "the previous file"


def test_no_module_but_new_hdf5_writes_an_hdf5_file_on_disk_through_h5py_itself():
    """Every writer goes through :func:`mpidist.store.new_hdf5.created` (a new one too): h5py's own driver is
    for reading, and for the in-memory image of arrays (no disk to fill)."""
    import ast

    allowed = {"mpidist/store/new_hdf5.py", "mpidist/data/arrays.py"}
    found = []
    for path in sorted((ROOT / "mpidist").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "File"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "h5py"
            ):
                mode = (
                    node.args[1]
                    if len(node.args) > 1
                    else next((k.value for k in node.keywords if k.arg == "mode"), None)
                )
                if not (isinstance(mode, ast.Constant) and mode.value == "r") and name not in allowed:
                    found.append(f"{name}:{node.lineno}")
    assert not found, f"HDF5 files written with h5py's own driver (use new_hdf5.created): {found}"
