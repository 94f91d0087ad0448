"""Lanes: every sample of an epoch once, whatever the worker count does, in memory and streamed.

Pure functions of :mod:`mpidist.data.lanes` and :mod:`mpidist.data.order`
first (no file), then shards in memory and streams of a file whose samples
carry their row number (``x[i, 0] == i``): what each worker's batches hold,
against closed-form expectations and against one worker holding every lane.
Then real runs (:func:`test_a_run_stopped_on_4_workers_and_resumed_on_3_trains_each_sample_once_an_epoch`),
which record the rows each worker trained on (``MPIDIST_TEST_RECORD``).
"""

import collections
import dataclasses
import itertools
import json
import re
import tracemalloc

import numpy as np
import pytest
from test_stream import directory, write

from mpidist import data
from mpidist.data import order as order_module
from mpidist.data.blocks import lane_share, order_units
from mpidist.data.lanes import Lanes, stream_bounds
from mpidist.data.order import LaneOrder
from mpidist.runtime.errors import UsageError

from conftest import checkpoint_at, epochs_of, mpidist, trained_rows


def lanes_of(batch, workers):
    return [Lanes.of(batch, workers, w) for w in range(workers)]


@pytest.mark.parametrize("batch,workers", [(64, 4), (10, 3), (7, 7), (100, 6), (5, 1)])
def test_a_worker_s_lanes_are_its_local_batch_after_the_earlier_workers(batch, workers):
    found = lanes_of(batch, workers)
    assert [lane.count for lane in found] == [
        data.local_batch_size(batch, workers, w) for w in range(workers)
    ]
    assert [lane.first for lane in found] == [sum(lane.count for lane in found[:w]) for w in range(workers)]
    assert found[-1].first + found[-1].count == batch and all(lane.total == batch for lane in found)


@pytest.mark.parametrize("n,batch", [(40, 8), (37, 10), (1003, 64)])
def test_lanes_are_balanced_contiguous_ranges(n, batch):
    bounds = stream_bounds(n, batch)
    assert bounds[0] == 0 and bounds[-1] == n and (np.diff(bounds) >= 0).all()
    assert np.diff(bounds).tolist() == Lanes(batch, 0, batch).sizes(n).tolist()


@pytest.mark.parametrize("size", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_a_keyed_feistel_permutes_any_range_and_undoes_itself(size):
    for key in (0, 1, 2**63 + 5):
        placed = order_module.permute(np.arange(size), size, np.uint64(key))
        assert sorted(placed.tolist()) == list(range(size))
        assert order_module.permute(placed, size, np.uint64(key), inverse=True).tolist() == list(range(size))
    if size >= 1000:  # another key, another permutation; neither near the identity
        other = order_module.permute(np.arange(size), size, np.uint64(2))
        assert (other != placed).mean() > 0.9 and abs(np.corrcoef(placed, np.arange(size))[0, 1]) < 0.1
    huge = 10**11  # any position of a range of 10^11 in a few operations: no table
    assert 0 <= int(order_module.permute(huge - 1, huge, np.uint64(3))) < huge


ORDERS = [
    (40, 8, 2, 2),
    (37, 10, 3, 1),
    (1003, 64, 4, 3),
    (1003, 12, 7, 2),
    (100, 3, 7, 3),
    (61, 6, 64, 1),
    (500, 4, 9, 1),
    (500, 4, 1, 500),
]


@pytest.mark.parametrize("n,batch,unit,window", ORDERS)
def test_each_lane_s_order_is_its_rows_once_and_its_windows_give_the_same_order(n, batch, unit, window):
    """Position by position (a shard in memory) and window by window (a stream): the same rows, each once."""
    order = LaneOrder(n, batch, unit, window)
    for seed, epoch in [(0, 0), (3, 1)]:
        for lane in range(batch):
            first, end = (int(bound) for bound in stream_bounds(n, batch)[lane : lane + 2])
            size = end - first
            rows = order.rows(lane, np.arange(size), seed, epoch)
            assert sorted(rows.tolist()) == list(range(first, first + size))
            streamed, start = [], 0
            for found in order.windows([lane], seed, epoch, 0, size):
                assert found.start == start and found.rows <= unit * window
                assert all(hi - lo <= unit for lo, hi in found.units) and len(found.units) <= window
                held = [row for lo, hi in found.units for row in range(lo, hi)]
                streamed += [held[i] for i in order.window_order(found.rows, seed, epoch, lane, found.index)]
                start += found.rows
            assert streamed == rows.tolist()
            for position in range(0, size, 5):  # the window holding any one position, alone
                [alone] = order.windows([lane], seed, epoch, position, position + 1)
                assert alone.start <= position < alone.start + alone.rows


def global_batch_rows(n, batch, workers, seed, epoch, skip=0, unit=3, window=4):
    """Row numbers of each step's global batch, workers' batches side by side."""
    order = LaneOrder(n, batch, unit, window)
    steps = np.arange(skip, n // batch)[:, None]
    return np.concatenate(
        [order.rows(lanes.ids[None, :], steps, seed, epoch) for lanes in lanes_of(batch, workers)], axis=1
    )


@pytest.mark.parametrize("n,batch", [(1003, 12), (240, 24), (61, 6)])
def test_the_global_batch_of_every_step_is_each_lane_s_next_sample_for_any_worker_count(n, batch):
    one = global_batch_rows(n, batch, 1, seed=7, epoch=3)
    assert one.shape == (n // batch, batch)
    assert len(set(one.ravel().tolist())) == n // batch * batch  # each sample once, n mod B left out
    bounds = stream_bounds(n, batch)
    assert all(bounds[lane] <= row < bounds[lane + 1] for lane, column in enumerate(one.T) for row in column)
    for workers in range(2, 7):
        assert np.array_equal(global_batch_rows(n, batch, workers, seed=7, epoch=3), one), workers


def test_a_resume_at_any_step_continues_each_lane_exactly():
    n, batch = 500, 10
    for workers in (1, 3):
        whole = global_batch_rows(n, batch, workers, seed=2, epoch=1)
        for skip in (0, 1, 17, 49, 50):
            assert np.array_equal(
                global_batch_rows(n, batch, workers, seed=2, epoch=1, skip=skip), whole[skip:]
            )


def co_occurring(batches):
    """The pairs of samples that share a batch, as a set of ``(low, high)``."""
    return {pair for batch in batches for pair in itertools.combinations(sorted(batch), 2)}


def test_batches_differ_from_epoch_to_epoch_as_chance_has_it():
    """The pairs sharing a batch in one epoch share one in the next about as often as random pairs do (B/n):
    a design that kept batches nearly fixed across epochs (the reverted virtual shards) fails it."""
    n, batch = 2000, 20
    first = co_occurring(global_batch_rows(n, batch, 1, seed=0, epoch=0, unit=100, window=1).tolist())
    second = co_occurring(global_batch_rows(n, batch, 1, seed=0, epoch=1, unit=100, window=1).tolist())
    chance = batch / n
    assert len(first & second) / len(first) < 2 * chance
    assert not np.array_equal(
        global_batch_rows(n, batch, 1, seed=0, epoch=0), global_batch_rows(n, batch, 1, seed=1, epoch=0)
    )


def test_the_order_s_memory_is_the_same_at_a_million_rows_and_at_a_hundred_billion():
    """A step's rows and the windows around any position of a lane: the same few arrays at 10^6 rows and 10^11
    (traced by tracemalloc, which counts numpy's allocations)."""

    def peak(n):
        order = LaneOrder(n, 64, 16384, 4)
        middle = n // 64 // 2
        tracemalloc.start()
        order.rows(np.arange(64)[None, :], np.arange(middle, middle + 8)[:, None], seed=1, epoch=2)
        windows = list(order.windows(np.arange(32, 64), 1, 2, middle, middle + 8))
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(windows) >= 32
        return top

    small, large = peak(10**6), peak(10**11)
    assert large < small * 1.1 + 4096 and large < 1 << 20, (small, large)


# -- shards in memory and streams of a file ------------------------------------------------------------------
def rows_of(batches):
    return [[int(v) for v in np.asarray(x).reshape(len(x), -1)[:, 0]] for x, _ in batches]


def opened(info, mode, lanes, buffer=64):
    if mode == "memory":
        return data.Shard(info, "train", 0, 1, (4,), np.float32, lanes=lanes, buffer=buffer)
    return data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=buffer, lanes=lanes)


def epoch_of(info, mode, batch, workers, seed, epoch, skip=0, buffer=64):
    """Each step's global batch (rows), its workers' batches side by side, from step ``skip`` on."""
    steps = info.sizes["train"] // batch
    parts = []
    for lanes in lanes_of(batch, workers):
        batches = opened(info, mode, lanes, buffer).batches(steps, seed, epoch, skip=skip)
        parts.append(rows_of(batches))
        batches.close()
    return [sum(step, []) for step in zip(*parts)]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_workers_batches_make_the_same_global_batches_for_any_worker_count(tmp_path, mode):
    rows, batch = 1000, 24  # 41 steps, 16 rows left out
    info = data.inspect(write(tmp_path / "rows.h5", rows, chunk=8))
    one = epoch_of(info, mode, batch, 1, seed=5, epoch=2)
    assert len(one) == rows // batch and all(len(step) == batch for step in one)
    flat = sum(one, [])
    assert len(set(flat)) == len(flat) == rows // batch * batch
    for workers in (2, 3, 4, 5, 6):
        assert epoch_of(info, mode, batch, workers, seed=5, epoch=2) == one, workers
    bounds = stream_bounds(rows, batch)  # the lanes' rows: contiguous ranges
    assert all(bounds[lane] <= row < bounds[lane + 1] for step in one for lane, row in enumerate(step))
    assert epoch_of(info, mode, batch, 3, seed=5, epoch=3) != one


@pytest.mark.parametrize("buffer", [24, 100, 5000])
def test_in_memory_and_streamed_the_order_is_the_same_on_any_worker_count(tmp_path, buffer):
    """The order is the run's (seed, epoch, global batch, buffer): a resume or a shrink that switches between
    memory and stream (another worker count, another budget) goes on with the very same samples."""
    rows, batch = 1000, 24
    info = data.inspect(write(tmp_path / "rows.h5", rows, chunk=8))
    streamed = epoch_of(info, "stream", batch, 1, seed=4, epoch=1, buffer=buffer)
    for workers in (1, 3):
        assert epoch_of(info, "memory", batch, workers, seed=4, epoch=1, buffer=buffer) == streamed
    mixed = epoch_of(info, "memory", batch, 4, seed=4, epoch=1, buffer=buffer)[:9] + epoch_of(
        info, "stream", batch, 2, seed=4, epoch=1, skip=9, buffer=buffer
    )
    assert mixed == streamed


@pytest.mark.parametrize("mode", ["memory", "stream"])
@pytest.mark.parametrize("stop", [1, 13, 40])
def test_a_shrink_from_4_to_3_workers_midway_trains_every_row_of_the_epoch_once(tmp_path, mode, stop):
    rows, batch = 1000, 24
    info = data.inspect(write(tmp_path / "rows.h5", rows, chunk=8))
    before = epoch_of(info, mode, batch, 4, seed=1, epoch=0)[:stop]
    after = epoch_of(info, mode, batch, 3, seed=1, epoch=0, skip=stop)
    trained = collections.Counter(row for step in before + after for row in step)
    assert len(before) + len(after) == rows // batch
    assert set(trained.values()) == {1} and len(trained) == rows // batch * batch
    assert before + after == epoch_of(info, mode, batch, 1, seed=1, epoch=0)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_file_sorted_by_label_gives_every_batch_its_share_of_each_class(tmp_path, mode):
    """5 classes stored in 5 runs of 200 rows: lanes are ranges of the file, so each batch, one sample a lane,
    holds B/5 of each class."""
    rows, batch = 1000, 20
    info = data.inspect(write(tmp_path / "rows.h5", rows, chunk=8))
    for step in epoch_of(info, mode, batch, 2, seed=0, epoch=0):
        assert collections.Counter(row * 5 // rows for row in step) == {c: batch // 5 for c in range(5)}


def test_a_stream_s_windows_are_its_lanes_share_of_the_buffer_in_units_of_a_quarter_of_it(tmp_path):
    rows, batch = 2000, 10
    info = data.inspect(write(tmp_path / "rows.h5", rows, chunk=16))
    stream = data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=400, lanes=Lanes(batch, 2, 3))
    assert stream.share == lane_share(400, rows, batch) == 40
    assert (stream.lo, stream.hi) == (400, 1000) and len(stream) == 600
    # units: a quarter of the share, whatever the file's chunks of 16 rows; windows: as many units as hold
    # the share.  Nothing but the rows, the buffer, the sample's size and the lanes decide them
    assert order_units(rows, 400, (4,), batch) == (10, 4)
    assert order_units(rows, 4000, (4,), batch) == (50, 4)  # (shares of 200)
    assert order_units(rows, 4000, (2, 2), batch) == (50, 4)  # (a sample's size, not its shape)
    assert order_units(rows, 40, (4,), batch) == (1, 4)  # (one row at least)
    assert order_units(rows, 4000, (2**20,), batch) == (1, 200)  # (4 MiB of float32 a unit at most)
    assert order_units(rows, 2000, (4,), 1000) == (1, 2)  # (a lane's rows at most: 2)
    assert (stream.order.unit, stream.order.window) == (10, 4)
    assert stream.pool.rows == 40 and stream.pool.slots == 2 * 3
    for window in stream._schedule(0, 0, 0, 200):
        assert window.rows == 40
        first = 400 + 200 * window.lane  # (a unit is 10 rows from its lane's first)
        assert all((lo - first) % 10 == 0 and hi - lo == 10 for lo, hi in window.units)


def test_a_lane_that_fits_its_share_is_ordered_alike_whatever_the_files_chunks(tmp_path):
    """A lane of one window is a permutation of its rows alone: the same samples stored in other chunks (or
    held as arrays in memory) train in the same order, in memory and streamed."""
    rows, batch = 1000, 24
    orders = []
    for chunk in (8, 100, None):
        info = data.inspect(write(tmp_path / f"rows-{chunk}.h5", rows, chunk=chunk))
        orders.append(epoch_of(info, "stream", batch, 2, seed=3, epoch=1, buffer=rows))
        orders.append(epoch_of(info, "memory", batch, 3, seed=3, epoch=1, buffer=rows))
    assert all(order == orders[0] for order in orders)
    assert orders[0] != epoch_of(info, "memory", batch, 3, seed=3, epoch=2, buffer=rows)


def stored_alike(tmp_path, rows):
    """The same ``rows`` rows (``x[i, 0] == i``) stored six ways: chunks of 8 and of 100 rows, contiguous,
    gzip chunks of 7, float64 values in chunks of 64, and three files of gzip chunks of 16."""
    ways = {
        "chunks of 8": dict(chunk=8),
        "chunks of 100": dict(chunk=100),
        "contiguous": dict(),
        "gzip chunks of 7": dict(chunk=7, compression="gzip"),
        "float64 in chunks of 64": dict(chunk=64, dtype=np.float64),
    }
    infos = {
        name: data.inspect(write(tmp_path / f"way-{index}.h5", rows, **flags))
        for index, (name, flags) in enumerate(ways.items())
    }
    thirds = [rows // 3, rows // 3 + 67, rows - 2 * (rows // 3) - 67]
    infos["3 files"] = data.inspect(directory(tmp_path, thirds, chunk=16, compression="gzip"))
    return infos


@pytest.mark.parametrize("mode", ["memory", "stream"])
@pytest.mark.parametrize("buffer", [96, 480])
def test_the_order_is_the_same_whatever_the_files_chunks_compression_dtype_or_cut_into_files(
    tmp_path, mode, buffer
):
    """Lanes of several windows (41 or 42 rows a lane; shares of 4 and of 20 samples): the same rows stored
    any way train on the same global batch at every step, in memory and streamed, on 2 and 3 workers, as one
    worker holding them as a contiguous file in memory does."""
    rows, batch = 1000, 24
    unit, window = order_units(rows, buffer, (4,), batch)
    assert unit * window < rows // batch  # (several windows a lane: the units' order counts)
    infos = stored_alike(tmp_path, rows)
    expected = epoch_of(infos["contiguous"], "memory", batch, 1, seed=3, epoch=1, buffer=buffer)
    for name, info in infos.items():
        for workers in (2, 3):
            assert epoch_of(info, mode, batch, workers, seed=3, epoch=1, buffer=buffer) == expected, (
                name,
                workers,
            )
    assert expected != epoch_of(infos["contiguous"], "memory", batch, 1, seed=3, epoch=2, buffer=buffer)


def test_a_stream_reads_its_first_windows_at_set_up_and_the_next_epoch_s_while_the_last_batches_train(
    tmp_path,
):
    info = data.inspect(write(tmp_path / "rows.h5", 700, chunk=8))
    lanes = Lanes(9, 3, 4)
    fresh, ahead = (
        data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=90, lanes=lanes) for _ in range(2)
    )
    steps = 700 // 9
    for epoch in range(2):
        for skip in (0, 11):
            expected = rows_of(fresh.batches(steps, 2, epoch, skip=skip))
            ahead.prime(2, epoch, skip)
            assert len(ahead._ahead) == lanes.count  # the window holding the step, of each lane
            assert rows_of(ahead.batches(steps, 2, epoch, skip=skip)) == expected
    batches = ahead.batches(steps, 2, 5)  # read to its end: epoch 6's first windows are read too
    assert len(list(batches)) == steps
    batches.close()
    assert sorted(key[:3] for key in ahead._ahead) == [(2, 6, lane) for lane in range(3, 7)]
    assert {key[3] for key in ahead._ahead} == {0}
    assert rows_of(ahead.batches(steps, 2, 6)) == rows_of(fresh.batches(steps, 2, 6))
    batches = ahead.batches(steps, 2, 7, last_epoch=True)  # the run's last epoch: nothing of the next is read
    assert len(list(batches)) == steps
    batches.close()
    assert not ahead._ahead


def test_a_stream_closed_early_lets_its_threads_go_and_gives_the_same_batches_after(tmp_path):
    import threading

    info = data.inspect(write(tmp_path / "rows.h5", 600, chunk=8))
    stream = data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=40, lanes=Lanes(6, 0, 6))
    expected = rows_of(stream.batches(100, 0, 0))
    before = set(threading.enumerate())
    batches = stream.batches(100, 0, 0)
    next(iter(batches))
    started = set(threading.enumerate()) - before
    assert len(started) == 2  # the one reading windows, the one gathering batches
    batches.close()
    assert not any(thread.is_alive() for thread in started)
    assert rows_of(stream.batches(100, 0, 0)) == expected


def test_gathering_takes_a_segment_of_steps_at_a_time(tmp_path, monkeypatch):
    """Batches come from one take per segment of steps, not per sample: a segment holds several steps."""
    info = data.inspect(write(tmp_path / "rows.h5", 3000, chunk=8))
    stream = data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=3000, lanes=Lanes(10, 0, 10))
    batches = list(stream.batches(300, 0, 0))
    bases = {id(x.base) for x, _ in batches}
    assert len(batches) == 300 and len(bases) < 300 / 4


# -- real runs: the rows each worker trained on, recorded (MPIDIST_TEST_RECORD) ------------------------------
ROWS, BATCH, STEPS = 1000, 48, 20  # 20 steps an epoch, 40 rows left out of each


def recorded_run(tmp_path, ranks, folder, *flags):
    (tmp_path / folder).mkdir(exist_ok=True)
    done, _ = mpidist(
        ranks,
        "train",
        "--data",
        str(tmp_path / "rows.h5"),
        "--model",
        "mlp:4",
        "--epochs",
        "2",
        "--batch-size",
        str(BATCH),
        "--lr",
        "1e-9",
        "--dtype",
        "float64",
        "--metrics",
        "",
        "--progress",
        "none",
        "--eval-every",
        "0",
        *flags,
        env={"MPIDIST_TEST_RECORD": str(tmp_path / folder)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"{STEPS} steps/epoch" in done.stdout, done.stdout
    return done


def assert_each_sample_once_an_epoch_as_one_worker_trains(trained, reference):
    """Each epoch of ``trained`` trains on each of its rows once, and each step on the rows one worker's
    does."""
    assert (
        sorted(trained) == sorted(reference) == [(epoch, step) for epoch in range(2) for step in range(STEPS)]
    )
    for key, rows in reference.items():
        assert trained[key] == rows, key  # the same global batch, step by step
    for epoch, rows in epochs_of(trained).items():
        assert set(rows.values()) == {1} and len(rows) == STEPS * BATCH, (epoch, rows.most_common(3))
    assert all(trained[0, step] != trained[1, step] for step in range(STEPS))  # the next epoch, other batches


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_run_stopped_on_4_workers_and_resumed_on_3_trains_each_sample_once_an_epoch(tmp_path, mode):
    """Stopped at step 13 of the first epoch on 4 workers, resumed on 3 to the end of the second: every epoch
    trains on each of its 960 rows once, and every step on the global batch a 1-worker run trains on."""
    write(tmp_path / "rows.h5", ROWS, chunk=10)
    flags = ["--data-mode", mode, "--shuffle-buffer", "96", "--checkpoint-dir", str(tmp_path / "ck")]
    recorded_run(tmp_path, 4, "split", *flags, "--steps", "13")
    done = recorded_run(tmp_path, 3, "split", *flags, "--resume", "auto")
    assert "resumed from" in done.stdout and "ckpt-00000013-" in done.stdout
    recorded_run(tmp_path, 1, "one", "--data-mode", mode, "--shuffle-buffer", "96")
    trained = trained_rows(tmp_path / "split")
    assert_each_sample_once_an_epoch_as_one_worker_trains(trained, trained_rows(tmp_path / "one"))
    # (steps 0..12 came from 4 workers, the rest from 3: each line is a worker's batch)
    lines = [
        line.split()[:3]
        for path in (tmp_path / "split").glob("*.txt")
        for line in path.read_text().splitlines()
    ]
    assert sorted({(int(step) < 13, workers) for epoch, step, workers in lines if epoch == "0"}) == [
        (False, "3"),
        (True, "4"),
    ]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_run_resumed_on_its_rows_rewritten_in_other_chunks_trains_each_sample_once_an_epoch(tmp_path, mode):
    """Stopped at step 13, the file rewritten with the same rows in gzip chunks of 37 rows (chunks of 10
    before), resumed with the same flags: every epoch trains on each of its rows once, step by step as one
    worker on the rewritten file, and nothing is said of the dataset (it is the same one)."""
    write(tmp_path / "rows.h5", ROWS, chunk=10)
    flags = ["--data-mode", mode, "--shuffle-buffer", "192", "--checkpoint-dir", str(tmp_path / "ck")]
    recorded_run(tmp_path, 2, "split", *flags, "--steps", "13")
    write(tmp_path / "rows.h5", ROWS, chunk=37, compression="gzip")
    done = recorded_run(tmp_path, 2, "split", *flags, "--resume", "auto")
    assert "resumed from" in done.stdout and "ckpt-00000013-" in done.stdout
    said = done.stdout + done.stderr
    assert "not the dataset" not in said and "may come twice" not in said and "data order" not in said
    recorded_run(tmp_path, 1, "one", "--data-mode", mode, "--shuffle-buffer", "192")
    assert_each_sample_once_an_epoch_as_one_worker_trains(
        trained_rows(tmp_path / "split"), trained_rows(tmp_path / "one")
    )


@pytest.mark.parametrize(
    "first,then",
    [
        (["--data-mode", "memory"], ["--data-mode", "stream"]),
        (["--data-mode", "stream"], ["--data-mode", "memory"]),
        # the very same flags: 4 workers hold their 240 rows in memory; 2 workers' 480 rows stream
        (["--memory-budget", "16K"], ["--memory-budget", "16K"]),
    ],
)
def test_a_run_resumed_on_another_worker_count_and_data_mode_trains_each_sample_once_an_epoch(
    tmp_path, first, then
):
    """Stopped at step 13 on 4 workers, resumed on 2 in the other mode, with the buffer the run started with
    (its checkpoint's): each epoch trains on each of its rows once, step by step as one worker with that
    buffer."""
    import h5py

    write(tmp_path / "rows.h5", ROWS, chunk=2)  # (a window holds whole chunks: small ones, for the budget)
    flags = ["--checkpoint-dir", str(tmp_path / "ck")]
    started = recorded_run(tmp_path, 4, "split", *flags, *first, "--steps", "13")
    done = recorded_run(tmp_path, 2, "split", *flags, *then, "--resume", "auto")
    with h5py.File(checkpoint_at(tmp_path / "ck", 13)) as handle:
        buffer = json.loads(handle.attrs["config"])["shuffle_buffer"]
    assert buffer > 0 and "resumed from" in done.stdout
    modes = [re.findall(r"worker +\d+ +cpu +(\w+)", run.stdout) for run in (started, done)]
    assert modes[0] and modes[1] and set(modes[0]).isdisjoint(modes[1]), modes  # the mode did switch
    recorded_run(tmp_path, 1, "one", "--shuffle-buffer", str(buffer))
    assert_each_sample_once_an_epoch_as_one_worker_trains(
        trained_rows(tmp_path / "split"), trained_rows(tmp_path / "one")
    )


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_a_worker_s_lanes_are_read_from_a_file_as_one_selection_of_evenly_spaced_runs(tmp_path, compression):
    from mpidist.data.rows import read_runs, regular_runs
    import h5py

    path = write(tmp_path / "rows.h5", 1003, chunk=7, compression=compression)
    with h5py.File(path) as handle:
        item = handle["train/x"]
        for lanes in (Lanes.of(64, 4, 1), Lanes.of(10, 3, 2), Lanes.of(13, 2, 0), Lanes.of(64, 4, 3)):
            q, extra = divmod(1003, lanes.total)  # a strided selection: rows q * B + l of the lanes l
            rows = np.sort(
                np.concatenate([np.arange(q + (lane < extra)) * lanes.total + lane for lane in lanes.ids])
            )
            for lo, hi in [(0, 1003), (5, 600), (333, 1003)]:  # (a file's part of the rows)
                part = rows[(rows >= lo) & (rows < hi)]
                runs = regular_runs(part)
                assert runs is not None and runs[3] >= 1 and runs[4] == lanes.count and runs[2] == lanes.total
                np.testing.assert_array_equal(read_runs(item, part, runs), item[...][part])
    assert regular_runs([1, 2, 5, 6, 9]) == (2, 5, 2, 1, 2, 1)
    assert (
        regular_runs([1, 2, 5, 6, 7, 9, 10, 14]) is None and regular_runs([0, 3, 4, 7, 8, 12, 13, 20]) is None
    )
    assert regular_runs([3, 4, 5]) is None and regular_runs([3, 4, 8]) is None  # fewer than three runs


def test_a_resume_with_another_batch_size_mid_epoch_says_it_cuts_other_lanes():
    import types

    from mpidist.loop.resuming import recipe_changes
    from mpidist.settings.config import Settings

    resume = types.SimpleNamespace(config={"batch_size": 64}, path="ck.h5", epoch=1, epoch_step=5)
    notes = recipe_changes(Settings(batch_size=32), resume)
    assert len(notes) == 2 and "--batch-size 64 -> 32" in notes[0]
    assert notes[1] == (
        "note: --batch-size 32 cuts the training split into 32 lanes, not 64: epoch 2 goes on from "
        "step 5 of the new lanes' orders, so some of its samples may come twice or not at all; every "
        "later epoch trains on each sample once"
    )
    assert (
        len(
            recipe_changes(
                Settings(batch_size=32), types.SimpleNamespace(**{**vars(resume), "epoch_step": 0})
            )
        )
        == 1
    )
    assert recipe_changes(Settings(batch_size=64), resume) == []


def test_a_resume_mid_epoch_of_a_checkpoint_written_in_another_data_order_says_so(tmp_path):
    """A checkpoint records the data order its position is in: one written by an earlier version (whose units
    followed the files' chunks), or saying none, resumed mid-epoch gets a note, and one of a run that held out
    a validation split another; at an epoch's end, or written in today's order, none."""
    import h5py

    from mpidist.loop.resuming import order_changes
    from mpidist.settings.config import Settings
    from mpidist.store import checkpoint
    from mpidist.store.checkpoint_save import DATA_ORDER

    def changes(loaded, **flags):
        return order_changes(Settings(**flags), loaded)

    path = checkpoint.save(tmp_path, np.zeros(3), {}, 0, 7, 1, 7, '{"val_fraction": 0.1}', seed=2, workers=1)
    assert checkpoint.load(path).data_order == DATA_ORDER and changes(checkpoint.load(path)) == []
    assert changes(checkpoint.load(path), val_fraction=0.1) == []
    earlier = "lanes of the global batch as contiguous ranges, each ordered per epoch in windows of units"
    for recorded in (earlier, None):
        with h5py.File(path, "a") as handle:
            order = json.loads(handle.attrs["data_order"])
            if recorded is None:
                order.pop("scheme")
            else:
                order["scheme"] = recorded
            handle.attrs["data_order"] = json.dumps(order)
        loaded = checkpoint.load(path)
        assert loaded.data_order == (recorded or "")
        assert changes(loaded) == [
            f"note: {path} was written in another data order than this mpidist's (an earlier version's): "
            "epoch 2 goes on from step 7 in this one's, so some of its samples may come twice or not at all; "
            "every later epoch trains on each sample once"
        ]
        assert changes(dataclasses.replace(loaded, epoch_step=0)) == []
        (held,) = changes(dataclasses.replace(loaded, epoch_step=0), val_fraction=0.1)
        assert held.startswith(f"note: --val-fraction holds out other rows than the run that wrote {path}")
        assert changes(dataclasses.replace(loaded, epoch_step=0, config={}), val_fraction=0.1) == []
    with h5py.File(path, "a") as handle:  # (untrusted: a scheme that is not text is refused, named)
        handle.attrs["data_order"] = json.dumps({"scheme": 5})
    with pytest.raises(UsageError, match="attribute data_order has scheme 5; it must be a text of the order"):
        checkpoint.load(path)


@pytest.mark.mpi(min_size=2)
def test_between_graph_workers_train_on_the_global_batches_one_process_trains_on():
    """allreduce on every rank of the world (3, 4, 6 workers...) and one process, 30 steps of mlp in float64,
    between-graph: each worker reads its own lanes, and the parameters agree to rounding (the gradient is
    summed in another order): the same samples at every step."""
    import io

    from mpi4py import MPI

    import mpidist

    quiet = dict(
        metrics="", progress="none", eval_every=0, data="digits", steps=30, batch_size=60, dtype="float64"
    )
    one = mpidist.train("mlp", strategy="local", comm=MPI.COMM_SELF, stream=io.StringIO(), **quiet)
    many = mpidist.train("mlp", strategy="allreduce", stream=io.StringIO(), **quiet)
    if many.is_chief:
        assert np.abs(many.params - one.params).max() < 1e-9


@pytest.mark.parametrize(
    ("n", "batch", "workers", "said"),
    [
        (127, 64, 1, "127 training samples at --batch-size 64: an epoch is 1 step, and the other 63 (50%) "),
        (150, 64, 2, "--batch-size 75 trains every sample every epoch"),  # (75 divides 150: two steps)
        (101, 40, 1, "--batch-size 50 leaves out 1"),  # (101 is prime: the fewest left out, nearest 40)
        (1438, 64, 1, None),  # (the bundled digits: 30 left out, 2%: not said)
        (128, 64, 1, None),
    ],
)
def test_an_epoch_that_leaves_out_a_tenth_or_more_says_so_and_which_batch_size_would_not(
    n, batch, workers, said
):
    from mpidist.data import left_out

    note = left_out(n, batch, workers)
    assert note is None if said is None else said in note


def test_a_run_on_a_small_table_says_what_each_epoch_leaves_out(tmp_path):
    import io

    import mpidist

    rng = np.random.default_rng(0)
    x, y = rng.random((127 + 40, 4), dtype=np.float32), rng.integers(0, 2, 127 + 40)
    arrays = mpidist.ArrayData(train=(x[:127], y[:127]), test=(x[127:], y[127:]), name="small")
    said = io.StringIO()
    mpidist.train("mlp:8", arrays, epochs=1, run_dir="", metrics="", progress="none", stream=said)
    assert (
        "mpidist: note: 127 training samples at --batch-size 64: an epoch is 1 step, and the other 63 (50%) "
        "wait for a later epoch (each epoch draws its own order); --batch-size 127 trains every sample every "
        "epoch" in said.getvalue()
    )
