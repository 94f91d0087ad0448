"""Agreement on set-up errors: every rank exits together, one message."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.runtime.agreement import OneVoice, agreed
from mpidist.runtime.errors import EXIT_FAILURE, EXIT_USAGE, UsageError, error_line


def test_without_a_communicator_a_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        with agreed(None):
            raise UsageError("--epochs must be at least 1, got 0")
    assert exit_info.value.code == EXIT_USAGE
    assert capsys.readouterr().err == error_line("--epochs must be at least 1, got 0") + "\n"


def test_a_phase_that_succeeds_continues():
    with agreed(None):
        pass


@pytest.mark.mpi(min_size=2)
def test_one_failing_rank_makes_every_rank_exit_2_and_only_it_speaks(capsys):
    world = MPI.COMM_WORLD
    failing = world.Get_size() - 1
    with pytest.raises(SystemExit) as exit_info:
        with agreed(world):
            if world.Get_rank() == failing:
                raise UsageError("shard is broken")
    assert exit_info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    if world.Get_rank() == failing:
        assert err == f"mpidist: error (rank {failing}): shard is broken\n"
    else:
        assert err == ""


@pytest.mark.mpi(min_size=2)
def test_an_error_on_every_rank_is_reported_once_without_a_rank(capsys):
    world = MPI.COMM_WORLD
    with pytest.raises(SystemExit):
        with agreed(world):
            raise UsageError("bad flag")
    err = capsys.readouterr().err
    assert err == ("mpidist: error: bad flag\n" if world.Get_rank() == 0 else "")


@pytest.mark.mpi(min_size=2)
def test_an_unexpected_exception_exits_1_with_its_traceback(capsys):
    world = MPI.COMM_WORLD
    with pytest.raises(SystemExit) as exit_info:
        with agreed(world):
            if world.Get_rank() == 0:
                raise KeyError("boom")
    assert exit_info.value.code == EXIT_FAILURE
    if world.Get_rank() == 0:
        err = capsys.readouterr().err
        assert "unexpected failure" in err and "KeyError: 'boom'" in err


@pytest.mark.mpi(min_size=2)
def test_when_every_rank_claims_the_voice_exactly_one_gets_it():
    world = MPI.COMM_WORLD
    voice = OneVoice(world)
    try:
        won = np.zeros(world.Get_size(), dtype=np.int64)
        world.Allgather(np.array([int(voice.claim(seconds=30))], dtype=np.int64), won)
        assert won.sum() == 1, won
        assert not voice.claim()   # (claimed already: a second failure on any rank stays quiet)
    finally:
        world.Barrier()
        voice.free()
