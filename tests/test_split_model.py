"""Evaluating and predicting with a model split over the ranks as training splits it (pipeline stages, tensor
parts): each rank reads its part of the checkpoint, and the figures and outputs are the whole model's."""

import io

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist.loop import split_model

QUIET = dict(progress="none", metrics="", dtype="float64", stream=io.StringIO())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A pipeline's sharded checkpoint of mlp:32,32 on digits (every rank knows its path) and its run's
    figures."""
    world = MPI.COMM_WORLD
    directory = world.bcast(str(tmp_path_factory.mktemp("ck")) if world.Get_rank() == 0 else None, root=0)
    result = mpidist.train(
        "mlp:32,32",
        "digits",
        strategy="pipeline",
        **dict(
            QUIET,
            stages=2 if world.Get_size() % 2 == 0 else world.Get_size(),
            steps=6,
            eval_every=0,
            checkpoint_dir=directory,
        ),
    )
    path = world.bcast(str(result.checkpoints[-1]) if result.is_chief else None, root=0)
    return path, world.bcast(result.figures if result.is_chief else None, root=0)


def layouts(ranks):
    """Every ``(stages, tensor)`` but (1, 1) that divides ``ranks`` (mlp:32,32 has 6 layers, 2 Dense
    pairs)."""
    return [
        (stages, tensor)
        for stages in range(1, min(ranks, 6) + 1)
        for tensor in (1, 2)
        if (stages, tensor) != (1, 1) and ranks % (stages * tensor) == 0
    ]


@pytest.mark.mpi(min_size=2)
def test_a_split_model_evaluates_as_the_whole_one_on_every_layout_the_ranks_allow(trained):
    path, figures = trained
    world = MPI.COMM_WORLD
    whole = mpidist.evaluate(path, comm=world)
    # (the run's end evaluated it)
    assert whole["test_loss"] == pytest.approx(figures["test_loss"], rel=1e-12)
    assert layouts(world.Get_size())
    for stages, tensor in layouts(world.Get_size()):
        split = mpidist.evaluate(path, comm=world, stages=stages, tensor=tensor)
        assert (split["samples"], split["step"]) == (whole["samples"], 6), (stages, tensor, whole["samples"])
        assert split["test_loss"] == pytest.approx(whole["test_loss"], rel=1e-12), (stages, tensor)
        assert split["test_accuracy"] == whole["test_accuracy"], (stages, tensor)
        np.testing.assert_array_equal(split["test_confusion"], whole["test_confusion"])


@pytest.mark.mpi(min_size=2)
def test_a_split_model_predicts_what_the_whole_one_does_on_every_layout_the_ranks_allow(trained, tmp_path):
    path, _ = trained
    world = MPI.COMM_WORLD
    # (plain samples: 301 rows, in blocks of no even size)
    samples = np.random.default_rng(5).random((301, 8, 8))
    whole = mpidist.predict(path, samples, comm=world)
    for stages, tensor in layouts(world.Get_size()):
        split = mpidist.predict(path, samples, comm=world, stages=stages, tensor=tensor)
        assert split.samples == 301
        # (the same outputs, gathered in input order from each replica's last stage)
        if world.Get_rank() == 0:
            np.testing.assert_allclose(split.probabilities, whole.probabilities, rtol=0, atol=1e-6)
            np.testing.assert_array_equal(split.classes, whole.classes)
    labelled = mpidist.predict(path, comm=world, stages=world.Get_size())  # (the test split: its accuracy)
    assert labelled.figures["accuracy"] == mpidist.predict(path, comm=world).figures["accuracy"]


@pytest.mark.mpi(min_size=2)
def test_a_split_the_ranks_cannot_make_is_refused_on_every_rank(trained, capfd):
    path, _ = trained
    world = MPI.COMM_WORLD
    with pytest.raises(SystemExit) as stopped:
        mpidist.evaluate(path, comm=world, stages=world.Get_size() + 1)
    assert stopped.value.code == 2
    if world.Get_rank() == 0:
        assert (
            f"--stages {world.Get_size() + 1} x --tensor 1 does not divide the {world.Get_size()} ranks"
            in capfd.readouterr().err
        )


def test_a_split_is_checked_before_any_rank_builds_it():
    from mpidist import nn
    from mpidist.runtime.errors import UsageError
    from mpidist.settings.config import Settings

    model = nn.build_model("mlp:32,32", (8, 8), 10, np, np.float64, buffers=False)
    settings = Settings(model="mlp:32,32")
    split = split_model.layout_settings(settings, 8, 2, 2, model)
    assert (split.strategy, split.stages, split.tensor, split.micro_batches) == ("pipeline", 2, 2, 1)
    assert split_model.layout_settings(settings, 4, 1, 2, model).strategy == "allreduce"
    assert [split_model.data_share(rank, 8, 2, 2) for rank in (0, 3, 4, 7)] == [
        (0, 2),
        (0, 2),
        (1, 2),
        (1, 2),
    ]
    for stages, tensor, message in (
        (3, 1, "does not divide the 8 ranks"),
        (0, 1, "--stages 0: give a number"),
        (8, 1, "--stages 8 needs at least 8 layers"),
        (1, True, "--tensor True"),
    ):
        with pytest.raises(UsageError, match=message):
            split_model.layout_settings(settings, 8, stages, tensor, model)
