"""Virtual shards: every sample of an epoch trained on exactly once, whatever happens to the worker count.

Pure functions of :mod:`mpidist.data.virtual` first (no file, no MPI), then
the shards in memory and streamed, whose samples carry their row number
(``x[i, 0] == i``): an elastic shrink from 4 workers to 3 midway through an
epoch is the data layer's :func:`~mpidist.data.virtual.advance` and a new
:func:`~mpidist.data.virtual.split`, as the survivors do it.
"""

import collections

import numpy as np
import pytest
from test_stream import write

from mpidist import data
from mpidist.data import virtual
from mpidist.data.held import HeldShards
from mpidist.data.streamed import StreamedShards


def positions(intervals):
    """The ``(shard, position)`` pairs ``intervals`` name, in order."""
    return [(shard, i) for shard, lo, hi in intervals.tolist() for i in range(lo, hi)]


def batch_sizes(global_batch, workers):
    return [data.local_batch_size(global_batch, workers, w) for w in range(workers)]


@pytest.mark.parametrize("rows", [1, 7, 100, 1000, 5003])
def test_memory_shards_tile_the_split_and_never_depend_on_the_workers(rows):
    sizes = virtual.memory_sizes(rows)
    assert len(sizes) == min(rows, virtual.VIRTUAL_SHARDS) and sizes.min() >= 1   # a tiny split: one row a shard
    everything = np.sort(np.concatenate([virtual.memory_rows(rows, v) for v in range(len(sizes))]))
    assert everything.tolist() == list(range(rows))


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_the_pieces_of_an_epoch_are_disjoint_balanced_and_leave_less_than_a_global_batch(workers):
    sizes, batch = virtual.memory_sizes(1003), 24
    pieces = virtual.split(virtual.whole(sizes), batch_sizes(batch, workers))
    steps = 1003 // batch
    assert [virtual.length(p) for p in pieces] == [steps * b for b in batch_sizes(batch, workers)]
    taken = [pair for piece in pieces for pair in positions(piece)]
    assert len(taken) == len(set(taken)) == steps * batch


def test_an_unchanged_worker_count_continues_each_worker_exactly():
    sizes, local = virtual.memory_sizes(1000), batch_sizes(40, 4)
    start = virtual.whole(sizes)
    pieces = virtual.split(start, local)
    for steps in (0, 1, 7, 24, 25):
        again = virtual.split(virtual.advance(start, local, steps), local)
        for piece, rest, size in zip(pieces, again, local):
            assert positions(rest) == positions(piece)[steps * size:]
    assert virtual.advance(virtual.advance(start, local, 3), local, 5).tolist() == \
        virtual.advance(start, local, 8).tolist()


@pytest.mark.parametrize("stop", [1, 9, 17])
def test_a_shrink_from_4_to_3_workers_midway_trains_every_sample_once(stop):
    """Positions (shard, i) a 4-worker segment trains, then a 3-worker one from what is left: each once."""
    rows, batch = 1200, 48
    sizes = virtual.memory_sizes(rows)
    start = virtual.whole(sizes)
    four, three = batch_sizes(batch, 4), batch_sizes(batch, 3)
    trained = collections.Counter()
    for piece, size in zip(virtual.split(start, four), four):
        trained.update(positions(piece)[:stop * size])
    left = virtual.advance(start, four, stop)
    assert virtual.steps_left(left, batch) == rows // batch - stop       # the epoch keeps its length
    for piece in virtual.split(left, three):
        trained.update(positions(piece))
    assert set(trained.values()) == {1} and len(trained) == rows


def test_several_changes_of_the_worker_count_in_one_epoch_train_each_sample_at_most_once_and_all_but_a_batch():
    rows, batch = 1001, 30
    left, trained, steps = virtual.whole(virtual.memory_sizes(rows)), collections.Counter(), 0
    for workers, run in ((5, 4), (2, 3), (6, 10), (3, 100)):
        local = batch_sizes(batch, workers)
        run = min(run, virtual.steps_left(left, batch))
        for piece, size in zip(virtual.split(left, local), local):
            trained.update(positions(piece)[:run * size])
        left, steps = virtual.advance(left, local, run), steps + run
    assert steps == rows // batch and max(trained.values()) == 1 and len(trained) == steps * batch
    assert virtual.length(left) == rows % batch


def worker_rows(shards, local, piece, seed, epoch, skip=0):
    return [int(v) for x, _ in shards.batches(local, piece, seed, epoch, skip=skip) for v in x[:, 0]]


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_shrink_from_4_to_3_workers_midway_trains_every_row_once_in_memory_and_streamed(tmp_path, mode):
    rows, batch, stop = 2000, 40, 13
    info = data.inspect(write(tmp_path / "rows.h5", rows, chunk=16))

    def shards():
        if mode == "memory":
            return HeldShards(info, "train", (4,), np.float32)
        return StreamedShards(info, "train", (4,), np.float32, buffer=64)

    sizes = shards().shard_sizes
    if mode == "stream":
        assert 1 < len(sizes) <= rows // 64                  # every shard holds a buffer's worth of blocks
    start, four, three = virtual.whole(sizes), batch_sizes(batch, 4), batch_sizes(batch, 3)
    seen = collections.Counter()
    for w, piece in enumerate(virtual.split(start, four)):
        got = worker_rows(shards(), four[w], piece, seed=3, epoch=1)
        assert len(got) == rows // batch * four[w]
        seen.update(got[:stop * four[w]])
    left = virtual.advance(start, four, stop)
    for w, piece in enumerate(virtual.split(left, three)):
        seen.update(worker_rows(shards(), three[w], piece, seed=3, epoch=1))
    assert sorted(seen) == list(range(rows)) and set(seen.values()) == {1}


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_worker_resumed_at_any_step_continues_exactly_and_epochs_differ(tmp_path, mode):
    info = data.inspect(write(tmp_path / "rows.h5", 900, chunk=10))
    make = (lambda: HeldShards(info, "train", (4,), np.float32)) if mode == "memory" else \
        (lambda: StreamedShards(info, "train", (4,), np.float32, buffer=50))
    shards = make()
    local = batch_sizes(30, 3)
    piece = virtual.split(virtual.whole(shards.shard_sizes), local)[1]
    whole = worker_rows(shards, local[1], piece, seed=0, epoch=2)
    for skip in (1, 5, 29):
        assert worker_rows(make(), local[1], piece, seed=0, epoch=2, skip=skip) == whole[skip * local[1]:]
    again = virtual.split(virtual.advance(virtual.whole(shards.shard_sizes), local, 5), local)[1]
    assert worker_rows(make(), local[1], again, seed=0, epoch=2) == whole[5 * local[1]:]
    assert worker_rows(shards, local[1], piece, seed=0, epoch=3) != whole
    assert sorted(worker_rows(shards, local[1], piece, seed=0, epoch=3)) != sorted(range(300))   # a strided mix


def test_a_worker_in_memory_holds_its_part_and_at_most_two_shards_more(tmp_path):
    rows = 5000
    info = data.inspect(write(tmp_path / "rows.h5", rows))
    local = batch_sizes(64, 3)
    for piece in virtual.split(virtual.whole(virtual.memory_sizes(rows)), local):
        shards = HeldShards(info, "train", (4,), np.float32)
        shards.hold(piece)
        assert len(shards) <= virtual.length(piece) + 2 * -(-rows // virtual.VIRTUAL_SHARDS)


def trained(folder):
    """``{epoch: Counter of rows}`` the workers of every run recorded in ``folder`` (``MPIDIST_TEST_RECORD``)."""
    counts = collections.defaultdict(collections.Counter)
    for path in folder.glob("worker-*.txt"):
        for line in path.read_text().splitlines():
            epoch, *rows = map(int, line.split())
            counts[epoch].update(rows)
    return counts


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_a_run_stopped_on_4_workers_midway_and_resumed_on_3_trains_each_sample_once_an_epoch(tmp_path, mode):
    """960 rows, global batch 48: 20 steps an epoch.  Stopped at step 13, resumed on 3 workers to the end of
    epoch 2: each epoch trained every row exactly once."""
    from conftest import mpidist
    dataset, record = write(tmp_path / "rows.h5", 960, chunk=10), tmp_path / "record"
    record.mkdir()
    common = ["train", "--data", str(dataset), "--model", "mlp:4", "--epochs", "2", "--batch-size", "48",
              "--lr", "1e-9", "--dtype", "float64", "--metrics", "", "--progress", "none", "--eval-every", "0",
              "--checkpoint-dir", str(tmp_path / "ck"), "--data-mode", mode, "--shuffle-buffer", "64"]
    env = {"MPIDIST_TEST_RECORD": str(record)}
    done, _ = mpidist(4, *common, "--steps", "13", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "20 steps/epoch" in done.stdout
    done, _ = mpidist(3, *common, "--resume", "auto", env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "20 steps/epoch" in done.stdout and "note: --resume" not in done.stdout
    counts = trained(record)
    assert sorted(counts) == [0, 1]
    for epoch, rows in counts.items():
        assert sorted(rows) == list(range(960)) and set(rows.values()) == {1}, (epoch, rows.most_common(3))


@pytest.mark.parametrize("remaining,problem", [
    ([[0, 5, 3]], "holds interval"),                 # empty (end before first)
    ([[9, 0, 1]], "holds interval"),                 # a shard it does not have
    ([[1, 0, 8]], "holds interval"),                 # past its shard's end
    ([[0, 0, 4], [0, 3, 5]], "holds overlapping"),       # a sample twice
])
def test_a_checkpoint_s_data_position_round_trips_and_a_bad_one_is_refused_naming_it(tmp_path, remaining, problem):
    import h5py

    from mpidist.runtime.errors import UsageError
    from mpidist.store import checkpoint

    def save(left):
        return checkpoint.save(tmp_path, np.zeros(3), {}, 0, 7, 0, 7, "{}", 1, 4,
                               data_position=(np.array(left, dtype=np.int64), np.array([6, 6, 5])))
    good = checkpoint.load(save([[0, 2, 6], [2, 0, 5]]))
    assert good.remaining.tolist() == [[0, 2, 6], [2, 0, 5]] and good.shard_sizes.tolist() == [6, 6, 5]
    path = save(remaining)
    with pytest.raises(UsageError, match=f"{path}: data_position/remaining {problem}"):
        checkpoint.load(path)
    with h5py.File(path, "r+") as handle:    # not integers
        del handle["data_position/remaining"]
        handle["data_position/remaining"] = np.zeros((1, 3))
    with pytest.raises(UsageError, match="data_position/remaining is not an array of integers"):
        checkpoint.load(path)
