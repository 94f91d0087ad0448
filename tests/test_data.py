"""Dataset layout checks, shards, batch plans, shuffling and prefetch."""

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.errors import UsageError
from mpidist.ingest import write_dataset


def make_file(path, n_train=40, n_test=10, shape=(3, 4), classes=5, **overrides):
    rng = np.random.default_rng(0)
    splits = {"train": (rng.random((n_train,) + shape).astype(np.float32), np.arange(n_train) % classes),
              "test": (rng.random((n_test,) + shape).astype(np.float32), np.arange(n_test) % classes)}
    splits.update(overrides)
    return write_dataset(path, "toy", splits, classes, "made by a test")


def test_a_well_formed_file_is_described(tmp_path):
    info = data.inspect(make_file(tmp_path / "toy.h5"))
    assert (info.name, info.num_classes, info.sample_shape, info.outputs) == ("toy", 5, (3, 4), 5)
    assert info.sizes == {"train": 40, "test": 10}


def test_bundled_datasets_resolve_by_name_and_follow_the_layout():
    assert {"digits", "mnist1d"} <= set(data.bundled_names())
    for name in ("digits", "mnist1d"):
        info = data.inspect(data.resolve(name))
        assert info.num_classes == 10 and info.source


@pytest.mark.parametrize("spec,message", [("no-such-dataset", "no bundled dataset of that name"),
                                          ("missing/file.h5", "no such file")])
def test_unknown_data_names_the_problem(spec, message):
    with pytest.raises(UsageError, match=message):
        data.resolve(spec)


def test_a_file_that_is_not_hdf5_is_refused(tmp_path):
    path = tmp_path / "fake.h5"
    path.write_text("not hdf5")
    with pytest.raises(UsageError, match="not a readable HDF5 file"):
        data.inspect(path)


def mutate(path, fn):
    with h5py.File(path, "a") as handle:
        fn(handle)
    return path


@pytest.mark.parametrize("change,message", [
    (lambda h: h.__delitem__("train/y"), "missing dataset 'train/y'"),
    (lambda h: h.attrs.__delitem__("num_classes"), "missing file attribute 'num_classes'"),
    (lambda h: h.attrs.__setitem__("num_classes", 1), "num_classes = 1"),
    (lambda h: (h.__delitem__("test/y"), h.create_dataset("test/y", data=np.zeros(3, int))), "10 samples but"),
    (lambda h: (h.__delitem__("test/x"), h.create_dataset("test/x", data=np.zeros((10, 12)))), "differ in shape"),
    (lambda h: (h.__delitem__("test/y"), h.create_dataset("test/y", data=np.zeros(10))), "integer class labels"),
    (lambda h: (h.__delitem__("test/x"), h.create_dataset("test/x", data=np.zeros(10))), "at least one feature"),
    (lambda h: (h.__delitem__("test/x"), h.create_dataset("test/x", data=np.array([b"a"] * 10))), "numeric"),
])
def test_layout_violations_are_named(tmp_path, change, message):
    path = mutate(make_file(tmp_path / "toy.h5"), change)
    with pytest.raises(UsageError, match=message):
        data.inspect(path)


def test_labels_out_of_range_are_found_with_their_sample(tmp_path):
    labels = np.arange(40) % 5
    labels[13] = 7
    path = make_file(tmp_path / "toy.h5", train=(np.zeros((40, 3, 4), np.float32), labels))
    info = data.inspect(path)
    data.Shard(info, "train", 0, 2, (3, 4), np.float32)                  # sample 13 is odd: not worker 0's
    with pytest.raises(UsageError, match=r"label 7 at sample 13, outside \[0, 5\)"):
        data.Shard(info, "train", 1, 2, (3, 4), np.float32)


def test_nan_in_samples_is_refused(tmp_path):
    x = np.zeros((40, 3, 4), np.float32)
    x[22, 1, 2] = np.nan
    info = data.inspect(make_file(tmp_path / "toy.h5", train=(x, np.arange(40) % 5)))
    with pytest.raises(UsageError, match="NaN or Inf .*sample 22"):
        data.Shard(info, "train", 0, 1, (3, 4), np.float32)


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_shards_are_disjoint_and_cover_the_split(tmp_path, workers):
    x = np.arange(40, dtype=np.float32).reshape(40, 1, 1).repeat(4, axis=2)
    info = data.inspect(make_file(tmp_path / "toy.h5", shape=(1, 4), train=(x, np.arange(40) % 5)))
    seen = np.concatenate([data.Shard(info, "train", w, workers, (1, 4), np.float32).x[:, 0, 0]
                           for w in range(workers)])
    assert sorted(seen.tolist()) == list(range(40))
    assert [data.shard_size(40, workers, w) for w in range(workers)] == \
        [len(data.Shard(info, "train", w, workers, (1, 4), np.float32)) for w in range(workers)]


@pytest.mark.parametrize("batch,workers", [(64, 4), (10, 3), (7, 7), (100, 6)])
def test_local_batches_add_up_to_the_global_batch(batch, workers):
    sizes = [data.local_batch_size(batch, workers, w) for w in range(workers)]
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


def test_steps_per_epoch_is_limited_by_the_tightest_worker():
    assert data.steps_per_epoch(1437, 64, 4) == 22
    assert data.steps_per_epoch(10, 4, 3) == 2      # shards 4,3,3; local batches 2,1,1
    assert data.steps_per_epoch(3, 4, 4) == 0       # worker 3 has no samples
    with pytest.raises(UsageError, match="--batch-size 3 is smaller than the number of workers \\(4\\)"):
        data.steps_per_epoch(100, 3, 4)


def test_epoch_order_is_reproducible_and_changes_every_epoch():
    a = data.epoch_order(100, seed=1, epoch=0, worker=0)
    np.testing.assert_array_equal(a, data.epoch_order(100, seed=1, epoch=0, worker=0))
    assert sorted(a) == list(range(100))
    assert not np.array_equal(a, data.epoch_order(100, seed=1, epoch=1, worker=0))
    assert not np.array_equal(a, data.epoch_order(100, seed=1, epoch=0, worker=1))


def test_train_batches_follow_the_epoch_order_and_skip_resumed_steps(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(40, 1, 1)
    info = data.inspect(make_file(tmp_path / "toy.h5", shape=(1, 1), train=(x, np.arange(40) % 5)))
    shard = data.Shard(info, "train", 0, 1, (1, 1), np.float32)
    order = data.epoch_order(40, 0, 3, 0)
    batches = data.train_batches(shard, 8, 5, seed=0, epoch=3, worker=0, skip=2)
    got = [bx[:, 0, 0].astype(int).tolist() for bx, _ in batches]
    assert got == [order[16:24].tolist(), order[24:32].tolist(), order[32:40].tolist()]


def test_prefetcher_reraises_errors_from_its_thread():
    def broken():
        yield 1
        raise OSError("disk went away")

    prefetcher = data.Prefetcher(broken())
    assert next(prefetcher) == 1
    with pytest.raises(OSError, match="disk went away"):
        next(prefetcher)
    prefetcher.close()


def test_prefetcher_can_be_closed_before_the_end():
    prefetcher = data.Prefetcher(iter(range(10 ** 9)))
    assert [next(prefetcher) for _ in range(3)] == [0, 1, 2]
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


class _Split:
    """A stand-in for a chief's training split: sample i is filled with i."""

    def __init__(self, n):
        self.x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)
        self.y = np.arange(n, dtype=np.int64)

    def __len__(self):
        return len(self.y)


@pytest.mark.mpi(min_size=2)
def test_in_graph_scatter_gives_each_worker_its_slice_of_the_chiefs_global_batch():
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    global_batch, steps, split = 2 * size + 1, 3, _Split(50)
    source = data.global_batches(split, global_batch, steps, seed=4, epoch=1) if rank == 0 else None
    feed = data.ScatteredBatches(world, source, global_batch, (3,), (), np.float32, np.int64, steps)
    order = data.epoch_order(50, 4, 1, 0)                       # what one process would draw
    sizes = [data.local_batch_size(global_batch, size, w) for w in range(size)]
    lo = sum(sizes[:rank])
    for step, (x, y) in enumerate(feed):
        expected = order[step * global_batch:(step + 1) * global_batch][lo:lo + sizes[rank]]
        np.testing.assert_array_equal(y, expected)
        np.testing.assert_array_equal(x[:, 2], expected.astype(np.float32))
    feed.close()
