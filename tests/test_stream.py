"""Streaming a worker's lanes of a dataset: chunk-aligned blocks, the shuffle buffer, exact resume, bounded
memory.

Samples here carry their own row number (``x[i, 0] == i``), so every check of
an order is a check of which rows came, in which order, with closed-form
expectations.  What lanes guarantee across worker counts is tests/test_lanes.py's.
"""

import json
import os
import re
import threading
import tracemalloc

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.data import blocks
from mpidist.data import stream as streaming
from mpidist.data.lanes import Lanes
from mpidist.runtime.errors import UsageError
from mpidist.settings.config import Settings

from conftest import checkpoint_at, corrupt_chunk, events, mpidist


def write(
    path, rows, width=4, chunk=None, test_rows=10, offset=0, num_classes=5, compression=None, dtype=np.float32
):
    """A dataset whose sample ``i`` is ``[offset + i, ...]`` (stored as ``dtype``) with label ``(offset + i) %
    num_classes``."""
    numbers = np.arange(offset, offset + rows)
    x = np.repeat(numbers[:, None], width, axis=1).astype(dtype)
    with h5py.File(path, "w") as handle:
        handle.attrs.update(name="rows", num_classes=num_classes, source="test")
        for split, (xs, ys) in {
            "train": (x, numbers % num_classes),
            "test": (x[:test_rows], numbers[:test_rows] % num_classes),
        }.items():
            chunks = (min(chunk, len(xs)), width) if chunk and len(xs) else None
            handle.create_dataset(
                f"{split}/x", data=xs, chunks=chunks, compression=compression if chunks else None
            )
            handle.create_dataset(f"{split}/y", data=ys.astype(np.int64))
    return path


def directory(tmp_path, sizes, chunk=None, test_rows=2, compression=None):
    """A directory of files holding rows ``0..sum(sizes)-1`` of train in order, ``sizes[k]`` in file ``k``."""
    folder = tmp_path / "parts"
    folder.mkdir()
    offset = 0
    for index, rows in enumerate(sizes):
        write(
            folder / f"part-{index}.h5",
            rows,
            chunk=chunk,
            test_rows=test_rows,
            offset=offset,
            compression=compression,
        )
        offset += rows
    return folder


def rows_of(batches):
    return [int(v) for x, _ in batches for v in np.asarray(x).reshape(len(x), -1)[:, 0]]


def test_worker_ranges_tile_the_rows_with_the_sizes_of_strided_shards():
    for n in range(0, 31):
        for workers in range(1, 8):
            ranges = [blocks.worker_range(n, workers, w) for w in range(workers)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert [hi - lo for lo, hi in ranges] == [data.shard_size(n, workers, w) for w in range(workers)]


def test_blocks_are_whole_chunks_of_one_file_each(tmp_path):
    folder = directory(tmp_path, [20, 13, 9], chunk=3)
    info = data.inspect(folder)
    source = data.SplitRows(info, "train", (4,), np.float32)
    # 16-byte rows, 100-byte blocks: 6 rows = two whole chunks of 3
    cuts = blocks.block_cuts(source, 5, 40, block_bytes=100)
    assert cuts.tolist() == [5, 6, 12, 18, 20, 26, 32, 33, 39, 40]
    assert blocks.block_cuts(source, 0, 42, block_bytes=1).tolist() == sorted(
        set(range(0, 20, 3)) | set(range(20, 33, 3)) | set(range(33, 42, 3)) | {42}
    )


def test_a_streamed_epoch_gives_each_row_of_the_lanes_once_in_an_order_of_seed_epoch_and_lanes(tmp_path):
    info = data.inspect(write(tmp_path / "d.h5", 1000, chunk=16))
    part = data.Stream(info, "train", 1, 3, (4,), np.float32, buffer=300, lanes=Lanes.of(30, 3, 1))
    assert (part.lo, part.hi) == (340, 670)  # lanes 10..19 of 30: 33 rows each (the first 10 hold 34)
    steps = 1000 // 30
    seen = rows_of(part.batches(steps, seed=0, epoch=0))
    assert sorted(seen) == list(range(340, 670)) and len(seen) == 330
    again = rows_of(part.batches(steps, seed=0, epoch=0))
    other_epoch = rows_of(part.batches(steps, seed=0, epoch=1))
    assert seen == again and seen != other_epoch
    assert seen != sorted(seen)
    # a batch: one sample of each lane, in lane order
    bounds = np.arange(10, 21) * 33 + 10
    for step in range(steps):
        batch = seen[10 * step : 10 * (step + 1)]
        assert all(bounds[lane] <= row < bounds[lane + 1] for lane, row in enumerate(batch))


@pytest.mark.parametrize("batch", [7, 10, 64])
def test_a_stream_resumed_at_any_step_continues_exactly(tmp_path, batch):
    info = data.inspect(write(tmp_path / "d.h5", 700, chunk=8))
    # windows of at least 8 samples a lane, in units of a chunk: batches span them (every step is resumed at)
    part = data.Stream(
        info, "train", 0, 2, (4,), np.float32, buffer=16 * batch, lanes=Lanes.of(2 * batch, 2, 0)
    )
    steps = 700 // (2 * batch)
    whole = [rows_of([b]) for b in part.batches(steps, seed=5, epoch=2)]
    assert len(whole) == steps
    for skip in range(steps):
        batches = part.batches(steps, seed=5, epoch=2, skip=skip)
        assert [rows_of([b]) for b in batches] == whole[skip:]
        batches.close()


def test_a_stream_stopped_early_lets_its_threads_go(tmp_path):
    info = data.inspect(write(tmp_path / "d.h5", 500, chunk=8))
    before = set(threading.enumerate())
    batches = data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=40, lanes=Lanes(10, 0, 10)).batches(
        50, 0, 0
    )
    next(iter(batches))
    started = set(threading.enumerate()) - before
    assert len(started) == 2  # the one reading windows, the one gathering batches
    batches.close()  # returns: both threads ended, the files closed
    assert not any(thread.is_alive() for thread in started)


def test_a_directory_reads_as_the_concatenation_of_its_files(tmp_path):
    single = data.inspect(write(tmp_path / "d.h5", 42, test_rows=6))
    parts = data.inspect(directory(tmp_path, [20, 13, 9], chunk=3))
    assert parts.sizes == {"train": 42, "test": 6} and len(parts.files) == 3
    for worker in range(3):  # in memory: the same strided shards
        a = data.Shard(single, "train", worker, 3, (4,), np.float32)
        b = data.Shard(parts, "train", worker, 3, (4,), np.float32)
        np.testing.assert_array_equal(a.x, b.x)
        np.testing.assert_array_equal(a.y, b.y)
    streamed = data.Stream(parts, "train", 0, 1, (4,), np.float32, buffer=5)
    assert rows_of(streamed.eval_batches(4)) == list(range(42))
    streamed = data.Stream(parts, "train", 0, 1, (4,), np.float32, buffer=5, lanes=Lanes(6, 0, 6))
    assert sorted(rows_of(streamed.batches(7, 0, 0))) == list(range(42))


def test_files_are_taken_in_natural_order_and_must_agree(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    write(folder / "p-10.h5", 3, offset=3, test_rows=1)
    write(folder / "p-2.h5", 3, offset=0, test_rows=1)
    info = data.inspect(folder)
    assert [m.path.name for m in info.files] == ["p-2.h5", "p-10.h5"]
    assert data.inspect(data.resolve(str(folder / "p-*.h5"))).sizes == info.sizes
    write(folder / "p-11.h5", 3, width=5)
    with pytest.raises(UsageError, match="the files differ in sample shape"):
        data.inspect(folder)
    with pytest.raises(UsageError, match="matches no files"):
        data.inspect(data.resolve(str(tmp_path / "nothing-*.h5")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="a directory with no .h5"):
        data.inspect(tmp_path / "empty")


def test_a_carved_validation_split_streams_exactly_its_rows(tmp_path):
    info = data.carve_validation(data.inspect(write(tmp_path / "d.h5", 300, chunk=7)), 0.2, seed=4)
    for split in ("val", "train"):
        _, rows = info.rows_of(split)
        expected = rows[np.arange(len(rows))]
        got = []
        for worker in range(2):
            part = data.Stream(info, split, worker, 2, (4,), np.float32, buffer=20)
            got += rows_of(part.eval_batches(16))
        assert got == expected.tolist()


def test_bad_rows_in_a_block_are_refused_naming_file_and_row(tmp_path):
    path = write(tmp_path / "d.h5", 100, chunk=10)
    with h5py.File(path, "r+") as handle:
        handle["train/x"][57, 2] = np.nan
    part = data.Stream(data.inspect(path), "train", 0, 1, (4,), np.float32, buffer=20)
    with pytest.raises(UsageError, match=r"d.h5: train/x holds NaN or Inf \(first at sample 57\)"):
        list(part.eval_batches())


def test_a_chunk_that_does_not_decode_is_named_with_the_rows_read_in_memory_and_streamed(tmp_path):
    path = corrupt_chunk(write(tmp_path / "d.h5", 400, chunk=50, compression="gzip"), "train/x", 3)
    info = data.inspect(path)  # (the layout is intact: only the chunk's bytes are not)
    # a read that fails names the rows of the chunk that fails alone (3: rows 150..199), found chunk by chunk
    with pytest.raises(
        UsageError, match=r"d.h5: train/x cannot be read at samples 150..199 \(HDF5: .*filter"
    ):
        data.Shard(info, "train", 0, 1, (4,), np.float32)
    part = data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=400)  # blocks of 100 rows
    with pytest.raises(UsageError, match=r"d.h5: train/x cannot be read at samples 150..199 \(HDF5: "):
        list(part.eval_batches())
    # lanes of 40 rows, units slicing the chunks: the chunk's rows 150..159 of one lane or 160..199 of the
    # next
    part = data.Stream(info, "train", 0, 1, (4,), np.float32, buffer=400, lanes=Lanes(10, 0, 10))
    with pytest.raises(
        UsageError, match=r"d.h5: train/x cannot be read at samples 1(5\d|[6-9]\d)..1[5-9]\d \("
    ):
        list(part.batches(40, 0, 0))


def test_streaming_memory_is_bounded_by_the_buffer_not_the_data(tmp_path):
    rows, width = 12_000, 1000  # 48 MB of float32
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as handle:
        handle.attrs.update(name="big", num_classes=2, source="test")
        for split, n in (("train", rows), ("test", 10)):
            x = handle.create_dataset(
                f"{split}/x", shape=(n, width), dtype=np.float32, chunks=(min(64, n), width)
            )
            for lo in range(0, n, 2000):
                x[lo : lo + 2000] = 1.0
            handle.create_dataset(f"{split}/y", data=np.arange(n) % 2)
    info = data.inspect(path)

    def peak(read):
        tracemalloc.start()
        read()
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top

    # 10 lanes, each 2 windows of at least 50 samples in chunks of 64 rows (256 KB): about 9 MB
    part = data.Stream(info, "train", 0, 1, (width,), np.float32, buffer=500, lanes=Lanes(10, 0, 10))
    streamed = peak(lambda: sum(len(x) for x, _ in part.batches(rows // 10, 0, 0)))
    in_memory = peak(lambda: data.Shard(info, "train", 0, 1, (width,), np.float32))
    assert in_memory > 48e6 and streamed < 16e6, (streamed, in_memory)


def test_the_budget_decides_between_memory_and_stream():
    info = data.DatasetInfo(
        path="d.h5",
        name="d",
        num_classes=10,
        source="",
        sample_shape=(100,),
        sizes={"train": 10_000, "test": 100},
        files=(
            data.Member(
                "d.h5", {"train": 10_000, "test": 100}, {"train": 1, "test": 1}, {"train": 400, "test": 400}
            ),
        ),
    )
    parts = [("train", 5_000), ("test", 50)]  # 5,050 rows of 400 + 400 + 16 bytes: about 4.1 MB
    lanes = Lanes.of(64, 2, 0)  # worker 0 of 2: 32 lanes of 64
    assert data.plan(Settings(memory_budget="5M"), info, parts, (100,), np.float32, lanes).mode == "memory"
    chosen = data.plan(Settings(memory_budget="3M"), info, parts, (100,), np.float32, lanes)
    assert chosen.mode == "stream" and "> budget 3.0 MiB" in chosen.why

    # the widest worker's training stream, and an evaluation's blocks of the whole test split
    def held(
        buffer,
    ):
        return blocks.stream_bytes(
            info, "train", buffer, (100,), np.float32, True, lanes
        ) + blocks.stream_bytes(info, "test", 100, (100,), np.float32, True)

    assert held(chosen.buffer) <= 3 << 20 < held(chosen.buffer + 1)  # the largest that fits
    # the order's buffer is the same in memory: a worker in memory and one streaming take the same samples
    assert (
        data.plan(
            Settings(memory_budget="3M", data_mode="memory"), info, parts, (100,), np.float32, lanes
        ).buffer
        == chosen.buffer
    )
    assert (
        data.plan(Settings(memory_budget="5M"), info, parts, (100,), np.float32, lanes).buffer
        == data.plan(
            Settings(memory_budget="5M", data_mode="stream"), info, parts, (100,), np.float32, lanes
        ).buffer
    )
    assert (
        data.plan(
            Settings(data_mode="memory", memory_budget="1M"), info, parts, (100,), np.float32, lanes
        ).mode
        == "memory"
    )
    assert data.plan(Settings(data_mode="stream"), info, parts, (100,), np.float32, lanes).mode == "stream"
    with pytest.raises(
        UsageError,
        match="--memory-budget 3M: streaming with --shuffle-buffer 100,000 holds about "
        r".* \(2 windows of at least 157 400 B samples for each of its 32 lane",
    ):
        data.plan(
            Settings(memory_budget="3M", shuffle_buffer=100_000), info, parts, (100,), np.float32, lanes
        )


def test_a_shuffle_buffer_beyond_the_budget_is_capped_to_what_fits_or_refused_where_both_were_given(
    monkeypatch,
):
    from mpidist.data import budget

    info = data.DatasetInfo(
        path="d.h5",
        name="d",
        num_classes=10,
        source="",
        sample_shape=(100,),
        sizes={"train": 10_000, "test": 100},
        files=(
            data.Member(
                "d.h5", {"train": 10_000, "test": 100}, {"train": 1, "test": 1}, {"train": 400, "test": 400}
            ),
        ),
    )
    parts, lanes = [("train", 5_000), ("test", 50)], Lanes.of(64, 2, 1)
    monkeypatch.setattr(budget, "default_budget", lambda: 3 << 20)  # --memory-budget auto on a small node
    chosen = data.plan(
        Settings(data_mode="stream", shuffle_buffer=10**9), info, parts, (100,), np.float32, lanes
    )
    assert "(capped)" in chosen.why and chosen.notes[0].startswith(
        f"--shuffle-buffer 1,000,000,000 capped to {chosen.buffer:,} samples"
    )

    # (as every worker sizes it: by the widest worker's lanes, beside an evaluation's blocks)
    def held(
        buffer,
    ):
        return blocks.stream_bytes(
            info, "train", buffer, (100,), np.float32, True, lanes
        ) + blocks.stream_bytes(info, "test", 100, (100,), np.float32, True)

    assert held(chosen.buffer) <= 3 << 20 < held(chosen.buffer + 1)  # the largest that fits
    # a buffer as large as the split orders the lanes as any larger one: kept at the split's size, not capped
    whole = data.plan(
        Settings(data_mode="stream", shuffle_buffer=10**9, memory_budget="1G"),
        info,
        parts,
        (100,),
        np.float32,
        lanes,
    )
    assert whole.buffer == 10_000 and not whole.notes
    with pytest.raises(
        UsageError, match=f"give --shuffle-buffer {chosen.buffer:,} or less, or a larger budget"
    ):
        data.plan(
            Settings(data_mode="stream", shuffle_buffer=10**9, memory_budget=str(3 << 20)),
            info,
            parts,
            (100,),
            np.float32,
            lanes,
        )


def test_a_split_stored_in_one_chunk_streams_in_slices_within_its_budget(tmp_path):
    rows, width = 12_000, 250  # 12 MB of float32 in one chunk
    info = data.inspect(write(tmp_path / "one.h5", rows, width=width, chunk=rows))
    lanes = Lanes(100, 0, 100)  # lanes of 120 rows
    # an evaluation reading whole chunks would hold the chunk; the training order's units slice it whatever
    # the budget (windows of 10 samples a lane here, in units of a quarter of that)
    assert blocks.stream_bytes(info, "train", 1000, (width,), np.float32, sliced=False) > 3 * 12e6
    assert blocks.stream_bytes(info, "train", 1000, (width,), np.float32, sliced=False, lanes=lanes) < 4 << 20
    reading = data.plan(
        Settings(data_mode="stream", memory_budget="4M"), info, [("train", rows)], (width,), np.float32, lanes
    )
    assert "train/x is stored in chunks of 12,000 rows" in reading.notes[0]
    assert (
        blocks.stream_bytes(info, "train", reading.buffer, (width,), np.float32, sliced=True, lanes=lanes)
        <= 4 << 20
    )
    part = reading.open(info, "train", 0, 1, (width,), np.float32, lanes)
    assert part.order.unit < 120  # the order's units: slices of the chunk
    tracemalloc.start()
    got = rows_of(part.batches(rows // 100, 0, 0))
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sorted(got) == list(range(rows)) and top < 4 << 20, top


def test_slices_of_a_compressed_chunk_are_read_one_after_the_other_from_a_cache_of_one_chunk(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    for index in range(2):  # two files, each split in one compressed chunk of 1.2 MB
        write(
            folder / f"part-{index}.h5",
            1000,
            width=300,
            chunk=1000,
            offset=1000 * index,
            test_rows=2,
            compression="gzip",
        )
    info = data.inspect(folder)
    # 4 lanes of 500 rows, two in each chunk; windows of 50 samples in units of 12 (14 KiB): a quarter of the
    # share, whatever the chunks
    part = data.Stream(info, "train", 0, 1, (300,), np.float32, buffer=200, sliced=True, lanes=Lanes(4, 0, 4))
    assert part.order.unit == 12 and part.order.window == 5
    assert sorted(rows_of(part.batches(500, 0, 0))) == list(range(2000))
    handles = {}
    try:
        first, second = (folder / f"part-{index}.h5" for index in range(2))
        part.source.read(np.arange(0, 10), handles)
        x, _ = handles[first, "train"]
        # the chunk is decompressed once
        assert x.id.get_access_plist().get_chunk_cache()[1] >= 1000 * 300 * 4
        part.source.read(np.arange(1000, 1010), handles)
        assert first not in handles and second in handles  # one such file open at a time: one chunk held
    finally:
        streaming._close(handles)
    assert sorted(rows_of(part.batches(500, 0, 0))) == list(range(2000))


def test_a_stream_says_when_its_units_are_smaller_than_the_compressed_chunks_they_read(tmp_path):
    """A unit of the training order is a quarter of a lane's share whatever the chunks: where compressed
    chunks are larger and a lane has several windows, a streaming rank's note says how often a chunk is
    decompressed; uncompressed chunks, smaller ones, a lane of one window and memory say nothing."""
    lanes = Lanes.of(10, 1, 0)
    for chunk, compression, buffer, said in [
        (100, "gzip", 400, True),  # units of 10 rows, windows of 40 of lanes of 100
        (100, None, 400, False),  # (a part of an uncompressed chunk reads just its bytes)
        (100, "gzip", 4000, False),  # (a lane of one window: its units read one after the other)
        (8, "gzip", 400, False),
    ]:
        name = f"d-{chunk}-{compression}-{buffer}.h5"
        info = data.inspect(write(tmp_path / name, 1000, chunk=chunk, compression=compression))
        for mode, expected in (("stream", said), ("memory", False)):
            settings = Settings(data_mode=mode, shuffle_buffer=buffer)
            reading = data.plan(settings, info, [("train", 1000)], (4,), np.float32, lanes)
            notes = [note for note in reading.notes if "decompressed whole for each unit" in note]
            assert bool(notes) == expected, (chunk, compression, buffer, mode, reading.notes)
            if notes:
                assert (
                    "train/x is stored in compressed chunks of 100 rows, more than the training " in notes[0]
                )
                assert "order's units of 10 rows" in notes[0] and "up to 11 times an epoch" in notes[0]


@pytest.mark.parametrize(
    "text,expected",
    [("512M", 512 << 20), ("1.5GiB", 3 << 29), ("2g", 2 << 30), ("100000", 100000), ("64 kb", 64 << 10)],
)
def test_memory_budgets_read_binary_units(text, expected):
    from mpidist.runtime.memory import parse_bytes

    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "1.5X", "nan"])
def test_a_bad_memory_budget_is_refused(text):
    with pytest.raises(UsageError, match="--memory-budget"):
        Settings(memory_budget=text).validate_values()


@pytest.mark.parametrize("ranks,layout", [(2, "file"), (2, "directory"), (4, "directory")])
def test_a_streaming_run_resumes_mid_epoch_exactly(tmp_path, ranks, layout):
    """Stopped at step 13 of 18 per epoch, in epoch 1: the resumed run ends bit-identical to the whole one."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1200, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    source = tmp_path / "src.npz"
    np.savez(source, x=x, y=y)
    if layout == "file":
        dataset = tmp_path / "d.h5"
        done, _ = mpidist(1, "ingest", str(source), str(dataset), "--test-fraction", "0.1")
    else:
        folder = tmp_path / "d"
        folder.mkdir()
        for k, (lo, hi) in enumerate([(0, 500), (500, 530), (530, 1200)]):  # uneven files: blocks cross none
            write_split(folder / f"d-{k}.h5", x[lo:hi], y[lo:hi], x[:12], y[:12])
        dataset, done = folder, None
    assert done is None or done.returncode == 0, done.stderr
    common = [
        "train",
        "--data",
        str(dataset),
        "--data-mode",
        "stream",
        "--shuffle-buffer",
        "100",
        "--epochs",
        "3",
        "--batch-size",
        "60",
        "--metrics",
        "",
        "--progress",
        "none",
        "--dtype",
        "float64",
    ]
    whole, half = tmp_path / "whole", tmp_path / "half"
    done, _ = mpidist(ranks, *common, "--checkpoint-dir", str(whole))
    assert done.returncode == 0, done.stderr
    assert "stream (--data-mode stream), buffer 100" in done.stdout
    steps = int(done.stdout.split(" steps/epoch")[0].rsplit(" ", 1)[1])
    stop = steps + steps // 2 + 1  # mid-way through the second epoch
    done, _ = mpidist(ranks, *common, "--steps", str(stop), "--checkpoint-dir", str(half))
    assert done.returncode == 0, done.stderr
    done, _ = mpidist(ranks, *common, "--checkpoint-dir", str(half), "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert f"ckpt-{stop:08d}-" in done.stdout
    with h5py.File(checkpoint_at(whole, 3 * steps)) as a, h5py.File(checkpoint_at(half, 3 * steps)) as b:
        np.testing.assert_array_equal(a["params"][...], b["params"][...])


def write_split(path, x, y, test_x, test_y):
    with h5py.File(path, "w") as handle:
        handle.attrs.update(name="d", num_classes=2, source="test")
        for split, (xs, ys) in {"train": (x, y), "test": (test_x, test_y)}.items():
            handle.create_dataset(f"{split}/x", data=xs, chunks=(min(16, len(xs)), xs.shape[1]))
            handle.create_dataset(f"{split}/y", data=ys)


def test_the_start_up_table_says_how_each_rank_holds_its_data(tmp_path):
    done, _ = mpidist(
        2,
        "train",
        "--steps",
        "3",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--progress",
        "none",
        "--memory-budget",
        "300K",
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(lines) == 2 and all(
        re.search(r"stream \(4[5-7]\d\.\d KiB > budget 300\.0 KiB\), buffer", line) for line in lines
    ), done.stdout
    assert events(tmp_path / "m.jsonl", "done")


@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(chunks=(7, 3, 2)),
        dict(chunks=(5, 3, 2), dtype=">f8"),
        dict(chunks=(4, 3, 2), dtype="<i2"),
    ],
)
def test_rows_read_around_h5py_are_the_rows_h5py_reads(tmp_path, layout):
    from mpidist.data.direct import direct_rows

    values = np.arange(50 * 6).reshape(50, 3, 2)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset(
            "x",
            data=values.astype(layout.get("dtype", "<f4")),
            **{k: v for k, v in layout.items() if k == "chunks"},
        )
    with h5py.File(path, "r") as handle:
        fd = os.open(path, os.O_RDONLY)
        try:
            for lo, hi in [(0, 50), (3, 4), (6, 22), (49, 50), (10, 10)]:
                got = direct_rows(handle["x"], lo, hi, fd)
                if hi > lo:
                    np.testing.assert_array_equal(got, handle["x"][lo:hi])
                    assert got.dtype == handle["x"].dtype
        finally:
            os.close(fd)


def test_compressed_or_oddly_chunked_rows_are_left_to_h5py_and_truncation_is_named(tmp_path):
    from mpidist.data.direct import direct_rows

    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset("gz", data=np.ones((40, 4)), chunks=(8, 4), compression="gzip")
        handle.create_dataset("across", data=np.ones((40, 4)), chunks=(8, 2))
        handle.create_dataset("plain", data=np.ones((4000, 4)))
    fd = os.open(path, os.O_RDONLY)
    try:
        with h5py.File(path, "r") as handle:
            assert (
                direct_rows(handle["gz"], 0, 10, fd) is None
                and direct_rows(handle["across"], 0, 10, fd) is None
            )
            os.truncate(path, os.path.getsize(path) - 1000)
            with pytest.raises(UsageError, match="the file is truncated"):
                direct_rows(handle["plain"], 3900, 4000, fd, path)
    finally:
        os.close(fd)


def direct_or_stand_in(path, monkeypatch):
    """A DirectFile of ``path``: around the page cache where the file system allows it, else (tmpfs) through
    it.

    The stand-in (``O_DIRECT`` taken as 0) still reads whole aligned pages
    into the aligned buffer and cuts the rows out of them, which is what is
    under test; the flag itself is the kernel's business.
    """
    from mpidist.data.direct import DirectFile

    try:
        return DirectFile(path)
    except OSError:
        monkeypatch.setattr(os, "O_DIRECT", 0, raising=False)
        return DirectFile(path)


@pytest.mark.parametrize("layout", [dict(), dict(chunks=(7, 3, 2)), dict(chunks=(64, 3, 2), dtype="<f8")])
def test_rows_read_around_the_page_cache_are_the_rows_h5py_reads(tmp_path, monkeypatch, layout):
    from mpidist.data.direct import ALIGN, direct_rows

    values = np.arange(5000 * 6).reshape(5000, 3, 2)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset(
            "x", data=values.astype(layout.get("dtype", "<f4")), chunks=layout.get("chunks")
        )
    direct = direct_or_stand_in(path, monkeypatch)
    fd = os.open(path, os.O_RDONLY)
    try:
        with h5py.File(path, "r") as handle:
            item = handle["x"]
            # rows starting and ending mid-page, a page's worth, one row, all of them
            for lo, hi in [(0, 5000), (3, 4), (7, 900), (170, 170 + ALIGN // 24), (4999, 5000), (1234, 4321)]:
                got = direct_rows(item, lo, hi, fd, path, direct)
                np.testing.assert_array_equal(got, item[lo:hi])
                assert got.dtype == item.dtype and got.shape == (hi - lo, 3, 2)
            first = np.array(direct_rows(item, 0, 10, fd, path, direct))  # views of one buffer: copy to keep
            direct_rows(item, 100, 200, fd, path, direct)
            np.testing.assert_array_equal(first, item[0:10])
            assert direct.buffer.ctypes.data % ALIGN == 0
    finally:
        os.close(fd)
        direct.close()


def test_a_file_system_refusing_o_direct_is_read_through_the_cache(tmp_path, monkeypatch):
    """EINVAL on opening with O_DIRECT, or on reading with it: the stream reads the same batches, cached."""
    import errno

    from mpidist.data import direct as direct_module

    info = data.inspect(write(tmp_path / "d.h5", 700, chunk=8))
    lanes = Lanes.of(18, 2, 0)
    expected = [
        rows_of([b])
        for b in data.Stream(info, "train", 0, 2, (4,), np.float32, buffer=100, lanes=lanes).batches(30, 1, 0)
    ]
    real_open = os.open

    def refuse_at_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    def refuse_at_read(self, offset, length):
        raise OSError(errno.EINVAL, "Invalid argument")

    for where, refusal in [("os.open", refuse_at_open), ("read", refuse_at_read)]:
        with monkeypatch.context() as patch:
            if where == "os.open":
                patch.setattr(os, "O_DIRECT", getattr(os, "O_DIRECT", 0x4000), raising=False)
                patch.setattr(direct_module.os, "open", refusal)
            else:
                patch.setattr(direct_module.DirectFile, "read", refusal)
            stream = data.Stream(info, "train", 0, 2, (4,), np.float32, buffer=100, direct=True, lanes=lanes)
            assert [rows_of([b]) for b in stream.batches(30, 1, 0)] == expected, where


def test_direct_and_cached_streams_give_the_same_batches(tmp_path, monkeypatch):
    folder = directory(tmp_path, [333, 250, 117], chunk=16)
    info = data.inspect(folder)
    direct_or_stand_in(folder / "part-0.h5", monkeypatch).close()  # O_DIRECT, or the stand-in where refused
    from mpidist.data.direct import DirectFile

    reads, real_read = [], DirectFile.read
    monkeypatch.setattr(
        DirectFile, "read", lambda self, *where: reads.append(where) or real_read(self, *where)
    )
    for worker in (0, 1):
        reads.clear()
        streams = [
            data.Stream(
                info,
                "train",
                worker,
                2,
                (4,),
                np.float32,
                buffer=128,
                direct=direct,
                lanes=Lanes.of(20, 2, worker),
            )
            for direct in (False, True)
        ]
        cached, direct = (
            [(rows_of([b]), b[1].tolist()) for b in s.batches(30, 3, 1, skip=2)] for s in streams
        )
        assert direct == cached and len(direct) == 28 and reads
        evaluated = [rows_of([b]) for b in streams[1].eval_batches(100)]
        assert evaluated == [rows_of([b]) for b in streams[0].eval_batches(100)]
        # read a block at a time, cut as a shard in memory is: chunks of 100 across blocks and files, in order
        assert [len(chunk) for chunk in evaluated[:-1]] == [100] * (len(evaluated) - 1) and 0 < len(
            evaluated[-1]
        ) <= 100
        assert sum(evaluated, []) == list(range(streams[0].lo, streams[0].hi))


@pytest.mark.parametrize("size", [4096 * 3 + 100, 4 << 20, (2 << 20) + 1])
def test_direct_read_buffers_are_aligned_zeroed_and_writable(size):
    """Small buffers are numpy's, a huge page or more anonymous memory asked for in huge pages: both
    aligned."""
    from mpidist.data.direct import ALIGN, HUGE_PAGE, _aligned

    buffer = _aligned(size)
    assert buffer.dtype == np.uint8 and buffer.shape == (size,) and not buffer.any()
    assert (
        buffer.ctypes.data
        % (HUGE_PAGE if size >= HUGE_PAGE and hasattr(__import__("mmap"), "MADV_HUGEPAGE") else ALIGN)
        == 0
    )
    buffer[-1] = 7
    assert buffer[-1] == 7


def test_bench_streaming_compares_a_stream_with_the_data_in_memory(tmp_path):
    output = tmp_path / "bench.json"
    done, _ = mpidist(
        2,
        "bench",
        "--streaming",
        "digits",
        "--models",
        "mlp",
        "--steps",
        "5",
        "--settle",
        "0",
        "--output",
        str(output),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    memory, stream = json.loads(output.read_text())["streaming"]
    assert (memory["mode"], stream["mode"]) == ("memory", "stream") and memory["steps"] == stream[
        "steps"
    ] == 5
    assert len(memory["rounds"]) == len(stream["rounds"]) == 5
    assert stream["vs_memory"] == stream["samples_per_s"] / memory["samples_per_s"]
    assert stream["cold"] in ("dropped", "kept") and memory["cold"] == "-"
    for bad in (
        ["--settle", "-1", "--streaming", "digits"],
        ["--settle", "nan", "--streaming", "digits"],
        ["--settle", "5"],
    ):
        done, _ = mpidist(1, "bench", *bad)
        assert done.returncode == 2 and "0 to 600 seconds, with --streaming" in done.stderr
