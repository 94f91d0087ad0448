"""Hang diagnosis: the verdict (a pure function), whereabouts, and the monitor ending a stalled job."""

import time

import numpy as np
import pytest

from mpidist.observe.stall import diagnose
from mpidist.runtime.whereabouts import PHASES, Whereabouts


def record(step, phase, seconds):
    return np.array([step, PHASES.index(phase), int(1000 * seconds)], dtype=np.int64)


def verdict(*rows, timeout=5.0, now=100.0):
    """``rows``: per rank ``(step, phase, seconds in phase, seconds since heard)`` or None (never heard)."""
    records = [None if r is None else record(*r[:3]) for r in rows]
    heard = [0.0 if r is None else now - r[3] for r in rows]
    return diagnose(records, heard, now, timeout)


def test_no_verdict_while_every_wait_is_shorter_than_the_timeout():
    assert verdict((7, "exchange", 4.0, 0.5), (7, "compute", 4.5, 0.2)) is None
    assert verdict((7, "compute", 60.0, 0.5), (7, "compute", 60.0, 0.5)) is None  # computing is no wait
    assert verdict((0, "serve", 600.0, 0.1), (9, "compute", 0.1, 0.1)) is None  # nor is serving


def test_the_ranks_elsewhere_are_named_with_where_they_are():
    text = verdict(
        (13, "exchange", 5.5, 0.3),
        (13, "compute", 5.8, 0.1),
        (13, "exchange", 5.2, 0.4),
        (13, "exchange", 0.2, 0.1),
    )
    assert text.startswith("stalled for 5.8 s (--stall-timeout 5): ranks 0, 2 wait in exchange at step 13;")
    assert text.endswith("not arrived: rank 1 (compute at step 13 for 5.9 s)")  # rank 3 just came: not late


def test_a_silent_rank_is_reported_with_where_it_was_last_seen():
    text = verdict((44, "exchange", 6.0, 0.2), (38, "compute", 0.1, 7.0), None)
    assert "rank 0 waits in exchange at step 44" in text
    assert "rank 1 (no report for 7.0 s; last seen in compute at step 38)" in text
    assert "rank 2 (never reported)" in text


def test_a_rank_frozen_in_a_wait_is_silent_not_waiting():
    """Its last report said "waiting"; three reports missed, it no longer counts as a waiter (nor blames
    others)."""
    quiet = (0, "start", 0.3, 1.7)  # reported 1.7 s ago: 3 intervals of 0.4 s missed
    assert verdict((6, "exchange", 1.8, 0.1), quiet, timeout=2.0) is None
    text = verdict((6, "exchange", 2.1, 0.1), quiet, timeout=2.0)
    assert text.endswith(
        "rank 0 waits in exchange at step 6; not arrived: rank 1 (no report for 1.7 s; last seen in "
        "start at step 0)"
    )


def test_a_serving_ps_is_not_blamed_and_ranks_that_all_arrived_mean_a_deadlock():
    text = verdict((3, "staleness-bound", 9.0, 0.1), (0, "serve", 40.0, 0.1), (1, "compute", 9.0, 0.1))
    assert text.endswith(
        "rank 0 waits in staleness-bound at step 3; not arrived: rank 2 (compute at step 1 for 9.1 s)"
    )
    assert verdict((5, "agree", 6.0, 0.1), (5, "agree", 6.0, 0.1)).endswith(
        "every rank is there: a deadlock in MPI"
    )


def test_whereabouts_keep_the_time_a_phase_was_entered():
    where = Whereabouts()
    where.enter("compute", 3)
    since = where.since
    time.sleep(0.01)
    where.enter("compute")  # the same phase again: still the same wait
    assert where.since == since and where.step == 3
    where.enter("exchange")
    assert where.since > since and tuple(where.record()[:2]) == (3, PHASES.index("exchange"))


def test_a_background_threads_reading_leaves_the_training_threads_phase_alone():
    """A stream's reader thread shares the reading code that marks set-up I/O: it must not move the record.

    Before, the reader put the training thread into ``io`` while it computed, and its ``finally`` put the
    training thread back into the phase it had when the read began (here: ``compute``, left meanwhile).
    """
    import threading

    where = Whereabouts()
    where.enter("compute", 7)
    inside, leave = threading.Event(), threading.Event()

    def read():
        with where.doing("io", "reading a block"):
            inside.set()
            leave.wait(5)

    reader = threading.Thread(target=read, name="mpidist-prefetch")
    reader.start()
    assert inside.wait(5)
    assert where.phase == "compute" and where.detail == ""
    where.enter("exchange")
    leave.set()
    reader.join()
    assert where.phase == "exchange"
    with where.doing("io", "opening x"):  # the training thread's own I/O is recorded
        assert where.describe() == "io (opening x) at step 7"
    assert where.phase == "exchange"


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_travels_as_its_index(phase):
    assert PHASES[int(record(1, phase, 0.5)[1])] == phase
