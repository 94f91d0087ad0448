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
