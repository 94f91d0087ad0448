"""The metrics file: whole lines only, and nobody else's file cut."""

import json

import pytest

from mpidist.loop.metrics import MetricsLog
from mpidist.runtime.errors import UsageError


@pytest.mark.parametrize("tail", ['{"event": "step", "st', '{"ev', "{"])
def test_a_line_of_ours_cut_short_by_a_crash_is_dropped(tmp_path, tail):
    path = tmp_path / "m.jsonl"
    path.write_text('{"event": "start"}\n' + tail)
    log = MetricsLog(str(path))
    log.write("done", steps=3)
    log.close()
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["start", "done"]


@pytest.mark.parametrize("text", ["my notes\nthe last line without a newline", "no newline at all"])
def test_a_file_ending_inside_someone_elses_line_is_refused_and_left_as_it_was(tmp_path, text):
    path = tmp_path / "notes.txt"
    path.write_text(text)
    with pytest.raises(UsageError, match="ends inside a line mpidist did not write: not a metrics file"):
        MetricsLog(str(path))
    assert path.read_text() == text


def test_the_last_step_logged_is_found_past_other_events_and_lines_that_do_not_parse(tmp_path):
    from mpidist.loop.metrics import last_step_logged

    path = tmp_path / "m.jsonl"
    assert last_step_logged(path) == 0  # (no file yet)
    path.write_text(
        '{"event": "step", "step": 69}\n{"event": "checkpoint", "step": 50}\nnot json\n'
        '{"event": "step", "step": "70"}\n'
    )
    assert last_step_logged(path) == 69


def test_off_the_chief_a_reporter_keeps_its_last_step_events_for_a_worker_that_takes_over():
    from mpidist.loop.callbacks import UNWRITTEN, Reporter
    from mpidist.loop.metrics import MetricsLog

    reporter = Reporter(MetricsLog(""), active=False)
    for step in range(1, 20):
        reporter.write("step", step=step, loss=1.0 / step)
        reporter.write("eval", step=step)
    assert [figures["step"] for figures in reporter.unwritten] == list(range(20 - UNWRITTEN, 20))


def test_every_line_is_strict_json_a_nan_or_inf_figure_null():
    """Python's json wrote NaN and Infinity, which jq, JavaScript and most parsers refuse (a skipped step's
    loss, a diverged run's)."""
    import io
    import math
    import os
    import tempfile

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.jsonl")
        log = MetricsLog(path)
        log.write("step", step=3, loss=math.nan, lr=0.1, figures={"a": [math.inf, 1.0, -math.inf]})
        log.write("done", steps=3, roles=[{"rank": 0, "loss": float("nan")}], loss=2.5)
        log.close()
        events = [json.loads(line, parse_constant=refuse) for line in io.open(path).read().splitlines()]
    assert events[0] == {
        "event": "step",
        "step": 3,
        "loss": None,
        "lr": 0.1,
        "figures": {"a": [None, 1.0, None]},
    }
    assert events[1] == {"event": "done", "steps": 3, "roles": [{"rank": 0, "loss": None}], "loss": 2.5}
