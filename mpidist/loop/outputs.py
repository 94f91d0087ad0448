"""What a run writes as it goes: the terminal (and log.txt), metrics and callbacks, progress, TensorBoard,
the checkpoint directory's claim and the timeline.  One object, opened at set-up and closed once."""

import os
import sys
from pathlib import Path

from ..observe import trace
from ..runtime import recorder
from ..runtime.memory import human
from ..store import checkpoint_save, lineage, rundir, settings_file
from . import tensorboard
from .callbacks import Reporter
from .metrics import MetricsLog, Progress, last_step_logged

TRACER = recorder.tracer()


def trace_file(config, resume):
    """Where ``--trace`` writes: the run directory's trace.json, or ``trace-from-step-N.json`` beside an
    earlier part's."""
    path = Path(config.run_dir or ".") / rundir.TRACE
    if resume is not None and path.exists():
        path = path.with_name(f"trace-from-step-{resume.step}.json")
    return path


def metrics_note(config, resume):
    """What the user is told of where the metrics go, where it is not the run directory's own new file:
    with no run directory (``--run-dir ''``), and a file that holds earlier runs' lines, which this run's
    follow (None otherwise)."""
    metrics = config.metrics
    if not metrics:
        return None
    try:
        held = os.path.getsize(metrics)
    except OSError:
        held = 0
    earlier = held and resume is None
    if config.run_dir and not earlier:
        return None
    where = "" if config.run_dir else " (no run directory: --run-dir '')"
    then = (
        f", after the {human(held)} of lines already there (each run's begin with its start event; "
        "--metrics FILE writes another file, --metrics '' none)"
        if earlier
        else ""
    )
    return f"note: metrics go to {metrics}{where}{then}"


class Outputs:
    """A rank's outputs of one run; only the chief's write anything.

    Args:
        stream: the terminal (the chief's copy goes to the run directory's log.txt too).
        chief: whether this rank is the chief.
    """

    def __init__(self, stream=sys.stdout, chief=True):
        self.stream, self.chief = stream, chief
        self.log = self.progress = self.board = self.log_copy = self.claim = None
        self.callbacks = []
        self.trace_offset, self.trace_path = 0.0, None  # the chief's clock, and where the timeline went
        self.made = []  # the checkpoint directories made for the run (taken back if it is refused)

    def open(self, config, callbacks, resume):
        """Local (inside the set-up's agreement): check and open everything the run writes to.

        ``callbacks``: the user's and the run's own (early stopping); ``resume``: the checkpoint the run
        resumes from, or None.  Nothing is written yet: a run that any rank refuses changes nothing.
        """
        callbacks = self.callbacks = list(callbacks)
        where = metrics_note(config, resume) if self.chief else None  # (before the file is opened)
        if config.tensorboard:
            tensorboard.require()  # on every rank: without the package, all exit with its name (code 2)
            if self.chief:
                self.board = tensorboard.TensorBoard(config.run_dir or os.path.dirname(config.metrics) or ".")
                callbacks.append(self.board)
        self.log = Reporter(MetricsLog(config.metrics if self.chief else ""), callbacks, self.chief)
        if not self.chief:
            return
        # a live run's directory is its own, as its checkpoint directory is: taken before anything there is
        # opened
        run_lock = lineage.DirectoryLock(config.run_dir, run=True).acquire() if config.run_dir else None
        made = []
        try:
            if config.run_dir:
                self.log_copy = self.stream = rundir.LogCopy(self.stream, Path(config.run_dir) / rundir.LOG)
            if config.trace != "off":
                trace.check_writable(trace_file(config, resume))
            if config.checkpoint_dir:
                made = checkpoint_save.prepare_directory(config.checkpoint_dir)
            self.claim = lineage.claim(config, resume)
            self.claim.notes += [where] if where else []
        except BaseException:
            if run_lock is not None:
                run_lock.release()
            checkpoint_save.remove_unused(made)  # (refused: a directory made for it is not left behind)
            raise
        self.claim.run_lock = run_lock
        self.made = made

    def take_over(self, config, lineage_of):
        """A worker that became the chief (the chief died, ``--elastic``): open what the chief writes.

        The metrics file is appended to (a line the dead chief left unfinished is
        cut first, as at any start), the log too, and the checkpoint directory's
        lock, which died with the chief's process, is taken; ``lineage``: the
        run's ``(lineage, parent)`` (``lineage_of``).  TensorBoard's files are not taken over.
        """
        self.chief = True
        unwritten = self.log.unwritten
        self.log = Reporter(MetricsLog(config.metrics), self.callbacks, True)
        last = last_step_logged(config.metrics) if config.metrics else 0
        for figures in unwritten:  # (the steps the dead chief had not written: the file stays continuous)
            if figures["step"] > last:
                self.log.write("step", **figures)
        self.claim = lineage.Claim(*lineage_of)
        if config.run_dir:
            self.claim.run_lock = lineage.DirectoryLock(config.run_dir, run=True).acquire()
            self.log_copy = self.stream = rundir.LogCopy(self.stream, Path(config.run_dir) / rundir.LOG)
        if config.checkpoint_dir:
            self.claim.lock = lineage.DirectoryLock(config.checkpoint_dir).acquire()

    def begin(self, config):
        """Once every rank's checks passed: the run directory's settings (a refused run changes nothing)."""
        if self.chief and config.run_dir:
            kept = settings_file.write_settings(config, config.run_dir)
            if kept:
                self.say(
                    f"mpidist: {Path(config.run_dir) / rundir.SETTINGS} said other settings: they are kept "
                    f"as {kept}"
                )

    def start_trace(self, config, cluster):
        """Collective: with ``--trace``, record from now on, on a clock aligned with the chief's."""
        if config.trace != "off":
            TRACER.enable(detail=config.trace == "detail")
            self.trace_offset = trace.clock_offset(cluster.world, cluster.chief_rank)

    def show_progress(self, config, total_steps, start_step):
        self.progress = Progress(
            config.progress if self.chief else "none",
            total_steps,
            config.epochs,
            stream=self.stream,
            start_step=start_step,
        )

    def say(self, text):
        self.stream.write(text + "\n")
        self.stream.flush()

    def write_trace(self, cluster, path, label):
        """Collective: the chief gathers every rank's timeline into ``path``; ``label`` names this rank."""
        problem = trace.gather_and_write(cluster.world, cluster.chief_rank, self.trace_offset, label, path)
        if self.chief and problem is None:
            self.trace_path = path
        elif self.chief:  # the run itself went well: say so, and what was lost
            self.say(f"mpidist: warning: the timeline could not be written to {path} ({problem})")

    def abandon(self):
        """The run was refused at start-up (on another rank, say): close, and take back the metrics file and
        the checkpoint directories made for it, where nothing was written there."""
        if self.log is not None:
            self.log.discard()
        self.close()
        checkpoint_save.remove_unused(self.made)
        self.made = []

    def close(self):
        """Let go of ``--checkpoint-dir`` (the chief's lock) and close what is open: the run writes no
        more."""
        if self.claim is not None:
            self.claim.release()
        for part in (self.progress, self.log_copy, self.board):
            if part is not None:
                part.close()
        self.claim = self.progress = self.log_copy = self.board = None
