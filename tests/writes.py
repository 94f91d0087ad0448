"""Helpers of the tests of writes cut short (tests/test_interrupts.py, tests/test_full_disk.py,
test_faults.py).

:data:`HOOKED` runs ``python -m mpidist ARGS`` (one process, as a user at a
terminal runs it, or a rank under mpiexec) with one fault put in first:

* ``fsize=BYTES``: no file may grow past BYTES (``RLIMIT_FSIZE``, its signal
  ignored): a write past it fails with ``EFBIG`` as on a full disk (``ENOSPC``),
  with no root needed for a small file system;
* ``fsize-at-save=BYTES``: the same, from when ``plan --calibrate`` saves its calibration;
* ``signal-in-del=NUMBER``: when the first file written aside is whole and
  about to be synced and renamed into place, the process signals itself from a
  ``__del__`` -- where an exception raised by a signal handler is swallowed;
* ``signal-in-train=NUMBER,SECONDS``: SECONDS into a training run the command
  makes (``plan --calibrate`` times the loop), the process signals itself.

Only rank 0 is hooked.
"""

import os
import signal
import subprocess
import sys

from conftest import ROOT, child_environ

HOOKED = """
import os, resource, signal, sys, threading
from mpi4py import MPI

hook, sys.argv = sys.argv[1], ["mpidist"] + sys.argv[2:]
kind, _, value = hook.partition("=")
if MPI.COMM_WORLD.Get_rank() == 0 and kind == "fsize":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.RLIM_INFINITY))
elif MPI.COMM_WORLD.Get_rank() == 0 and kind == "fsize-at-save":
    from mpidist.plan import calibration
    real_save = calibration.save

    def save(*args):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.RLIM_INFINITY))
        return real_save(*args)

    calibration.save = save
elif MPI.COMM_WORLD.Get_rank() == 0 and kind == "signal-in-del":
    from mpidist.store import atomic
    real_sync_file = atomic.sync_file

    class Lands:
        def __del__(self):
            os.kill(os.getpid(), int(value))
            sum(range(100))   # (the handler runs here, inside __del__)

    def sync_file(path):
        if not getattr(sync_file, "done", False):
            sync_file.done = True
            Lands()
        return real_sync_file(path)

    atomic.sync_file = sync_file
elif MPI.COMM_WORLD.Get_rank() == 0 and kind == "signal-in-train":
    import mpidist.api
    number, seconds = value.split(",")
    real_train = mpidist.api.train

    def train(*args, **kwargs):
        threading.Timer(float(seconds), os.kill, (os.getpid(), int(number))).start()
        return real_train(*args, **kwargs)

    mpidist.api.train = train
from mpidist.__main__ import main
sys.exit(main())
"""


def hooked_script(folder):
    """:data:`HOOKED` written to ``folder/hooked.py``; its path."""
    path = folder / "hooked.py"
    path.write_text(HOOKED)
    return str(path)


def hangups_as_at_a_terminal():
    """``preexec_fn``: SIGHUP's default disposition, whatever the tests inherited (``nohup pytest`` ignores
    it)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def run_hooked(folder, hook, *args, env=None, timeout=120):
    """``python hooked.py HOOK ARGS`` (no launcher: one process) in ``folder``; the CompletedProcess."""
    return subprocess.run(
        [sys.executable, hooked_script(folder), hook, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=timeout,
        preexec_fn=hangups_as_at_a_terminal,
        env=child_environ(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TMPDIR=str(folder), **(env or {})),
    )


def made_up_calibration(folder):
    """A calibration file ``folder/c.json`` of a made-up model (tests/test_plan.py's), for ``plan`` to
    read."""
    from test_plan import made_up

    from mpidist.plan import calibration

    calibration.save(made_up(network=None), folder / "c.json")
    return folder / "c.json"


def left_aside(folder):
    """The files and folders aside (``.NAME.tmp-...``, bench's ``.mpidist-bench-...``, scratch folders) in
    ``folder``."""
    return sorted(
        name for name in os.listdir(folder) if ".tmp" in name or name.startswith("mpidist-calibrate-")
    )


def one_line_and_no_traceback(stderr):
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "Segmentation" not in stderr, (
        stderr
    )
    assert "MPI_Abort" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mpidist: ")]
    assert len(lines) == 1, stderr
    return lines[0]
