"""What the chief reports: JSON-lines metrics, a progress display, a summary.

Metrics file (contract): one JSON object per line, appended (a resumed run
continues the same file), flushed line by line so ``tail -f`` shows progress
and a crash loses nothing already written.  Events: ``start``, ``step`` (every
``--log-every`` steps), ``eval`` (after each evaluation), ``done`` (last).
"""

import json
import os
import sys
import time

from .errors import UsageError


class MetricsLog:
    """Appends events to a JSONL file; ``path=''`` writes nothing."""

    def __init__(self, path):
        self.handle = None
        if path:
            try:
                directory = os.path.dirname(os.path.abspath(path))
                os.makedirs(directory, exist_ok=True)
                self.handle = open(path, "a", encoding="utf-8")
            except OSError as err:
                raise UsageError(f"--metrics {path}: cannot open for appending ({err.strerror})") from None

    def write(self, event, **fields):
        if self.handle is not None:
            self.handle.write(json.dumps({"event": event, **fields}) + "\n")
            self.handle.flush()

    def close(self):
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class Progress:
    """Terminal output of the chief.

    ``bar`` redraws one line (for terminals), ``lines`` prints one line per
    evaluation (for log files), ``none`` is silent until the summary.
    """

    def __init__(self, mode, total_steps, epochs, stream=None):
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode, self.total, self.epochs = mode, max(total_steps, 1), epochs
        self.start = time.perf_counter()

    def update(self, step, epoch, loss, samples_per_s):
        if self.mode != "bar":
            return
        width = 24
        filled = int(width * min(step, self.total) / self.total)
        self.stream.write(f"\r epoch {epoch + 1}/{self.epochs} [{'#' * filled}{'.' * (width - filled)}] "
                          f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s ")
        self.stream.flush()

    def evaluated(self, step, epoch, loss, test_loss, accuracy):
        if self.mode == "none":
            return
        prefix = "\r" if self.mode == "bar" else ""
        elapsed = time.perf_counter() - self.start
        line = (f"epoch {epoch + 1:>3}/{self.epochs}  step {step:>6}  loss {loss:.4f}  "
                f"test loss {test_loss:.4f}  test accuracy {100 * accuracy:5.1f}%  {elapsed:6.1f} s")
        self.stream.write(f"{prefix}{line:<100}\n")
        self.stream.flush()


def format_summary(rows):
    """Two-column text table of ``(label, value)`` rows."""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)
