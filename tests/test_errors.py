"""Agreement on set-up errors: every rank exits together, one message; what a failed read of a file
becomes."""

import errno

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.runtime.agreement import OneVoice, agreed
from mpidist.runtime.errors import EXIT_FAILURE, EXIT_USAGE, RunError, UsageError, error_line
from mpidist.runtime.reads import read_failure, reading, system_errno


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
        assert not voice.claim()  # (claimed already: a second failure on any rank stays quiet)
    finally:
        world.Barrier()
        voice.free()


def test_a_run_error_in_set_up_exits_1_with_its_line_and_no_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        with agreed(None):
            raise RunError("d.h5: train/x cannot be read: the system's read failed")
    assert exit_info.value.code == EXIT_FAILURE
    assert (
        capsys.readouterr().err == "mpidist: error: d.h5: train/x cannot be read: the system's read failed\n"
    )


# h5py's text of a chunk its filter cannot decode, and of a read the system failed (HDF5's sec2 driver)
FILTER_FAILED = OSError("Can't synchronously read data (filter returned failure during read)")
SYSTEM_FAILED = OSError(
    "Can't synchronously read data (file read failed: time = Mon Jan  1 00:00:00 2024\n, "
    "filename = 'd.h5', file descriptor = 5, errno = 5, error message = 'Input/output error', "
    "buf = 0x1, total read size = 4096, bytes this sub-read = 4096, bytes actually read = "
    "18446744073709551615, offset = 0)"
)


def test_a_read_the_file_fails_is_bad_input_and_one_the_system_fails_is_a_failure_while_running():
    bad = read_failure(FILTER_FAILED, "d.h5: train/x", "at samples 0..9")
    assert isinstance(bad, UsageError)
    assert str(bad) == (
        "d.h5: train/x cannot be read at samples 0..9 (HDF5: Can't synchronously read data "
        "(filter returned failure during read))"
    )
    lost = read_failure(SYSTEM_FAILED, "d.h5: train/x", "at samples 0..9")
    assert isinstance(lost, RunError) and "Input/output error, errno 5" in str(lost) and "\n" not in str(lost)
    assert isinstance(read_failure(OSError(errno.EIO, "Input/output error"), "d.h5"), RunError)
    assert system_errno(OSError("truncated file: eof = 4, errno = 0")) is None


def test_reading_turns_only_the_library_errors_it_is_given_into_one_line():
    with pytest.raises(UsageError, match=r"^ckpt.h5: params cannot be read \(HDF5: .*filter returned"):
        with reading("ckpt.h5: params"):
            raise FILTER_FAILED
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        with reading("ckpt.h5: params"):
            1 / 0
