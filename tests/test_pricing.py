"""The price of a run, item by item: pure functions of its settings, tested without MPI (the end-to-end bound,
under a real limit, is tests/test_memory_price.py's)."""

import pytest

from mpidist.loop.rehearsed import in_flight
from mpidist.runtime.memory import human
from mpidist.runtime.price import Price, said


@pytest.mark.parametrize(
    "schedule,stages,micro,held",
    [
        ("gpipe", 4, 8, [8, 8, 8, 8]),  # every micro-batch's activations at the peak
        ("1f1b", 4, 8, [4, 3, 2, 1]),  # P - s in flight
        ("1f1b", 4, 2, [2, 2, 2, 1]),  # never more than there are
        ("gpipe", 1, 3, [3]),
    ],
)
def test_a_stage_holds_the_micro_batches_its_schedule_keeps_in_flight(schedule, stages, micro, held):
    assert [in_flight(schedule, stage, stages, micro) for stage in range(stages)] == held


def test_a_price_is_what_a_rank_holds_and_every_item_and_says_them_all(monkeypatch):
    price = Price(held=100 << 20).add("training state", 30 << 20).add("data", 0).add("threads", 16 << 20)
    assert price.items == [("training state", 30 << 20), ("threads", 16 << 20)]  # (nothing for none)
    assert price.total == 146 << 20 and price.more == 46 << 20
    monkeypatch.setattr("mpidist.runtime.price.holdable", lambda: (46 << 20, "enough"))
    assert price.refusal("training") is None
    monkeypatch.setattr("mpidist.runtime.price.holdable", lambda: ((46 << 20) - 1, "this process's limit"))
    assert price.refusal("training") == (
        f"training needs {human(146 << 20)} in all on this rank (100.0 MiB held already, 30.0 MiB training "
        "state, 16.0 MiB threads), more than this process's limit"
    )
    assert said([5 << 20, 1536 << 20, 7]).startswith("mpidist: memory: 1,536.0 MiB a rank at most (rank 1)")


def test_the_memory_probe_thread_has_left_the_system_before_settle_returns():
    """A thread started right after Python's join() of another got a stack of its own (the C library had not
    cached the joined one's yet): 8 MiB more in 1 price of 20.  _exited waits until the thread is gone."""
    import os
    import threading

    from mpidist.runtime.memory import _exited

    for _ in range(20):
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()
        _exited(thread.native_id)
        assert not os.path.exists(f"/proc/self/task/{thread.native_id}")
