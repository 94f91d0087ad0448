"""examples/ run as users run them, under mpiexec; a model of one's own through the command line."""

import importlib.util
import re
import shutil

import pytest

from conftest import ROOT, checkpoint_at, checkpoint_steps, mpidist, run_mpi

EXAMPLES = ROOT / "examples"


def accuracy(stdout, name):
    """The test accuracy (percent) an example prints on its last line, ``name: ... test accuracy X%``."""
    found = re.search(rf"^{name}: .*test accuracy ([\d.]+)%$", stdout, re.MULTILINE)
    assert found, stdout
    return float(found.group(1))


@pytest.mark.parametrize(
    "flags",
    [
        ["--strategy", "allreduce"],
        ["--strategy", "ps-sync", "--ps", "1"],
        ["--strategy", "ps-async", "--ps", "1"],
        ["--strategy", "pipeline", "--stages", "2"],
    ],
    ids=["allreduce", "ps-sync", "ps-async", "pipeline"],
)
def test_a_layer_of_ones_own_trains_under_every_strategy_at_4_ranks(flags):
    done, _ = run_mpi(4, [str(EXAMPLES / "custom_layer.py"), *flags], timeout=120)
    assert done.returncode == 0, done.stderr
    assert accuracy(done.stdout, "custom_layer") >= 95.0  # 98.3-98.6% measured; mlp on digits: ~97%
    assert "custom_layer: PReLU's gradients match finite differences" in done.stdout


def test_the_example_layers_gradient_check_catches_a_wrong_backward():
    """The example's check, on its PReLU with the slope's gradient summed over the wrong sign: named,
    refused."""
    from mpidist import nn

    spec = importlib.util.spec_from_file_location("custom_layer_example", EXAMPLES / "custom_layer.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    nn.check_gradients(example.PReLU(), input_shape=(8,))

    class Wrong(example.PReLU):
        def backward(self, dy):
            dx = super().backward(dy)
            self.grads["alpha"][...] = (dy * self.xp.maximum(self.x, 0)).sum(axis=0)  # the positive part
            return dx

    with pytest.raises(nn.GradientError, match=r"parameter 'alpha'\[\d+\] of layer 0 \(Wrong\(\)\)"):
        nn.check_gradients(Wrong(), input_shape=(8,))


@pytest.mark.parametrize(
    "name,least", [("custom_model", 95.0), ("arrays", 95.0), ("early_stopping", 95.0), ("predict", 95.0)]
)
def test_every_example_runs_at_2_ranks(name, least, tmp_path):
    done, _ = run_mpi(2, [str(EXAMPLES / f"{name}.py")], timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # where it ran: the run directories of its runs (runs/, holding their checkpoints), or nothing where its
    # checkpoints went to a temporary directory it removed (a run directory without them would name files
    # gone)
    left = sorted(path.name for path in tmp_path.iterdir())
    assert left == ([] if name == "predict" else ["runs"]), left
    assert all((run / "checkpoints").is_dir() for run in tmp_path.glob("runs/*")), list(
        tmp_path.glob("runs/*/*")
    )
    assert accuracy(done.stdout, name) >= least
    if name == "early_stopping":  # before the last of its 60 epochs, as a finished run
        assert re.search(r"stopped early at step \d+", done.stdout), done.stdout
        assert "ended (done)" in done.stdout


def test_a_builder_file_given_to_the_cli_trains_checkpoints_resumes_elsewhere_and_evaluates(tmp_path):
    """allreduce on 2 ranks -> ps-sync with a ps on 3 -> eval on 2, from another working directory."""
    model = f"{EXAMPLES / 'custom_layer.py'}:build"
    ck = tmp_path / "ck"
    common = ["--model", model, "--checkpoint-dir", str(ck), "--progress", "none", "--metrics", ""]
    first, _ = mpidist(2, "train", "--epochs", "2", *common, timeout=120)
    assert first.returncode == 0, first.stderr
    second, _ = mpidist(
        3,
        "train",
        "--epochs",
        "4",
        "--strategy",
        "ps-sync",
        "--ps",
        "1",
        "--resume",
        "auto",
        *common,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "ckpt-00000044-" in second.stdout
    assert checkpoint_steps(ck)[-1] == 88
    newest = checkpoint_at(ck, 88)
    evaluated, _ = mpidist(2, "eval", str(newest), cwd=tmp_path, timeout=60)
    assert evaluated.returncode == 0, evaluated.stderr
    shown = re.search(r"test accuracy ([\d.]+)%", evaluated.stdout)
    assert shown and float(shown.group(1)) >= 90.0
    # the run's own figure
    assert re.search(r"test accuracy\s+" + re.escape(shown.group(1)) + "%", second.stdout)


def test_a_checkpoint_whose_builder_file_moved_says_so_with_exit_code_2(tmp_path):
    moved = tmp_path / "mine.py"
    shutil.copy(EXAMPLES / "custom_layer.py", moved)
    ck = tmp_path / "ck"
    done, _ = mpidist(
        2,
        "train",
        "--model",
        f"{moved}:build",
        "--steps",
        "5",
        "--checkpoint-dir",
        str(ck),
        "--progress",
        "none",
        "--metrics",
        "",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    moved.rename(tmp_path / "elsewhere.py")
    evaluated, _ = mpidist(2, "eval", str(next(ck.glob("ckpt-*.h5"))), timeout=60)
    assert evaluated.returncode == 2
    assert evaluated.stderr.count("no such file") == 1, evaluated.stderr
    assert (
        "the model it names cannot be rebuilt" in evaluated.stderr
        and "give the new one with --model" in evaluated.stderr
    )
    again, _ = mpidist(
        2,
        "eval",
        str(next(ck.glob("ckpt-*.h5"))),
        "--model",
        f"{tmp_path / 'elsewhere.py'}:build",
        timeout=60,
    )
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    "spec,message",
    [
        ("mlp:0", "positive integers"),
        ("mlp:", "positive integers"),
        ("linear:3", "takes no arguments"),
        ("nosuch", "not in the zoo"),
        ("no_such_module_here:build", "cannot import no_such_module_here"),
        ("examples/custom_layer.py:nope", "has no function 'nope'"),
        ("examples/none.py:build", "no such file"),
    ],
)
def test_a_bad_model_spec_is_one_message_and_exit_code_2(spec, message):
    done, _ = mpidist(
        2, "train", "--model", spec, "--steps", "1", "--progress", "none", "--metrics", "", cwd=ROOT
    )
    assert done.returncode == 2
    assert done.stderr.count(message) == 1, done.stderr
    assert "Traceback" not in done.stderr and "rebuilt" not in done.stderr  # (a new run restores nothing)


def test_a_callback_that_raises_ends_every_rank_with_exit_code_1(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(
        "import mpidist\n"
        "class Boom(mpidist.Callback):\n"
        "    def on_step(self, figures):\n"
        "        if figures['step'] >= 20:\n"
        "            raise ValueError('my callback failed at step %d' % figures['step'])\n"
        "try:\n"
        "    mpidist.train('mlp', 'digits', callbacks=[Boom()], progress='none', metrics='')\n"
        "except ValueError:\n"
        "    pass   # a script that catches it must not leave the other ranks waiting\n"
    )
    done, seconds = run_mpi(2, [str(script)], timeout=60)
    assert done.returncode == 1
    assert "ValueError: my callback failed at step 20" in done.stderr
    assert seconds < 30


def test_sys_exit_in_one_ranks_layer_ends_every_rank_with_its_code(tmp_path):
    """A user's sys.exit() on one rank, inside the run: the others were left waiting for it (found by a
    hostile sweep); the job now ends with its code and says why."""
    script = tmp_path / "exiting.py"
    script.write_text(
        "import sys\n"
        "import mpidist\n"
        "from mpi4py import MPI\n"
        "from mpidist import nn\n"
        "class Exiting(nn.Layer):\n"
        "    def forward(self, x, training=False):\n"
        "        if training and MPI.COMM_WORLD.Get_rank() == 1:\n"
        "            sys.exit(5)\n"
        "        return x\n"
        "    def backward(self, dy):\n"
        "        return dy\n"
        "mpidist.train(lambda s, o: [nn.Flatten(), nn.Dense(8), Exiting(), nn.Dense(o)], 'digits', steps=5,\n"
        "              progress='none', metrics='', run_dir='')\n"
    )
    done, seconds = run_mpi(2, [str(script)], timeout=60)
    assert done.returncode == 5, done.stderr
    assert "sys.exit(5) while the other ranks ran on: the job ends with it" in done.stderr
    assert seconds < 30


def test_a_script_that_imports_numpy_first_still_runs_one_blas_thread_per_core():
    # each rank prints its line in one write: two ranks' print() calls interleaved once ("threads threads1")
    probe = (
        "import sys\nimport numpy\nimport mpidist\nfrom threadpoolctl import threadpool_info\n"
        "sys.stdout.write(f\"threads {max(pool['num_threads'] for pool in threadpool_info())}\\n\")\n"
    )
    done, _ = run_mpi(2, ["-c", probe], env={"OMP_NUM_THREADS": "", "OPENBLAS_NUM_THREADS": ""})
    assert done.returncode == 0, done.stderr
    # 2 ranks on this node: each gets its cores / 2 (1 on a 2-core machine), never the whole node
    import os

    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert done.stdout.split().count("threads") == 2
    assert all(int(n) == share for n in re.findall(r"threads (\d+)", done.stdout)), done.stdout


@pytest.mark.parametrize("given", ["", "3"])
def test_ranks_a_driver_launches_size_their_own_blas_pools(given):
    """A process that imported mpidist set the BLAS variables for itself (every core, one process); the ranks
    it launches get them as it found them: unset, each rank takes its share; set by the user, they stay."""
    import os
    import subprocess
    import sys

    probe = (
        "import os, mpidist\nfrom mpidist.runtime.threads import launch_environment\n"
        "print(os.environ.get('OMP_NUM_THREADS'), launch_environment().get('OMP_NUM_THREADS'),\n"
        "      launch_environment(OMP_NUM_THREADS='7')['OMP_NUM_THREADS'])\n"
    )
    environ = {name: value for name, value in os.environ.items() if not name.endswith("_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **({"OMP_NUM_THREADS": given} if given else {})},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    own, launched, chosen = done.stdout.split()
    share = str(len(os.sched_getaffinity(0)))
    assert (own, launched) == ((share, "None") if not given else (given, given)), done.stdout
    assert chosen == "7"  # (what the driver sets for its ranks wins)


@pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None,
    reason="the char_lm example's corpus is gensim's test data (the datasets and test extras)",
)
def test_the_character_language_model_learns_the_corpus_in_a_short_run(tmp_path):
    """30 steps of the example end below the unigram entropy of the val text (3.09 nats; 2.70 measured)."""
    import h5py
    import numpy as np
    from mpidist.tools.ingest import ingest

    corpus = ingest("lee-text", tmp_path / "lee-text.h5").path
    with h5py.File(corpus) as handle:
        counts = np.bincount(handle["val/y"][...].ravel())
    share = counts[counts > 0] / counts.sum()
    unigram = float(-(share * np.log(share)).sum())  # nats per character of a model that knows no context
    done, _ = run_mpi(
        2,
        [
            str(EXAMPLES / "char_lm.py"),
            "--data",
            str(corpus),
            "--steps",
            "30",
            "--eval-samples",
            "64",
            "--generate",
            "40",
        ],
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    found = re.search(
        r"^char_lm: 30 steps, val loss ([\d.]+) nats/char \(([\d.]+) bits/char\).*\n(The .*)",
        done.stdout,
        re.MULTILINE | re.DOTALL,
    )
    assert found, done.stdout
    nats, bits = float(found.group(1)), float(found.group(2))
    assert nats < unigram - 0.2 and abs(bits - nats / np.log(2)) < 1e-3
    assert len(found.group(3).rstrip("\n")) == 4 + 40  # the prompt and the 40 characters it wrote
