"""An output claimed before the work, then written whole, its failures worded for every caller
(store.outputs)."""

import os

import pytest

from mpidist.runtime.errors import UsageError
from mpidist.store import outputs


def test_a_claimed_output_is_created_aside_at_once_and_replaces_the_old_file_whole(tmp_path):
    final = tmp_path / "preds.h5"
    final.write_text("old")
    with outputs.claimed(final, "the predictions") as claim:
        assert claim.aside == tmp_path / f".preds.h5.tmp-{os.getpid()}" and claim.aside.exists()
        claim.write(lambda aside: aside.write_text("new"))
    assert final.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.h5"]


@pytest.mark.parametrize("what", ["the dataset", "the predictions"])
def test_an_output_under_a_regular_file_is_refused_naming_what_and_why(tmp_path, what):
    (tmp_path / "plain").write_text("a file")
    out = tmp_path / "plain" / "deeper" / "out.h5"
    with pytest.raises(UsageError) as refused:
        with outputs.claimed(out, what):
            pytest.fail("the body ran for an unwritable output")
    assert str(refused.value) == f"{out}: cannot write {what} there: {tmp_path / 'plain'}: {os.strerror(20)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_an_output_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(UsageError, match=f"cannot write the predictions there: {os.strerror(21)}$"):
        with outputs.claimed(tmp_path, "the predictions"):
            pytest.fail("the body ran for an unwritable output")


def test_a_failed_write_names_what_and_leaves_the_old_file_and_no_aside(tmp_path):
    final = tmp_path / "new" / "deeper" / "d.h5"

    def full_disk(aside):
        aside.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(UsageError) as refused:
        with outputs.claimed(final, "the dataset") as claim:
            claim.write(full_disk)
    assert str(refused.value) == f"{final}: cannot write the dataset there: {os.strerror(28)}"
    assert list(tmp_path.iterdir()) == []  # the directories made for it are gone too


def test_a_body_that_fails_before_writing_leaves_the_old_file_and_no_aside(tmp_path):
    final = tmp_path / "preds.h5"
    final.write_text("old")
    with pytest.raises(ValueError, match="bad rows"):
        with outputs.claimed(final, "the predictions"):
            raise ValueError("bad rows")
    assert final.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.h5"]


def test_an_error_without_an_errno_is_shown_by_its_text_made_printable():
    err = OSError("unable to create file (\x1b[2J)")
    assert (
        str(outputs.unwritable("o.h5", "the predictions", err))
        == "o.h5: cannot write the predictions there: unable to create file (\\x1b[2J)"
    )
    reason = outputs.unwritable("o.h5", "the dataset", "a reason")
    assert str(reason) == "o.h5: cannot write the dataset there: a reason"


def test_an_output_that_is_a_fifo_is_refused_and_stays_a_fifo(tmp_path):
    import stat

    pipe = tmp_path / "pipe.h5"
    os.mkfifo(pipe)
    with pytest.raises(UsageError) as refused:
        with outputs.claimed(pipe, "the predictions"):
            pytest.fail("the body ran for a FIFO")
    assert "cannot write the predictions there: it is a named pipe (FIFO)" in str(refused.value)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pipe.h5"]
    assert (
        outputs.special_kind("/dev/null") == "a character device" and outputs.special_kind(tmp_path) is None
    )


def test_a_fifo_made_after_the_claim_is_refused_before_the_rename(tmp_path):
    import stat

    final = tmp_path / "out.h5"
    with pytest.raises(UsageError, match="named pipe"):
        with outputs.claimed(final, "the dataset") as claim:
            os.mkfifo(final)
            claim.write(lambda aside: aside.write_text("new"))
    assert stat.S_ISFIFO(os.stat(final).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["out.h5"]
