"""What the chief reports: JSON-lines metrics, a progress display, a summary.

Metrics file (contract): one JSON object per line, strict JSON (a figure that
is NaN or Inf, as a skipped step's loss, is ``null``), appended (a resumed run
continues the same file), flushed line by line so ``tail -f`` shows progress
and a crash loses nothing already written.  Events: ``start``, ``step`` (every
``--log-every`` steps), ``eval`` (after each evaluation), ``done`` (last).
"""

import json
import math
import os
import shutil
import stat
import sys
import time

from ..nn.scores import progress_text
from ..runtime.errors import UsageError
from ..runtime.whereabouts import here
from ..store import atomic, removal


def strict(value):
    """``value`` with every NaN or Inf float (in its dicts, lists and tuples) as None: each line strict JSON,
    ``null`` where Python's ``json`` would write ``NaN``, which jq, JavaScript and most parsers refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


class MetricsLog:
    """Appends events to a JSONL file; ``path=''`` writes nothing.

    Each line goes out in one ``write`` call on an append-only descriptor.  A
    write that fails (a full disk, a quota, ``/dev/full``) is cut back to the
    last whole line, the log stops writing, and :attr:`failure` says why: the
    training loop then ends the run as a failure at the next step boundary
    (checkpoint first), like any other.  A line cut short by a crash is
    removed when the file is next opened.
    """

    def __init__(self, path):
        self.fd, self.path, self.failure = None, path, None
        self.created = False  # whether opening it made the file (a run refused at start-up takes it back)
        self.made = []  # the directories made for it (taken back with it)
        if path:
            try:
                self.made = removal.make_directories(os.path.dirname(os.path.abspath(path)))
                with here().doing("io", f"opening --metrics {path}"):
                    _check_writable_target(path)
                    self.created = not os.path.lexists(path)
                    self.fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | atomic.NO_FOLLOW, 0o644)
                    if not _drop_partial_line(self.fd):
                        self.close()
                        raise UsageError(
                            f"--metrics {path}: ends inside a line mpidist did not write: not a "
                            "metrics file (appending would change its last line); give another "
                            "--metrics"
                        )
            except OSError as err:
                raise UsageError(f"--metrics {path}: cannot open for appending ({err.strerror})") from None

    def write(self, event, **fields):
        if self.fd is None:
            return
        line = (json.dumps(strict({"event": event, **fields}), allow_nan=False) + "\n").encode("utf-8")
        start = _size(self.fd)
        try:
            written = 0
            while written < len(line):
                written += os.write(self.fd, line[written:])
        except OSError as err:
            self.failure = f"--metrics {self.path}: a write failed ({err.strerror})"
            _truncate(self.fd, start)
            self.close()

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def discard(self):
        """Close; and remove the file if opening it made it and nothing was written (a refused run)."""
        written = self.fd is not None and _size(self.fd) > 0
        self.close()
        if self.created and not written:
            removal.remove_file(self.path)
            removal.remove_made(self.made)


def _check_writable_target(path):
    """Refuse what an append would block on or cannot hold: a FIFO, a socket, a directory; and a symbolic
    link, which an append would write through (into whatever file it points to: never an output's rule, see
    :mod:`mpidist.store.atomic`)."""
    try:
        kind = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(kind):
        raise UsageError(
            f"--metrics {path}: is a symbolic link; mpidist appends to a file itself, never through a "
            "link: name the file it points to, or another"
        )
    if stat.S_ISDIR(kind):
        raise UsageError(f"--metrics {path}: is a directory")
    if stat.S_ISFIFO(kind) or stat.S_ISSOCK(kind):
        raise UsageError(
            f"--metrics {path}: is a FIFO or socket, not a file (a write could wait forever for a reader)"
        )


def _size(fd):
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None


def _truncate(fd, size):
    """Cut a regular file back to ``size`` bytes (devices have no size to cut back to)."""
    if size is not None:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass


PARTIAL = b'{"event": '  # how every line this log writes begins


def _drop_partial_line(fd):
    """If a regular file ends inside a line of ours (a crash mid-write), cut that line off; False if not ours.

    Only a line that begins as this log's lines do is cut: a file that ends
    inside any other line is someone else's, and is left as it is.
    """
    size = _size(fd)
    if not size or not stat.S_ISREG(os.fstat(fd).st_mode):
        return True
    tail_start = max(0, size - 65536)
    tail = os.pread(fd, size - tail_start, tail_start)
    if tail.endswith(b"\n"):
        return True
    cut = tail.rfind(b"\n")
    if (cut < 0 and tail_start > 0) or not tail[cut + 1 :].startswith(PARTIAL[: len(tail) - cut - 1]):
        return False
    _truncate(fd, tail_start + cut + 1)
    return True


def last_step_logged(path, tail=65536):
    """The step of the last ``step`` event in metrics file ``path`` (its last ``tail`` bytes), or 0.

    The file is the run's own, but read as any file is: a line that does not
    parse, or an event without an integer step, is passed over.
    """
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - tail))
            lines = handle.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "step" and isinstance(event.get("step"), int):
            return event["step"]
    return 0


class Progress:
    """Terminal output of the chief.

    ``bar``: a progress bar (:mod:`tqdm`) with the step, the rate, the time
    left, the loss and samples/s, redrawn in place, each evaluation printed
    above it; ``lines``: one line per evaluation (log files, Slurm's output
    files); ``none``: silent until the summary.  ``auto``: a bar where the
    chief's output is a terminal, else lines.  Other ranks print nothing.
    """

    def __init__(self, mode, total_steps, epochs, stream=None, start_step=0):
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if _is_terminal(self.stream) else "lines"
        self.mode, self.total, self.epochs = mode, max(total_steps, 1), epochs
        self.start = time.perf_counter()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            width = shutil.get_terminal_size((100, 24)).columns  # (a pty that reports no size: 100)
            self.bar = tqdm(
                total=self.total,
                initial=min(start_step, self.total),
                file=self.stream,
                unit="step",
                ncols=min(width, 140),
                leave=False,
                desc=f"epoch 1/{epochs}",
                smoothing=0.1,
                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                "[{elapsed}<{remaining}, {rate_fmt}{postfix}]",
            )

    def update(self, step, epoch, loss, samples_per_s):
        if self.bar is None:
            return
        self.bar.set_description_str(f"epoch {epoch + 1}/{self.epochs}", refresh=False)
        self.bar.set_postfix_str(f"loss {loss:.4f}, {samples_per_s:,.0f} samples/s", refresh=False)
        self.bar.update(min(step, self.total) - self.bar.n)

    def evaluated(self, step, epoch, loss, figures, split="test"):
        """One line after an evaluation of ``split``: ``figures`` (:mod:`~mpidist.nn.scores`), accuracy or
        MSE, MAE, R^2."""
        if self.mode == "none":
            return
        elapsed = time.perf_counter() - self.start
        line = (
            f"epoch {epoch + 1:>3}/{self.epochs}  step {step:>6}  loss {loss:.4f}  "
            f"{progress_text(figures, split)}  {elapsed:6.1f} s"
        )
        if self.bar is not None:
            self.bar.clear()
            self.stream.write(line + "\n")
            self.bar.refresh()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        """Take the bar off the terminal (before the summary); idempotent."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream without one, or closed
        return False


def format_summary(rows):
    """Two-column text table of ``(label, value)`` rows."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)
