"""The Python API in-process on real ranks: models of the user's own, arrays, callbacks, results.

Run under ``mpiexec -n N python -m pytest --with-mpi -m mpi`` (any N; tests
that need more ranks skip themselves).
"""

import io
import json
import re

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import data, nn
from mpidist.api import load_trained
from mpidist.data import resolve
from mpidist.tools.dataset_file import write_dataset

QUIET = dict(progress="none", metrics="", dtype="float64")


def quiet(**settings):
    return dict(QUIET, stream=io.StringIO(), **settings)


def batch_norm_net(sync):
    def build(sample_shape, outputs):
        return [
            nn.Flatten(),
            nn.Dense(16),
            nn.BatchNorm(sync=sync),
            nn.ReLU(),
            nn.Dense(outputs, init="glorot"),
        ]

    return build


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("strategy,ps", [("allreduce", 0), ("ps-sync", 1)])
def test_synchronised_batch_norm_on_every_worker_equals_one_process_on_the_global_batch(strategy, ps):
    """In-graph replication feeds the workers the one process's global batches, cut in parts."""
    world = MPI.COMM_WORLD
    if world.Get_size() - ps < 2:
        pytest.skip("needs two workers")
    common = dict(data="digits", steps=12, batch_size=64, eval_every=0)
    one = mpidist.train(batch_norm_net(True), strategy="local", comm=MPI.COMM_SELF, **quiet(**common))
    for sync in (True, False):
        many = mpidist.train(
            batch_norm_net(sync), strategy=strategy, ps=ps, replication="in-graph", **quiet(**common)
        )
        if many.is_chief:
            gap = np.abs(many.params - one.params).max()
            if sync:
                assert gap < 1e-9
            else:  # each worker normalising by its own part is a different model: the test can tell
                assert gap > 1e-6


@pytest.mark.mpi(min_size=1)
def test_arrays_in_memory_train_exactly_as_the_same_data_from_its_file():
    with h5py.File(resolve("digits"), "r") as handle:
        arrays = mpidist.ArrayData(
            train=(handle["train/x"][...], handle["train/y"][...]),
            test=(handle["test/x"][...], handle["test/y"][...]),
            name="digits-arrays",
        )
    from_file = mpidist.train("mlp", "digits", **quiet(epochs=2))
    from_arrays = mpidist.train("mlp", arrays, **quiet(epochs=2))
    if from_file.is_chief:
        assert np.array_equal(from_file.params, from_arrays.params)
        assert from_arrays.figures["test_accuracy"] == from_file.figures["test_accuracy"]


class Recorder(mpidist.Callback):
    def __init__(self, stop_at=None):
        self.seen, self.stop_at = [], stop_at

    def on_start(self, figures):
        self.seen.append(("start", figures["event"]))

    def on_step(self, figures):
        self.seen.append(("step", figures["step"]))
        if self.stop_at is not None and figures["step"] >= self.stop_at:
            self.stop()

    def on_eval(self, figures):
        self.seen.append(("eval", figures["step"], figures["test_accuracy"]))

    def on_checkpoint(self, figures):
        self.seen.append(("checkpoint", figures["step"], figures["path"]))

    def on_end(self, figures):
        self.seen.append(("end", figures["event"], figures.get("test_accuracy")))


@pytest.mark.mpi(min_size=1)
def test_callbacks_see_the_metrics_figures_on_the_chief_and_the_result_holds_the_trained_model(tmp_path):
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path), root=0)
    recorder = Recorder()
    result = mpidist.train(
        "mlp",
        "digits",
        callbacks=[recorder],
        **quiet(
            epochs=2, log_every=5, checkpoint_dir=directory, checkpoint_every=10, checkpoint_wait=True, keep=2
        ),
    )
    steps = result.figures.get("steps") if result.is_chief else None
    if not result.is_chief:
        assert recorder.seen == [] and result.params is None and result.model is None
        return
    kinds = [event[0] for event in recorder.seen]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert [e[1] for e in recorder.seen if e[0] == "step"] == list(range(5, steps + 1, 5))
    evals = [e for e in recorder.seen if e[0] == "eval"]
    assert len(evals) == 2 and evals[-1][2] == result.test_accuracy
    written = [e[2] for e in recorder.seen if e[0] == "checkpoint"]
    assert [str(p) for p in result.checkpoints] == written[-2:]  # --keep 2: the two newest are kept
    assert recorder.seen[-1] == ("end", "done", result.test_accuracy)
    # the returned model is the trained one: its accuracy on the test split is the run's
    with h5py.File(resolve("digits"), "r") as handle:
        x, y = handle["test/x"][...], handle["test/y"][...]
    predicted = result.model.forward(x.astype(np.float64)).argmax(axis=1)
    assert (predicted == y).mean() == pytest.approx(result.test_accuracy, abs=1e-12)
    with h5py.File(result.checkpoints[-1], "r") as handle:
        assert np.array_equal(handle["params"][...], result.params)


@pytest.mark.mpi(min_size=2)
def test_a_split_model_is_never_gathered_its_last_checkpoint_holds_the_result(tmp_path):
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path), root=0)
    stages = 2 if world.Get_size() % 2 == 0 else world.Get_size()  # (mlp has 6 layers: any -n the suite runs)
    result = mpidist.train(
        "mlp",
        "digits",
        strategy="pipeline",
        stages=stages,
        **quiet(steps=6, eval_every=0, checkpoint_dir=directory, checkpoint_wait=True),
    )
    assert result.params is None and result.model is None  # (on the chief too: no rank holds it whole)
    if not result.is_chief:
        return
    trained = load_trained(result.checkpoints[-1])
    with h5py.File(resolve("digits"), "r") as handle:
        x, y = handle["test/x"][...], handle["test/y"][...]
    predicted = trained.model.forward(x.astype(np.float64)).argmax(axis=1)
    assert (predicted == y).mean() == pytest.approx(result.test_accuracy, abs=1e-12)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("strategy,ps", [("auto", 0), ("ps-async", 1), ("ps-sync", 1)])
def test_a_callback_stops_every_rank_early_and_the_run_ends_as_finished(strategy, ps):
    world = MPI.COMM_WORLD
    if world.Get_size() < ps + 1:
        pytest.skip(f"needs {ps + 1} ranks")
    recorder = Recorder(stop_at=10)
    result = mpidist.train(
        "mlp", "digits", strategy=strategy, ps=ps, callbacks=[recorder], **quiet(epochs=5, log_every=2)
    )
    assert result.status == "done" and result.exit_code == 0
    if result.is_chief:
        # the request is seen at a boundary a step or two later (ps-async: the workers' next clock reads)
        assert 10 <= result.figures["steps"] <= 10 + 2 * world.Get_size()
        assert result.figures["stopped_early"] is True
        assert recorder.seen[-1][:2] == ("end", "done")


@pytest.mark.mpi(min_size=1)
def test_an_unknown_setting_is_refused_on_every_rank_with_exit_code_2():
    with pytest.raises(SystemExit) as stopped:
        mpidist.train("mlp", "digits", epoch=3, **quiet())
    assert stopped.value.code == 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differing", ["epochs", "arrays"])
def test_ranks_given_different_runs_are_refused_on_every_rank_naming_what_differs(differing, capsys):
    """One rank's epochs, or one rank's arrays: the ranks planned different runs and hung at different
    collectives (found by a hostile sweep); now every rank exits 2, rank 0 saying what differs."""
    rank = MPI.COMM_WORLD.Get_rank()
    x = np.random.default_rng(0).random((40, 4))
    if differing == "arrays" and rank == 1:
        x[-1, -1] += 1  # (the last sample's last value)
    arrays = data.ArrayData(train=(x, np.arange(40) % 2), test=(x[:8], np.arange(8) % 2))
    epochs = 2 if differing == "epochs" and rank == 1 else 1
    with pytest.raises(SystemExit) as stopped:
        mpidist.train("mlp", arrays, epochs=epochs, run_dir="", **quiet())
    assert stopped.value.code == 2
    said = capsys.readouterr().err
    if rank == 0:
        expected = (
            "--epochs is 1 on rank 0 and 2 on rank 1" if differing == "epochs" else "the train split's x"
        )
        assert "the ranks were given different runs: " + expected in said


@pytest.mark.mpi(min_size=1)
def test_layers_given_as_objects_train_and_their_spec_says_they_cannot_be_rebuilt():
    layers = [nn.Flatten(), nn.Dense(32), nn.GELU(), nn.LayerNorm(), nn.Dense(10)]
    result = mpidist.train(layers, "digits", **quiet(epochs=3))
    if result.is_chief:
        assert result.test_accuracy > 0.85
    from mpidist.settings import models

    assert models.resolve(layers).spec == models.OBJECTS  # what its checkpoints record
    with pytest.raises(mpidist.UsageError, match="cannot rebuild"):
        models.resolve(models.OBJECTS)


@pytest.mark.mpi(min_size=2)
def test_local_sgd_averaging_every_step_with_plain_sgd_on_equal_parts_is_allreduce():
    """The mean of p - lr * g_w is p - lr * mean(g_w); averaging every 4 steps is another algorithm."""
    workers = MPI.COMM_WORLD.Get_size()
    if 64 % workers:
        pytest.skip("needs equal parts of the global batch of 64")
    common = dict(steps=30, optimizer="sgd", momentum=0.0, lr=0.05, batch_size=64, eval_every=0)
    reference = mpidist.train("mlp", "digits", strategy="allreduce", **quiet(**common))
    every_step = mpidist.train("mlp", "digits", strategy="local-sgd", sync_every=1, **quiet(**common))
    every_4 = mpidist.train("mlp", "digits", strategy="local-sgd", sync_every=4, **quiet(**common))
    if reference.is_chief:
        assert np.abs(every_step.params - reference.params).max() < 1e-10
        assert np.abs(every_4.params - reference.params).max() > 1e-6
        assert every_4.figures["roles"][0]["averages"] == 30 // 4 + 1  # + one before the final evaluation


# -- load_trained: the one way a checkpoint becomes a model again (serial) -----------------------------------
@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory):
    """``(checkpoint, the Result)`` of a short digits run in this process alone."""
    directory = tmp_path_factory.mktemp("trained")
    result = mpidist.train(
        "mlp", "digits", comm=MPI.COMM_SELF, checkpoint_dir=str(directory), **quiet(steps=20)
    )
    return result.checkpoints[-1], result


def test_load_trained_gives_the_model_the_run_ended_with(digits_checkpoint):
    checkpoint, result = digits_checkpoint
    trained = load_trained(checkpoint)
    assert np.array_equal(trained.model.params, result.params)
    assert trained.spec == "mlp" and trained.step == 20 and trained.path == checkpoint
    assert trained.dataset.name == "digits" and trained.settings.steps == 20
    with h5py.File(resolve("digits"), "r") as handle:
        x = handle["test/x"][...]
    assert np.array_equal(trained.model.forward(x), result.model.forward(x))


def test_load_trained_builds_for_the_dataset_a_function_of_the_settings_names(digits_checkpoint):
    checkpoint, result = digits_checkpoint
    seen = []

    def dataset_of(settings):
        seen.append(settings.data)
        return data.inspect(data.resolve(settings.data))

    trained = load_trained(checkpoint, dataset_of)
    assert seen == ["digits"]  # (the data the run was given, as its settings record it)
    assert np.array_equal(trained.model.params, result.params)


def test_load_trained_refuses_a_dataset_the_checkpoints_parameters_do_not_fit(digits_checkpoint, tmp_path):
    checkpoint, result = digits_checkpoint
    x = np.zeros((6, 8, 8), np.float32)
    splits = {"train": (x, np.arange(6) % 3), "test": (x, np.arange(6) % 3)}
    three = write_dataset(tmp_path / "three.h5", "three", splits, 3, "test")
    with pytest.raises(mpidist.UsageError) as refused:
        load_trained(checkpoint, str(three))
    # mlp on 8x8 samples: (64*128 + 128) + (128*128 + 128) + (128*K + K) parameters for K classes
    assert result.params.size == 8320 + 16512 + 1290
    assert str(refused.value) == (
        f"{checkpoint}: holds 26122 parameters, but model mlp on 'three' has {8320 + 16512 + 387}"
    )


def token_arrays(train=256, test=64, length=8, vocab=5):
    """Sequences of ids labelled at every position by the next id, ``(id + 1) % vocab``."""
    rng = np.random.default_rng(0)

    def split(n):
        ids = rng.integers(0, vocab, (n, length))
        return ids.astype(np.float32), (ids + 1) % vocab

    return mpidist.ArrayData(train=split(train), test=split(test), name="tokens")


def causal_lm(sample_shape, outputs):
    return [
        nn.Embedding(outputs, 16),
        nn.PositionalEmbedding(sample_shape[0]),
        nn.TransformerBlock(2, causal=True),
        nn.LayerNorm(),
        nn.Dense(outputs),
    ]


@pytest.mark.mpi(min_size=1)
def test_a_language_model_trains_on_labels_per_position_and_is_scored_per_token(tmp_path):
    metrics = tmp_path / "metrics.jsonl" if MPI.COMM_WORLD.Get_rank() == 0 else None
    metrics = MPI.COMM_WORLD.bcast(metrics)
    result = mpidist.train(
        causal_lm,
        token_arrays(),
        **dict(quiet(epochs=5, optimizer="adam", lr=0.01, batch_size=32), metrics=str(metrics)),
    )
    if result.is_chief:
        assert result.test_accuracy > 0.95 and result.figures["test_loss"] < 0.2
        per_class = result.figures["test_per_class"]
        assert sum(record["support"] for record in per_class) == 64 * 8  # tokens, not samples
        steps = [
            event for event in map(json.loads, metrics.read_text().splitlines()) if event["event"] == "step"
        ]
        first, last = steps[0]["train_accuracy"], steps[-1]["train_accuracy"]  # fractions of tokens
        assert 0 < first <= last <= 1.0 and last > 0.9


@pytest.mark.mpi(min_size=1)
def test_a_classifier_of_one_label_per_sample_on_labels_per_position_is_refused_naming_both(capsys):
    def pooled(sample_shape, outputs):
        return causal_lm(sample_shape, outputs)[:-2] + [nn.SequencePool(), nn.Dense(outputs)]

    with pytest.raises(SystemExit) as stopped:
        mpidist.train(pooled, token_arrays(), **quiet(epochs=1))
    assert stopped.value.code == 2
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert re.search(
            r"outputs \(5,\) per sample, but the dataset has 8 labels per sample .*it needs outputs "
            r"\(8, 5\)",
            capsys.readouterr().err,
        )


@pytest.mark.mpi(min_size=2)
def test_the_end_of_a_run_on_one_copy_of_the_model_per_node_holds_no_copy_of_it_per_rank(monkeypatch):
    """The node's one copy of the model lives in a shared window that the end of a run frees.  Copying it
    (gradients and parameters) into every rank's own memory first lifted the node's memory at the very end
    to what per-rank buffers would hold, for values nobody reads; and the chief then built the returned
    model afresh, checking the whole training state against a limit its run still held.  From the last step
    on, a worker's peak grows by its share of the final evaluation alone; the chief's by what any checkpoint
    of the run costs it (the parameters it keeps, Adam's two arrays assembled from the node's parts) and the
    evaluation, and the model it returns is that copy (its buffer, not another)."""
    from mpidist.parallel.data.replicated import DataParallel
    from mpidist.runtime import memory

    model, params = "mlp:2048,2048", 2048 * (64 + 1) + 2049 * 2048 + 2049 * 10  # (digits: 64 features)
    at_the_end = {}
    finish = DataParallel.finish

    def measured(self, *args, **kwargs):  # (every rank, as the end of the run begins)
        memory.reset_high_water()
        at_the_end["rss"] = memory.kib_field("/proc/self/status", b"VmRSS")
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(DataParallel, "finish", measured)
    if not memory.reset_high_water():
        pytest.skip("this kernel cannot reset a process's peak (/proc/self/clear_refs)")
    result = mpidist.train(model, "digits", strategy="allreduce", exchange="node", **quiet(steps=20))
    grown, copy = memory.high_water() - at_the_end["rss"], 8 * params  # (float64)
    if result.is_chief:
        assert np.shares_memory(result.model.params, result.params)
        assert grown < 4 * copy, grown / copy
    else:
        assert grown < copy // 2, grown / copy


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "arguments, said",
    [
        (
            dict(data=np.zeros((4, 2))),
            "data: give a dataset file, a bundled dataset's name or an mpidist.data",
        ),
        (dict(data="digits", callbacks=mpidist.EarlyStopping()), "callbacks: give a list of callbacks"),
        (dict(data="digits", callbacks=[object()]), "callbacks[0]: give an mpidist.Callback"),
        (dict(data="digits", comm="world"), "comm: give an mpi4py communicator"),
    ],
    ids=["array", "one-callback", "not-a-callback", "comm"],
)
def test_arguments_of_a_type_train_does_not_take_are_one_line_and_exit_2(arguments, said, capsys):
    """They were tracebacks from deep inside the run (found by a hostile sweep)."""
    with pytest.raises(SystemExit) as stopped:
        mpidist.train("mlp", **arguments, **quiet())
    assert stopped.value.code == 2
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    "train, num_classes, said",
    [
        ((np.zeros((4, 2)), np.arange(4) % 2), 2.7, "num_classes= is a whole number of classes"),  # (was 2)
        ((np.zeros((4, 2)), np.arange(4) % 2), -1, "num_classes= is a whole number of classes"),
        ((np.zeros((4, 2)), np.arange(4) % 2), True, "num_classes= is a whole number of classes"),
        ((np.zeros((4, 2)), np.arange(4) % 2), "2", "num_classes= is a whole number of classes"),
        ((np.array([["a", "b"]] * 4), np.arange(4) % 2), None, "train= x must be numbers"),
        ((np.zeros((4, 2)), np.array(["cat", "dog"] * 2)), None, "train= y must be numbers"),
        (([[1.0, 2.0], [3.0]], [0, 1]), None, "train= takes arrays of one shape each"),
    ],
)
def test_arrays_that_are_no_dataset_are_refused_with_what_is_wrong(train, num_classes, said):
    """Strings, ragged lists and fractional class counts were a traceback from h5py or numpy, or a count
    silently rounded down."""
    test = (np.zeros((2, 2)), np.arange(2) % 2)
    with pytest.raises(mpidist.UsageError, match=said):
        data.ArrayData(train=train, test=test, num_classes=num_classes)
    assert (
        data.ArrayData(train=(np.zeros((4, 2)), np.arange(4) % 2), test=test, num_classes=3.0).num_classes
        == 3
    )


class _Careless(nn.Layer):
    """A user's layer with one mistake: its build, a parameter's shape or its forward's result."""

    def __init__(self, mistake):
        super().__init__()
        self.mistake = mistake

    def build(self, input_shape):
        return None if self.mistake == "build" else input_shape

    def param_specs(self):
        return [("w", (-3,), nn.init.zeros)] if self.mistake == "parameter" else []

    def forward(self, x, training=False):
        return None if self.mistake == "forward" else x

    def backward(self, dy):
        return dy


@pytest.mark.parametrize(
    "mistake, said",
    [
        ("build", "layer 1 .*: its build returned None, not a shape"),
        ("parameter", "layer 1 .*: parameter 'w' has shape \\(-3,\\): sizes are whole numbers, 0 or more"),
        (
            "forward",
            "layer 1 .*: its forward returned 'NoneType' for a batch of \\d+ samples, where its build",
        ),
    ],
)
def test_a_users_layer_that_breaks_its_contract_is_named_before_the_run(mistake, said, capsys):
    """A build that returned None or a negative size, a forward that returned None: each failed later, in
    another layer, with a traceback; each is now the run's refusal (exit 2) naming the layer."""

    def build(sample_shape, outputs):
        return [nn.Flatten(), _Careless(mistake), nn.Dense(outputs)]

    with pytest.raises(SystemExit) as stopped:
        mpidist.train(build, "digits", epochs=1, run_dir="", **quiet())
    assert stopped.value.code == 2
    assert re.search(said, capsys.readouterr().err)


@pytest.mark.parametrize(
    "call, said",
    [
        (lambda checkpoint: mpidist.predict(None, np.zeros((2, 8, 8))), "checkpoint_path: a checkpoint file"),
        (lambda checkpoint: mpidist.evaluate(checkpoint, data=np.zeros((3, 3))), "data: a dataset file"),
        (lambda checkpoint: mpidist.evaluate(checkpoint, data=5), "or an ArrayData of arrays, not int"),
    ],
    ids=["predict-None", "evaluate-array", "evaluate-int"],
)
def test_a_checkpoint_or_dataset_of_a_type_the_api_does_not_take_is_one_line_and_exit_2(
    digits_checkpoint, call, said, capsys
):
    """They were tracebacks from pathlib (exit 1)."""
    with pytest.raises(SystemExit) as stopped:
        call(str(digits_checkpoint[0]))
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err


def test_a_dataset_named_by_a_path_object_is_found_as_by_its_string(tmp_path):
    """A Path with no suffix (a bundled dataset's name) was a TypeError from deep in the lookup."""
    from pathlib import Path

    assert resolve(Path("digits")) == resolve("digits")
    with pytest.raises(mpidist.UsageError, match="no such file, and no bundled dataset of that name"):
        resolve(Path("nosuch"))
