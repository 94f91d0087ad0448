"""A private single-node Slurm for tests: slurmctld + slurmd on localhost, in a temporary directory.

Runs without systemd, cgroups or munge (``auth/none``), on free ports, so
two test runs on one machine do not collide.  The node advertises more CPUs
than the machine has (``config_overrides``) so that 4-8 rank jobs fit;
``EnforcePartLimits=ALL`` makes a request that can never fit fail at
submission instead of pending forever.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from conftest import child_environ, running

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel")
#: the states of a job that has ended
ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
NODE = "mpidist-node"
CPUS = 8


def missing_commands():
    """The Slurm commands this machine lacks (empty when Slurm is installed)."""
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def first_job_id():
    """Job ids that no earlier cluster gave: MPICH names a job step's shared memory after it (``/dev/shm``),
    and a segment a killed rank left there under the same name made the next step's ranks wait in ``MPI_Init``
    for good (every cluster numbered its jobs from 1; job 2, the srun script's, hung in every session after
    one such kill)."""
    return 1 + int(time.time() * 10) % 60_000_000  # (Slurm's job ids end at 67,108,863)


def _config(root, controller_port, node_port):
    user = getpass.getuser()
    host = socket.gethostname().split(".")[0]
    return f"""\
ClusterName=mpidisttest
FirstJobId={first_job_id()}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=pmi2
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
MinJobAge=300
KillWait=10
ReturnToService=2
SchedulerParameters=batch_sched_delay=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
NodeName={NODE} NodeAddr=127.0.0.1 CPUs={CPUS} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""


class PrivateSlurm:
    """Start with :meth:`start`, stop with :meth:`stop`; clients get ``env`` (it names ``SLURM_CONF``)."""

    def __init__(self, root):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = child_environ(SLURM_CONF=str(self.conf))
        self.env.pop("SLURM_JOB_ID", None)  # never mistake the test's own job (if any) for ours
        self._daemons = []

    def start(self, timeout=30):
        for sub in ("state", "spool"):  # (empty: a cluster started again forgets the jobs of the one stopped)
            shutil.rmtree(self.root / sub, ignore_errors=True)
            (self.root / sub).mkdir(parents=True)
        self.conf.write_text(_config(self.root, *_free_ports(2)))
        sbin = lambda name: shutil.which(name) or f"/usr/sbin/{name}"  # noqa: E731
        # -D: stay in the foreground, so we own the processes; -i: ignore any saved state
        self._daemons.append(
            subprocess.Popen(
                [sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        self._daemons.append(
            subprocess.Popen(
                [sbin("slurmd"), "-D", "-f", str(self.conf), "-N", NODE],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-n", NODE, "-o", "%T").stdout.strip()
            if state == "idle":
                return self
            if any(daemon.poll() is not None for daemon in self._daemons):
                break
            time.sleep(0.3)
        logs = self.logs()
        self.stop()
        raise RuntimeError(f"private Slurm did not come up (node state {state!r}):\n{logs}")

    def stop(self):
        """Stop the daemons, then end what their jobs left running: a job step's ``slurmstepd`` and its ranks
        outlive ``slurmd`` (a test that timed out left ranks spinning in ``MPI_Init`` for minutes)."""
        for daemon in self._daemons:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        deadline = time.monotonic() + 10
        while (left := self.leftovers()) and time.monotonic() < deadline:  # (a step may start one as we look)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # (ended meanwhile)
                    pass
            time.sleep(0.1)

    def leftovers(self):
        """Pids of the processes of this cluster: each has its ``SLURM_CONF`` (daemons, steps and jobs inherit
        it; the test process does not: clients get a copy of its environment)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if (
                    entry.name.isdigit()
                    and running(entry.name)
                    and mark in (entry / "environ").read_bytes().split(b"\0")
                ):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def logs(self):
        return "\n".join(
            f"--- {name}:\n" + (self.root / name).read_text()[-3000:]
            for name in ("slurmctld.log", "slurmd.log")
            if (self.root / name).exists()
        )

    def run(self, *command, timeout=60, env=None, cwd=None):
        """A Slurm client command against this cluster (a CompletedProcess with text output)."""
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=dict(self.env, **(env or {})),
        )

    def job(self, job_id):
        """``scontrol show job`` as a dict of its ``Key=Value`` fields ({} once the job is forgotten)."""
        shown = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout.strip()
        return dict(field.split("=", 1) for field in shown.split() if "=" in field)

    def wait_for_end(self, job_id, timeout=120):
        """Poll until the job has ended; returns the job's fields."""
        return self.wait_for(job_id, ENDED, timeout)

    def wait_for(self, job_id, states, timeout=120):
        """Poll until the job's state is one of ``states``; returns the job's fields."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} never reached {states}: {self.job(job_id)}\n{self.logs()}")
