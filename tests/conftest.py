"""Shared helpers: the repository root, and running commands under mpiexec."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# -- under mpiexec (--with-mpi): one rank speaks for the phase --------------------------------------------
# Every rank runs the same tests; rank 0 prints the progress and the summary.  The other ranks write theirs to
# a scratch file, printed (on stderr, under a rank heading) only where that rank saw a test fail.


def _mpi_rank(config):
    """This process's rank in COMM_WORLD under ``--with-mpi``, else None."""
    if not config.getoption("with_mpi", False):
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    keep_the_tests_bytecode()
    rank = _mpi_rank(config)
    if rank:  # (before the terminal reporter is made, so that it writes to the scratch file)
        import tempfile

        config.stash[_QUIET] = (sys.stdout, tempfile.TemporaryFile("w+"))
        sys.stdout = config.stash[_QUIET][1]
    else:
        compile_the_package()


def compile_the_package():
    """Write the package's bytecode before any test starts a process.

    Where the environment forbids writing it (``PYTHONDONTWRITEBYTECODE``, set
    in many container images) every rank of every run compiled the package
    from source: 0.26 s of a 0.78 s start-up, in each of the thousands of
    processes the suite starts.  Python reads bytecode whatever that variable
    says; a file edited later is compiled afresh, as without this.  Files stay
    where Python would put them (``__pycache__``, ignored by git).
    """
    import compileall

    compileall.compile_dir(ROOT / "mpidist", quiet=2)


def keep_the_tests_bytecode():
    """Let pytest keep the test modules it compiles (with their assertions rewritten) for the next process.

    Under ``PYTHONDONTWRITEBYTECODE`` pytest rewrites and compiles every test
    module again in every process that collects them: 3 of the 5 CPU seconds
    of a collection, in each rank of each multi-rank phase.  It reads the files
    it kept whatever that variable says (``tests/__pycache__``, ignored by git).
    The setting is the test process's as a whole: what it imports later writes
    its bytecode too, as it would without the variable.
    """
    sys.dont_write_bytecode = False


_QUIET = pytest.StashKey()
_FAILED = pytest.StashKey()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_FAILED] = exitstatus not in (0, 5)  # (5: nothing collected)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    quiet = config.stash.get(_QUIET, None)
    if quiet is None:
        return
    sys.stdout, scratch = quiet
    if config.stash.get(_FAILED, False):
        scratch.seek(0)
        sys.stderr.write(f"\n---- rank {_mpi_rank(config)} ----\n{scratch.read()}")
    scratch.close()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Inside pytest's own summary (failures before, the short summary after): pytest-mpi's "MPI Information"
    block, the same on every run, is left out (``python -m mpidist info`` says it all)."""
    if _mpi_rank(terminalreporter.config) is None:
        yield
        return
    silenced = {name: getattr(terminalreporter, name) for name in ("section", "write", "line", "write_line")}
    for name in silenced:
        setattr(terminalreporter, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in silenced:
            delattr(terminalreporter, name)


@pytest.fixture(scope="session", autouse=True)
def _scratch_session_directory(tmp_path_factory):
    """Module fixtures that train run in a scratch directory too: runs write ``runs/`` where they start."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(autouse=True)
def _scratch_working_directory(monkeypatch, tmp_path):
    """Each test runs in its own directory: runs write their run directories (``runs/``) where they start."""
    monkeypatch.chdir(tmp_path)


def mpiexec_path():
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


# BLAS thread variables as the test run found them: importing mpidist in this process (a single
# rank owning every core) may set them, and launched ranks must size their own pools, not inherit that
BLAS_VARIABLES = {
    name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
}


def child_environ(**extra):
    """This process's environment for a job it launches, with the BLAS variables as the test run found
    them."""
    environ = dict(os.environ, **extra)
    for name, value in BLAS_VARIABLES.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return environ


#: names of this machine, one an emulated node: MPICH's launcher starts the ranks of each host name given with
#: ``-hosts`` as one node (a node communicator of their own, the network module between them), with no ssh
NODE_NAMES = ("127.0.0.1", "localhost", socket.gethostname())


def node_hosts(nodes, per_node):
    """``-hosts`` for ``nodes`` emulated nodes of ``per_node`` ranks each, on this machine (MPICH's
    launcher)."""
    if nodes > len(NODE_NAMES):
        raise ValueError(f"{nodes} emulated nodes: this machine has {len(NODE_NAMES)} names for itself")
    return ",".join(f"{name}:{per_node}" for name in NODE_NAMES[:nodes])


def _command_and_env(ranks, args, env, prefix=(), nodes=None):
    """The command that runs ``ranks`` ranks of ``python ARGS``; ``nodes``: on that many emulated nodes."""
    hosts = ["-hosts", node_hosts(nodes, ranks // nodes)] if nodes else []
    command = list(prefix) + [mpiexec_path(), *hosts, "-n", str(ranks), sys.executable] + list(args)
    full_env = child_environ(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return command, full_env


def run_mpi(ranks, args, timeout=60, cwd=None, env=None, prefix=(), nodes=None):
    """Run ``[PREFIX...] mpiexec -n ranks python ARGS``; returns the CompletedProcess and seconds taken.

    ``nodes``: spread the ranks evenly over that many emulated nodes (:func:`node_hosts`).  A run that
    outlives ``timeout`` is a hang: the test fails with what it printed.
    """
    import time

    command, full_env = _command_and_env(ranks, args, env, prefix, nodes)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=cwd or os.getcwd(), env=full_env
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(
            f"hung: {' '.join(command)} ran past {timeout} s\nstdout:\n{err.stdout}\nstderr:\n{err.stderr}"
        )
    return done, time.perf_counter() - start


def mpidist(ranks, *flags, timeout=60, cwd=None, env=None, nodes=None):
    """``mpiexec -n ranks python -m mpidist FLAGS`` (on ``nodes`` emulated nodes, if given)."""
    return run_mpi(ranks, ["-m", "mpidist", *flags], timeout=timeout, cwd=cwd, env=env, nodes=nodes)


def start_mpi(ranks, args, env=None):
    """``mpiexec -n ranks python ARGS`` in the background (a Popen with text pipes)."""
    command, full_env = _command_and_env(ranks, args, env)
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd(), env=full_env
    )


def start_mpidist(ranks, *flags, env=None):
    """``mpiexec -n ranks python -m mpidist FLAGS`` in the background (a Popen with text pipes)."""
    return start_mpi(ranks, ["-m", "mpidist", *flags], env=env)


def stat_fields(pid):
    """The fields of ``/proc/PID/stat`` after the command's name (state, parent, ...), or None once it is
    gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid):
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def rank_pids(launcher):
    """``{rank: pid}`` of the ranks a running ``mpiexec`` or ``mpirun`` (a Popen) started, found through
    /proc."""
    children = {}
    for entry in Path("/proc").iterdir():
        fields = stat_fields(entry.name) if entry.name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    ranks, todo = {}, [launcher.pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            for name in (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="):  # MPICH's launcher, Open MPI's
                if item.startswith(name):
                    ranks[int(item[len(name) :])] = pid
    return ranks


def rank_states(launcher):
    """``{rank: (pid, state)}`` of the ranks a running launcher started (the state as /proc says: ``R``
    running, ``S`` asleep, ``T`` stopped, ``gone``): where a run that should have ended is."""
    return {rank: (pid, (stat_fields(pid) or ["gone"])[0]) for rank, pid in rank_pids(launcher).items()}


def events(path, kind=None):
    """The metrics events in ``path`` (of one ``kind``, if given); none while the file does not exist."""
    if not path.exists():
        return []
    # a run still writing may have written part of its last line: read only the lines it has ended
    found = [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
    return [event for event in found if kind is None or event["event"] == kind]


def _new_lines(path, tail):
    """The lines ended in ``path`` since the last look (``tail``: the file looked at, the bytes read, the line
    begun); every line again where the file is another or shorter than what was read (written anew)."""
    try:
        with open(path, "rb") as file:
            stat = os.fstat(file.fileno())
            if tail.get("file") != (stat.st_dev, stat.st_ino) or stat.st_size < tail.get("read", 0):
                tail.update(file=(stat.st_dev, stat.st_ino), read=0, begun=b"")
            file.seek(tail["read"])
            new = file.read()
    except FileNotFoundError:
        return []
    tail["read"] += len(new)
    *lines, tail["begun"] = (tail["begun"] + new).split(b"\n")
    return lines


def wait_for_step(metrics, step, launcher, timeout=60):
    """Return once the chief logged ``step`` in ``metrics``; fail if the run (a Popen) ends first or never
    does.

    Only what the run wrote since the last look is read: the whole file, parsed again every 20 ms, cost
    10 ms of CPU a look by step 1,288 (--log-every 1), a third of a core taken from the run's ranks on a
    2-core machine."""
    deadline, tail = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        for line in _new_lines(metrics, tail):
            event = json.loads(line)
            if event["event"] == "step" and event["step"] >= step:
                return
        if launcher.poll() is not None:
            pytest.fail(f"the run ended before step {step}: {launcher.communicate()}")
        time.sleep(0.02)
    launcher.kill()
    pytest.fail(f"no step {step} within {timeout} s")


def cluster_with_ps(num_ps):
    """Multi-rank tests: the world's cluster with ``num_ps`` ps ranks; skips when the world is too small."""
    from mpi4py import MPI

    from mpidist.runtime.cluster import build_cluster

    if MPI.COMM_WORLD.Get_size() < num_ps + 1:
        pytest.skip(f"--ps {num_ps} needs {num_ps + 1} ranks")
    return build_cluster(MPI.COMM_WORLD, num_ps=num_ps)


def checkpoint_steps(directory):
    """The steps of the checkpoint files in ``directory`` (any lineage), lowest first."""
    from mpidist.store.lineage import parse_name

    return sorted(
        parsed[0] for parsed in map(parse_name, (p.name for p in Path(directory).iterdir())) if parsed
    )


def checkpoint_at(directory, step):
    """The one checkpoint file of ``step`` in ``directory``."""
    found = list(Path(directory).glob(f"ckpt-{step:08d}*.h5"))
    assert len(found) == 1, (step, sorted(p.name for p in Path(directory).iterdir()))
    return found[0]


def corrupt_chunk(path, item, index):
    """Bytes inverted in the middle of chunk ``index`` of HDF5 dataset ``item``: its gzip filter cannot decode
    it."""
    import h5py

    with h5py.File(path, "r") as handle:
        chunk = handle[item].id.get_chunk_info(index)
    with open(path, "r+b") as handle:
        handle.seek(chunk.byte_offset + chunk.size // 4)
        middle = handle.read(chunk.size // 2)
        handle.seek(chunk.byte_offset + chunk.size // 4)
        handle.write(bytes(b ^ 0xFF for b in middle))
    return path


def trained_rows(folder, completed=None):
    """``{(epoch, step): Counter of rows}`` that the workers of the runs recorded in ``folder`` trained on
    (``MPIDIST_TEST_RECORD``: a line per batch, ``epoch step workers row row ...``).

    ``completed``: ``(workers, steps per epoch, steps)``: batches of a layout of that many workers at or past
    that many steps of the run were in flight when a worker died, and taken again by the survivors: left out.
    """
    import collections

    counts = collections.defaultdict(collections.Counter)
    for path in Path(folder).glob("worker-*.txt"):
        for line in path.read_text().splitlines():
            epoch, step, workers, *rows = map(int, line.split())
            if completed and workers == completed[0] and epoch * completed[1] + step >= completed[2]:
                continue
            counts[epoch, step].update(rows)
    return counts


def epochs_of(steps):
    """``{epoch: Counter of rows}`` of :func:`trained_rows`' steps."""
    import collections

    counts = collections.defaultdict(collections.Counter)
    for (epoch, _), rows in steps.items():
        counts[epoch].update(rows)
    return counts


def strategy_of(flags, ranks):
    """The strategy a run of ``flags`` on ``ranks`` ranks trains with: its ``--strategy``, or what ``auto``
    picks on that many ranks, as the settings pick it.  Tests hold their tables of runs against the registry
    with it, so a strategy added later cannot be left out."""
    from mpidist.settings.config import Settings

    flags = list(flags)
    if "--strategy" in flags:
        return flags[flags.index("--strategy") + 1]
    # (auto reads --ps and --stages too: a row that gives them without --strategy would need them here)
    assert not {"--ps", "--stages"} & set(flags) and not any(f.startswith("--strategy=") for f in flags), (
        flags
    )
    return Settings().with_world(ranks).strategy
