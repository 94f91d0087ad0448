"""Pipeline schedules: literal tables, deadlock freedom, activations held, pictures."""

import pytest

from mpidist.parallel.pipeline.schedule import SCHEDULES, Deadlock, bubble, render, schedule, simulate


def test_gpipe_for_two_stages_and_three_micro_batches():
    assert schedule("gpipe", 0, 2, 3) == [
        ("fwd", 0),
        ("send_fwd", 0),
        ("fwd", 1),
        ("send_fwd", 1),
        ("fwd", 2),
        ("send_fwd", 2),
        ("recv_bwd", 0),
        ("bwd", 0),
        ("recv_bwd", 1),
        ("bwd", 1),
        ("recv_bwd", 2),
        ("bwd", 2),
    ]
    assert schedule("gpipe", 1, 2, 3) == [
        ("recv_fwd", 0),
        ("fwd", 0),
        ("recv_fwd", 1),
        ("fwd", 1),
        ("recv_fwd", 2),
        ("fwd", 2),
        ("bwd", 0),
        ("send_bwd", 0),
        ("bwd", 1),
        ("send_bwd", 1),
        ("bwd", 2),
        ("send_bwd", 2),
    ]


def test_1f1b_for_three_stages_and_four_micro_batches():
    def compute(stage):
        return [f"{op[0].upper()}{m}" for op, m in schedule("1f1b", stage, 3, 4) if op in ("fwd", "bwd")]

    assert compute(0) == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert compute(1) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert compute(2) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert schedule("1f1b", 1, 3, 4)[:6] == [
        ("recv_fwd", 0),
        ("fwd", 0),
        ("send_fwd", 0),
        ("recv_fwd", 1),
        ("fwd", 1),
        ("send_fwd", 1),
    ]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 7, 16])
def test_every_schedule_completes_and_holds_what_it_promises(name, stages, micro_batches):
    plans = [schedule(name, s, stages, micro_batches) for s in range(stages)]
    for plan in plans:  # each micro-batch goes forward once and backward once
        assert sorted(m for op, m in plan if op == "fwd") == list(range(micro_batches))
        assert sorted(m for op, m in plan if op == "bwd") == list(range(micro_batches))
    timeline, peak = simulate(plans)
    if name == "gpipe":
        assert peak == [micro_batches] * stages
    else:
        assert peak == [min(stages - s, micro_batches) for s in range(stages)]
        assert max(peak) <= stages
    # with unit-time steps every stage idles exactly the theoretical bubble
    end = max(start for row in timeline for start, _, _ in row) + 1
    assert end == 2 * (micro_batches + stages - 1)
    busy = 2 * micro_batches
    assert (end - busy) / end == pytest.approx(bubble(stages, micro_batches))


def test_a_schedule_whose_stages_wait_on_each_other_is_reported_as_deadlock():
    plans = [schedule("gpipe", 0, 2, 2), schedule("gpipe", 1, 2, 2)]
    plans[1] = [("recv_fwd", 1)] + [a for a in plans[1] if a != ("recv_fwd", 1)]  # waits for the wrong one
    plans[0] = [("recv_bwd", 0)] + plans[0]  # waits before sending
    with pytest.raises(Deadlock, match="wait forever"):
        simulate(plans)


def test_pictures_show_each_stage_over_time():
    assert render("gpipe", 2, 2) == "stage 0  F0 F1 .. .. B0 B1\nstage 1  .. F0 F1 B0 B1 .."
    assert render("1f1b", 2, 2) == "stage 0  F0 F1 .. B0 .. B1\nstage 1  .. F0 B0 F1 B1 .."
