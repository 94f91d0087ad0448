"""The chief's progress display: a bar on a terminal, plain lines elsewhere."""

import io

import pytest

from mpidist.loop.metrics import Progress


@pytest.fixture(autouse=True)
def _a_terminal_120_columns_wide(monkeypatch):
    """The bar fits the terminal (a narrower one cuts it): its width is this test's, not whatever terminal,
    or none, the tests run at (``COLUMNS`` is what the bar asks first)."""
    monkeypatch.setenv("COLUMNS", "120")


class Terminal(io.StringIO):
    def isatty(self):
        return True


FIGURES = {"loss": 0.25, "accuracy": 0.9, "samples": 100}


def test_on_a_terminal_a_bar_shows_the_step_rate_time_left_and_loss_with_evaluations_above_it():
    screen = Terminal()
    progress = Progress("auto", 100, 2, stream=screen)
    assert progress.mode == "bar"
    progress.bar.mininterval, progress.bar.miniters, progress.bar.dynamic_miniters = 0, 1, False  # draw each
    for step in range(10, 101, 10):
        progress.update(step, (step - 1) // 50, 1.0 / step, 1234.0)
        if step == 50:
            progress.evaluated(step, 0, 0.02, FIGURES)
    progress.close()
    progress.close()  # (idempotent: the end and the release both close it)
    text = screen.getvalue()
    assert "epoch 2/2 100%|" in text and "100/100" in text and "step/s" in text and "<00:00" in text
    assert "loss 0.0100, 1,234 samples/s" in text
    (line,) = [part for part in text.split("\r") if "test accuracy" in part]
    assert line.startswith("epoch   1/2  step     50  loss 0.0200") and line.endswith("s\n")
    assert text.endswith("\r")  # the bar is taken off before the summary


def test_elsewhere_only_the_evaluations_are_printed_as_whole_lines():
    log = io.StringIO()
    progress = Progress("auto", 100, 2, stream=log)
    assert progress.mode == "lines"
    progress.update(10, 0, 0.5, 100.0)
    progress.evaluated(50, 0, 0.02, FIGURES)
    progress.close()
    assert (
        "\r" not in log.getvalue() and log.getvalue().count("\n") == 1 and "test accuracy" in log.getvalue()
    )
    quiet = io.StringIO()
    progress = Progress("none", 100, 2, stream=quiet)
    progress.update(10, 0, 0.5, 100.0)
    progress.evaluated(50, 0, 0.02, FIGURES)
    assert quiet.getvalue() == ""


def test_a_resumed_run_starts_its_bar_where_it_resumes():
    screen = Terminal()
    progress = Progress("bar", 100, 2, stream=screen, start_step=60)
    progress.close()
    assert "60/100" in screen.getvalue()
