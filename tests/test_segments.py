"""A process that ends without MPI_Finalize (an abort, a signal, a stall) leaves none of MPICH's files in
/dev/shm that it mapped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from conftest import child_environ, mpiexec_path
from mpidist.runtime.errors import EXIT_PREEMPTED
from mpidist.runtime.segments import mapped_segments

MPICH = "MPICH" in MPI.Get_library_version()
needs_mpich = pytest.mark.skipif(not MPICH, reason="MPICH's /dev/shm files (another MPI names its own)")


def test_mapped_segments_are_mpichs_named_files_in_dev_shm_and_nothing_else(tmp_path):
    maps = tmp_path / "maps"
    maps.write_bytes(
        b"7e00-7e01 r--s 00000000 08:01 10 /data/r\xe9sum\xff.h5 (deleted)\n"  # (a name that is not UTF-8)
        + (
            "7f00-7f01 rw-s 00000000 00:1a 11 /dev/shm/mpich_shm_2fcc_0\n"
            "7f01-7f02 rw-s 00000000 00:1a 11 /dev/shm/mpich_shm_2fcc_0\n"  # (a file mapped twice: one name)
            "7f02-7f03 rw-s 00000000 00:1a 12 /dev/shm/mpich_shm_a01_0 (deleted)\n"  # removed already
            "7f03-7f04 rw-s 00000000 00:1a 13 /dev/shm/ucx_shm_posix_8ecd\n"  # another library's
            "7f04-7f05 rw-s 00000000 00:1a 14 /dev/shm/sub/mpich_shm_b_0\n"  # not MPICH's place
            "7f05-7f06 r--p 00000000 08:01 15 /home/user/mpich_shm_c_0\n"
            "7f06-7f07 rw-p 00000000 00:00 0 \n"
            "7f07-7f08 rw-s 00000000 00:1a 16 /dev/shm/mpich_shm_9e_1\n"
        ).encode()
    )
    assert mapped_segments(str(maps)) == ["/dev/shm/mpich_shm_2fcc_0", "/dev/shm/mpich_shm_9e_1"]
    assert mapped_segments(str(tmp_path / "missing")) == []


# A rank that lists the MPICH files it maps, then ends as mpidist ends a job early; rank 1 of two waits to be
# torn down
ENDING = """
import json, sys, time
from mpi4py import MPI
from mpidist.runtime.agreement import abort_now, exit_now
from mpidist.runtime.segments import mapped_segments
world = MPI.COMM_WORLD
win = MPI.Win.Allocate_shared(1 << 20, 1, comm=world)  # (a shared window: a file of its own)
world.Barrier()
if world.Get_rank() == 0:
    print(json.dumps(mapped_segments()), flush=True)
    (abort_now if sys.argv[1] == "abort" else exit_now)(3)
time.sleep(30)
"""


@needs_mpich
@pytest.mark.parametrize("ranks,end", [(1, "exit"), (1, "abort"), (2, "abort")])
def test_a_process_ending_without_finalize_removes_the_mpich_files_it_maps(ranks, end):
    launch = [] if ranks == 1 else [mpiexec_path(), "-n", str(ranks)]
    done = subprocess.run(
        [*launch, sys.executable, "-c", ENDING, end],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_environ(),
    )
    assert done.returncode == 3, done.stdout + done.stderr
    names = json.loads(done.stdout.splitlines()[0])
    assert names  # (the channel's at least)
    assert [name for name in names if Path(name).exists()] == []


@needs_mpich
def test_a_command_stopped_by_a_signal_leaves_none_of_its_mpich_files(tmp_path):
    # one process stopped by SIGTERM ends through os._exit (mpidist.runtime.agreement.end_interrupted)
    script = tmp_path / "stopped.py"
    script.write_text(
        "import json, os, signal, sys\n"
        "from mpi4py import MPI\n"
        "from mpidist.runtime.preempt import interrupt_on_signals\n"
        "from mpidist.runtime.segments import mapped_segments\n"
        "print(json.dumps(mapped_segments()), flush=True)\n"
        "with interrupt_on_signals():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=child_environ()
    )
    assert done.returncode == EXIT_PREEMPTED, done.stdout + done.stderr
    names = json.loads(done.stdout.splitlines()[0])
    assert names and [name for name in names if os.path.exists(name)] == []
