"""Backup workers' rounds as literal tables, without MPI: which notes a round takes, stops, checkpoints, NaN,
clipping."""

import math

import numpy as np
import pytest

from mpidist.parallel.ps.backup_rounds import ACCEPTED as A
from mpidist.parallel.ps.backup_rounds import STALE as S
from mpidist.parallel.ps.backup_rounds import (
    Closing,
    Note,
    Round,
    Rounds,
    RoundUpdate,
    Tally,
    admit,
    close_round,
    closed,
    encode_round,
    open_round,
    round_update,
    tally_notes,
)
from mpidist.parallel.base import SkipCounter
from mpidist.runtime.errors import RunError


@pytest.mark.parametrize(
    "version, limit, read, status",
    [
        (3, 10, 3, A),  # computed on the current version: taken
        (3, 10, 2, S),  # on an older one: stale, dropped
        (0, 10, 0, A),
        (9, 10, 9, A),  # the last step
        (10, 10, 10, S),  # after the last step nothing is taken: the note is only answered
        (4, 4, 3, S),
    ],
)
def test_a_note_is_accepted_only_on_the_current_version_before_the_last(version, limit, read, status):
    assert admit(Tally.empty(3), Note(1, read), version, limit).statuses == (0, status, 0)


def test_a_tally_keeps_the_largest_stop_signal_its_notes_carried():
    tally = Tally.empty(3)
    for note in [Note(0, 5), Note(2, 5, signal=15), Note(1, 4, signal=10)]:
        tally = admit(tally, note, 5, 10)
    assert tally == Tally((A, S, A), 15) and tally.accepted == 2


def test_a_note_from_a_worker_that_does_not_exist_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match="worker 3, but there are 3 workers"):
        admit(Tally.empty(3), Note(3, 0), 0, 10)


@pytest.mark.parametrize(
    "statuses, version, limit, aggregate, done",
    [
        ((A, 0, 0), 5, 10, 2, False),  # 1 of R=2
        ((A, S, 0), 5, 10, 2, False),  # a stale note does not count
        ((A, S, A), 5, 10, 2, True),  # R of W
        ((A, A, A), 5, 10, 3, True),  # R = W: every worker
        ((0, 0, 0), 10, 10, 2, False),  # after the last step: nothing heard yet
        ((0, S, 0), 10, 10, 2, True),  # ... each note closes a round of its own
    ],
)
def test_a_round_closes_on_r_accepted_or_after_the_last_step_on_any_note(
    statuses, version, limit, aggregate, done
):
    assert closed(Tally(statuses), version, limit, aggregate) is done


@pytest.mark.parametrize(
    "arrivals, version, limit, aggregate, statuses, left",
    [
        # R=2 of W=4: the first two on version 5 make the step; worker 1's (on 4) is stale; worker 3 waits for
        # the next
        ([(0, 5), (1, 4), (2, 5), (3, 5)], 5, 10, 2, (A, S, A, 0), [(3, 5)]),
        # R = W: every worker's gradient
        ([(2, 0), (0, 0), (1, 0), (3, 0)], 0, 10, 4, (A, A, A, A), []),
        # stale notes all drop until R name the version
        ([(0, 1), (1, 1), (2, 1), (3, 2), (0, 2)], 2, 10, 2, (A, S, S, A), []),
        # after the last step one note makes a round: each worker is answered, one at a time
        ([(1, 9), (0, 10)], 10, 10, 2, (0, S, 0, 0), [(0, 10)]),
    ],
)
def test_the_coordinator_takes_notes_until_the_round_closes_and_leaves_the_rest(
    arrivals, version, limit, aggregate, statuses, left
):
    notes = iter([Note(worker, read) for worker, read in arrivals])
    assert tally_notes(notes, 4, version, limit, aggregate).statuses == statuses
    assert list(notes) == [Note(worker, read) for worker, read in left]


def test_notes_that_run_out_before_the_round_closes_say_how_far_it_got():
    with pytest.raises(ValueError, match=r"round 5 closed \(1 of 2 accepted, statuses \(1, 2, 0\)\)"):
        tally_notes(iter([Note(0, 5), Note(1, 4)]), 3, 5, 10, 2)


def test_a_note_travels_as_three_int64_and_back():
    words = Note(2, 7, 15).encode()
    assert words.dtype == np.int64 and words.tolist() == [2, 7, 15]
    assert Note.decode(words) == Note(2, 7, 15)


@pytest.mark.parametrize(
    "parts, version, limit, expected",
    [
        # only the coordinator's statuses are nonzero; nobody asked to stop
        ([[A, S, 0, 0, 0], [0, 0, 0, 0, 0]], 5, 10, Round((A, S, 0), 10, False)),
        # another ps got a signal: the next version becomes the last
        ([[A, S, A, 0, 0], [0, 0, 0, 15, 0]], 5, 10, Round((A, S, A), 6, False)),
        # a stop already moved the limit: asking again changes nothing
        ([[0, S, 0, 15, 0], [0, 0, 0, 10, 0]], 6, 6, Round((0, S, 0), 6, False)),
        # the coordinator decided a checkpoint after the last update: written before this round changes
        # anything
        ([[A, A, 0, 0, 1], [0, 0, 0, 0, 0]], 3, 10, Round((A, A, 0), 10, True)),
    ],
)
def test_every_ps_opens_the_same_round_from_the_parts_combined_by_maximum(parts, version, limit, expected):
    # what allreduce_max does
    combined = np.maximum.reduce([np.array(part, dtype=np.int64) for part in parts])
    assert open_round(combined, version, limit) == expected


def test_a_ps_part_of_the_decision_is_statuses_signal_and_checkpoint():
    assert encode_round((A, S, 0), 15, True).tolist() == [1, 2, 0, 15, 1]
    assert encode_round((0, 0), 0, False).dtype == np.int64


def test_a_round_hears_every_worker_with_a_status_and_accepts_only_the_accepted():
    round_ = Round((A, 0, S, A), 10)
    assert round_.heard == (0, 2, 3)
    assert [round_.accepts(worker) for worker in range(4)] == [True, False, False, True]


@pytest.mark.parametrize(
    "statuses, limit, version, moved, coordinator, periodic, expected",
    [
        # an update before the last version: nobody stops; the coordinator asks about a checkpoint at the new
        # version
        ((A, A, 0), 10, 4, True, True, True, Closing(5, (), True)),
        ((A, A, 0), 10, 4, True, False, True, Closing(5, (), False)),  # (another ps never asks)
        ((A, A, 0), 10, 4, True, True, False, Closing(5, (), False)),  # (no periodic checkpoints)
        # the update that reaches the last version: everyone heard is told to stop; no checkpoint (the final
        # one follows)
        ((A, S, A), 5, 4, True, True, True, Closing(5, (0, 1, 2), False)),
        # the last rounds: nothing taken, the version stays, the worker heard is told to stop
        ((0, S, 0), 5, 5, False, True, True, Closing(5, (1,), False)),
        # no gradient with weight: the version does not move
        ((A, 0, 0), 10, 4, False, True, True, Closing(4, (), False)),
    ],
)
def test_a_round_closes_with_the_next_version_its_stops_and_the_checkpoint_question(
    statuses, limit, version, moved, coordinator, periodic, expected
):
    assert close_round(Round(statuses, limit), version, moved, coordinator, periodic) == expected


def run_rounds(workers, aggregate, total_steps, arrivals, signals=None, due=()):
    """A whole run of one ps (the coordinator) and its workers, without MPI.

    Workers answered send their next note at once, behind the notes waiting;
    ``arrivals`` orders the first notes.  ``signals``: worker ->
    (version, signal) its note carries from that version on.  ``due``:
    versions at which a checkpoint is due.  Returns the rounds as
    ``(version, statuses, checkpoint, version after, told to stop)``.
    """
    ps, views = (
        Rounds(total_steps, aggregate, workers),
        [Rounds(total_steps, aggregate, workers) for _ in range(workers)],
    )
    waiting = [views[w].note(w) for w in arrivals]
    table = []
    while not ps.over:
        for worker, (at, signal) in (signals or {}).items():
            waiting = [
                note._replace(signal=signal) if note.worker == worker and note.read >= at else note
                for note in waiting
            ]
        notes = iter(waiting)
        statuses = ps.tally(notes).statuses
        waiting = list(notes)
        version = ps.version
        round_ = ps.open(ps.decision(statuses))
        closing = ps.close(
            round_, moved=any(round_.accepts(w) for w in range(workers)), coordinator=True, periodic=True
        )
        if closing.ask_checkpoint:
            ps.checkpoint_due = closing.version in due
        table.append((version, statuses, round_.checkpoint, closing.version, closing.stopped))
        for worker in round_.heard:  # the reply: each worker learns the version and the last one
            if not views[worker].learn(ps.limit, ps.version):
                waiting.append(views[worker].note(worker))
    assert waiting == []  # no note is left unanswered
    return table


def test_r_of_w_makes_each_step_a_late_note_is_stale_and_the_last_round_answers_the_one_left():
    # W=3, R=2, 3 steps: worker 2's first note comes third, after the step it was for
    assert run_rounds(3, 2, 3, arrivals=[0, 1, 2]) == [
        (0, (A, A, 0), False, 1, ()),
        (1, (A, A, S), False, 2, ()),
        (2, (A, A, 0), False, 3, (0, 1)),
        (3, (0, 0, S), False, 3, (2,)),
    ]


def test_with_one_gradient_a_step_the_last_rounds_answer_every_worker_one_at_a_time():
    assert run_rounds(3, 1, 1, arrivals=[0, 1, 2]) == [
        (0, (A, 0, 0), False, 1, (0,)),
        (1, (0, S, 0), False, 1, (1,)),
        (1, (0, 0, S), False, 1, (2,)),
    ]


def test_a_stop_signal_in_a_note_makes_the_next_version_the_last():
    table = run_rounds(2, 2, 10, arrivals=[0, 1], signals={1: (3, 15)})
    assert table == [
        (0, (A, A), False, 1, ()),
        (1, (A, A), False, 2, ()),
        (2, (A, A), False, 3, ()),
        (3, (A, A), False, 4, (0, 1)),  # the note of version 3 asked to stop: 4 is the last
    ]


def test_a_checkpoint_decided_after_an_update_is_written_before_the_next_round_changes_anything():
    table = run_rounds(2, 2, 5, arrivals=[0, 1], due={2, 4})
    assert [(version, checkpoint) for version, _, checkpoint, _, _ in table] == [
        (0, False),
        (1, False),
        (2, True),
        (3, False),
        (4, True),
    ]


def test_no_checkpoint_is_asked_at_the_last_version():
    assert [checkpoint for _, _, checkpoint, _, _ in run_rounds(2, 2, 3, arrivals=[0, 1], due={3})] == [
        False
    ] * 3


def test_a_checkpoint_is_written_once_even_when_the_next_round_takes_no_gradient():
    # the round after the checkpoint reaches the last version; the round after that only answers worker 2
    table = run_rounds(3, 2, 3, arrivals=[0, 1, 2], due={2})
    assert [(version, checkpoint, after) for version, _, checkpoint, after, _ in table] == [
        (0, False, 1),
        (1, False, 2),
        (2, True, 3),
        (3, False, 3),
    ]


def test_a_worker_learns_the_version_and_the_last_one_from_each_reply():
    worker = Rounds(total_steps=10, aggregate=1, workers=2)
    worker.signal = 15  # request_stop on this worker: its next note carries it
    assert worker.note(1) == Note(1, 0, 15)
    assert worker.learn(10.0, 4.0) is False and (worker.version, worker.limit) == (4, 10)
    assert not worker.stop_requested
    assert worker.learn(5.0, 5.0) is True and worker.stop_requested


@pytest.mark.parametrize(
    "rounds, expected",
    [
        # (moved, ok) per round -> (apply, loss the reply carries); the round's loss is 2.0, the last one
        # carried 1.0
        ([(True, True)], [RoundUpdate(True, 2.0)]),
        # skipped alike on every shard: NaN tells the workers
        (
            [(True, False)],
            [RoundUpdate(False, math.nan)],
        ),
        ([(False, True)], [RoundUpdate(False, 1.0)]),  # no gradient: the last loss again
        (
            [(True, False), (True, True), (True, False)],  # a good update resets the count in a row
            [RoundUpdate(False, math.nan), RoundUpdate(True, 2.0), RoundUpdate(False, math.nan)],
        ),
    ],
)
def test_nan_gradients_are_skipped_and_the_reply_says_so(rounds, expected):
    guard = SkipCounter(patience=1)
    updates = [round_update(moved, ok, guard, 2.0, 1.0, "x were") for moved, ok in rounds]
    assert [(s.apply, s.loss if math.isfinite(s.loss) else "nan") for s in updates] == [
        (s.apply, s.loss if math.isfinite(s.loss) else "nan") for s in expected
    ]
    assert guard.total == sum(1 for moved, ok in rounds if moved and not ok)


def test_nan_gradients_past_the_patience_end_the_run():
    guard = SkipCounter(patience=2)
    for _ in range(2):
        assert (
            round_update(True, False, guard, 2.0, 1.0, "the accepted gradients of step 7 were").apply is False
        )
    with pytest.raises(RunError, match=r"step 7 were NaN or Inf 3 time\(s\) in a row \(--nan-patience 2\)"):
        round_update(True, False, guard, 2.0, 1.0, "the accepted gradients of step 7 were")
