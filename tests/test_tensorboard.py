"""--tensorboard: event files that hold the figures of metrics.jsonl."""

import importlib.util
import math
import struct
import subprocess
import sys

import pytest

from conftest import events, mpidist

# (found, not imported: importing tensorboardX here made every collection of the suite, each MPI rank's too,
# import torch)
if importlib.util.find_spec("tensorboardX") is None:
    pytest.skip("the tensorboard extra", allow_module_level=True)


def event_protos():
    """tensorboardX's Event protos, imported as mpidist imports the package: without torch."""
    from mpidist.loop.tensorboard import require

    require()
    from tensorboardX.proto import event_pb2

    return event_pb2


def read_scalars(directory):
    """``{tag: {step: value}}`` of every event file in ``directory`` (TFRecord framing, Event protos)."""
    event_pb2 = event_protos()
    scalars = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            # (length, its crc, data, crc)
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_event_files_hold_the_figures_of_the_metrics(tmp_path):
    done, _ = mpidist(
        2,
        "train",
        "--epochs",
        "2",
        "--tensorboard",
        "--val-fraction",
        "0.1",
        "--progress",
        "none",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (run,) = (tmp_path / "runs").iterdir()
    scalars = read_scalars(run)
    steps = events(run / "metrics.jsonl", "step")
    assert len(steps) == 4 and scalars["train/loss"].keys() == {s["step"] for s in steps}
    for step in steps:
        for name, tag in [
            ("loss", "train/loss"),
            ("lr", "lr"),
            ("samples_per_s", "samples_per_s"),
            ("train_accuracy", "train/accuracy"),
        ]:
            assert scalars[tag][step["step"]] == pytest.approx(step[name], rel=1e-6), (tag, step)
    for evaluation in events(run / "metrics.jsonl", "eval"):
        for name, value in evaluation.items():
            if name.startswith(("test_", "val_")) and isinstance(value, float) and math.isfinite(value):
                tag = name.replace("_", "/", 1)
                assert scalars[tag][evaluation["step"]] == pytest.approx(value, rel=1e-6), tag
    assert "val/accuracy" in scalars and "test/accuracy" in scalars
    # the start line counts the validation rows --val-fraction carved out; the summary names the event files
    assert "digits (1294 train / 144 val / 359 test)" in done.stdout
    assert f"tensorboard          {run} (tensorboard --logdir {run})" in done.stdout


def test_per_rank_figures_go_in_too(tmp_path):
    done, _ = mpidist(
        3,
        "train",
        "--epochs",
        "1",
        "--strategy",
        "ps-async",
        "--ps",
        "1",
        "--tensorboard",
        "--run-dir",
        str(tmp_path),
        "--progress",
        "none",
    )
    assert done.returncode == 0, done.stderr
    scalars = read_scalars(tmp_path)
    final = events(tmp_path / "metrics.jsonl", "done")[0]
    ps = next(role for role in final["roles"] if role["role"] == "ps")
    assert scalars[f"ps/{ps['rank']}/updates"][final["steps"]] == ps["updates"]
    workers = [role for role in final["roles"] if "staleness_mean" in role]
    assert workers and all(f"worker/{w['rank']}/staleness_mean" in scalars for w in workers)


def test_without_the_package_the_flag_names_it_and_every_rank_exits_2(tmp_path):
    (tmp_path / "tensorboardX.py").write_text("raise ImportError('not installed')\n")
    done, _ = mpidist(
        2,
        "train",
        "--epochs",
        "1",
        "--tensorboard",
        "--progress",
        "none",
        cwd=tmp_path,
        env={"PYTHONPATH": f"{tmp_path}:{__import__('conftest').ROOT}"},
    )
    assert done.returncode == 2
    assert (
        done.stderr.count("--tensorboard needs the tensorboardX package: pip install 'mpidist[tensorboard]'")
        == 1
    )
    assert "Traceback" not in done.stderr


def test_the_writer_comes_without_torch_and_leaves_torch_importable():
    """tensorboardX imports torch wherever it is installed, seconds of a run's start-up for tensors mpidist
    never writes: mpidist imports it without, and leaves no block behind (``import torch`` works after)."""
    code = (
        "import sys\n"
        "from mpidist.loop.tensorboard import require\n"
        "require()\n"
        "print('torch' in sys.modules, sys.modules.get('torch', 'unblocked'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines() == ["False unblocked"], done.stderr
