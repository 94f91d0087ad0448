"""Dataset layout checks, shards, batch plans, shuffling and prefetch."""

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.data.lanes import Lanes
from mpidist.runtime.errors import UsageError
from mpidist.tools.ingest import write_dataset


def make_file(path, n_train=40, n_test=10, shape=(3, 4), classes=5, **overrides):
    rng = np.random.default_rng(0)
    splits = {
        "train": (rng.random((n_train,) + shape).astype(np.float32), np.arange(n_train) % classes),
        "test": (rng.random((n_test,) + shape).astype(np.float32), np.arange(n_test) % classes),
    }
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


@pytest.mark.parametrize(
    "spec,message",
    [
        ("no-such-dataset", "no bundled dataset of that name"),
        ("missing/file.h5", "no such file"),
        ("", "--data '': empty"),  # (not the working directory's .h5 files)
        (" ", "--data ' ': empty"),
    ],
)
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


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda h: h.__delitem__("train/y"), "missing dataset 'train/y'"),
        (lambda h: h.attrs.__delitem__("num_classes"), "missing file attribute 'num_classes'"),
        (lambda h: h.attrs.__setitem__("num_classes", 1), "num_classes = 1"),
        (
            lambda h: (h.__delitem__("test/y"), h.create_dataset("test/y", data=np.zeros(3, int))),
            "10 samples but",
        ),
        (
            lambda h: (h.__delitem__("test/x"), h.create_dataset("test/x", data=np.zeros((10, 12)))),
            "differ in shape",
        ),
        (
            lambda h: (h.__delitem__("test/y"), h.create_dataset("test/y", data=np.zeros(10))),
            "integer class labels",
        ),
        (
            lambda h: (h.__delitem__("test/x"), h.create_dataset("test/x", data=np.zeros(10))),
            "at least one feature",
        ),
        (
            lambda h: (h.__delitem__("test/x"), h.create_dataset("test/x", data=np.array([b"a"] * 10))),
            "numeric",
        ),
    ],
)
def test_layout_violations_are_named(tmp_path, change, message):
    path = mutate(make_file(tmp_path / "toy.h5"), change)
    with pytest.raises(UsageError, match=message):
        data.inspect(path)


def test_labels_out_of_range_are_found_with_their_sample(tmp_path):
    labels = np.arange(40) % 5
    labels[13] = 7
    path = make_file(tmp_path / "toy.h5", train=(np.zeros((40, 3, 4), np.float32), labels))
    info = data.inspect(path)
    data.Shard(info, "train", 0, 2, (3, 4), np.float32)  # sample 13 is odd: not worker 0's
    with pytest.raises(UsageError, match=r"label 7 at sample 13, outside \[0, 5\)"):
        data.Shard(info, "train", 1, 2, (3, 4), np.float32)


def test_nan_in_samples_is_refused(tmp_path):
    x = np.zeros((40, 3, 4), np.float32)
    x[22, 1, 2] = np.nan
    info = data.inspect(make_file(tmp_path / "toy.h5", train=(x, np.arange(40) % 5)))
    with pytest.raises(UsageError, match="NaN or Inf .*sample 22"):
        data.Shard(info, "train", 0, 1, (3, 4), np.float32)


def with_stats(path, mean=None, std=None, shape=(3, 4)):
    """``path`` with standardisation statistics ``stats/mean`` and ``stats/std`` (default: 0 and 1) added."""

    def add(handle):
        for key, value in (("mean", mean), ("std", std)):
            if not isinstance(value, str):  # a string: leave the item out
                handle.create_dataset(
                    f"stats/{key}",
                    data=np.full(shape, 0.0 if key == "mean" else 1.0) if value is None else value,
                )

    return mutate(path, add)


def test_standardisation_statistics_are_described_and_applied_when_read(tmp_path):
    x = np.arange(40 * 12, dtype=np.float32).reshape(40, 3, 4)
    mean, std = np.full((3, 4), 100.0), np.linspace(1, 12, 12).reshape(3, 4)
    info = data.inspect(with_stats(make_file(tmp_path / "toy.h5", train=(x, np.arange(40) % 5)), mean, std))
    np.testing.assert_array_equal(info.mean, mean)
    np.testing.assert_array_equal(info.std, std)
    assert info.mean.dtype == np.float64 and "mean" not in repr(info)
    shard = data.Shard(info, "train", 1, 2, (12,), np.float32)  # the rows of worker 1, the model's shape
    np.testing.assert_allclose(shard.x, ((x[1::2] - mean) / std).reshape(20, 12), rtol=1e-6)
    np.testing.assert_array_equal(
        data.standardizer(info)(x[:2].reshape(2, 12)), ((x[:2] - mean) / std).reshape(2, 12)
    )
    plain = data.inspect(make_file(tmp_path / "plain.h5"))
    assert plain.mean is None and plain.std is None and plain.class_names is None
    assert data.standardizer(plain) is None


@pytest.mark.parametrize(
    "mean,std,message",
    [
        (np.zeros(12), None, r"stats/mean has shape \(12,\); it must be the sample shape \(3, 4\)"),
        (None, np.ones((4, 3)), r"stats/std has shape \(4, 3\); it must be the sample shape \(3, 4\)"),
        (
            np.where(np.eye(3, 4) > 0, np.nan, 0.0),
            None,
            r"stats/mean\[0, 0\] is nan; standardisation statistics must "
            "be finite",
        ),
        (
            None,
            np.where(np.arange(12).reshape(3, 4) == 6, 0.0, 1.0),
            r"stats/std\[1, 2\] is 0.0; standard deviations "
            "must be finite and greater than 0",
        ),
        (None, np.full((3, 4), -1.0), r"stats/std\[0, 0\] is -1.0"),
        (None, np.full((3, 4), np.inf), r"stats/std\[0, 0\] is inf"),
        (
            np.zeros((3, 4), np.int64),
            None,
            "stats/mean has dtype int64; standardisation statistics must be floats",
        ),
        (None, np.array([b"1"] * 12).reshape(3, 4), r"stats/std has dtype \|S1"),
        (None, "left out", "has 'stats' but no dataset 'stats/std'"),
    ],
)
def test_bad_standardisation_statistics_are_refused(tmp_path, mean, std, message):
    path = with_stats(make_file(tmp_path / "toy.h5"), mean, std)
    with pytest.raises(UsageError, match=f"{tmp_path / 'toy.h5'}: {message}") as caught:
        data.inspect(path)
    assert "\n" not in str(caught.value)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # numpy's, as the values are checked
def test_statistics_that_do_not_fit_the_data_are_refused_when_read(tmp_path):
    x = np.ones((40, 3, 4), np.float32)
    x[7] = 3.0
    path = make_file(tmp_path / "toy.h5", train=(x, np.arange(40) % 5))
    info = data.inspect(with_stats(path, std=np.full((3, 4), 1e-310)))  # > 0, but x / std is Inf
    with pytest.raises(
        UsageError,
        match=r"train/x standardised with the file's stats/mean and stats/std holds Inf "
        r"\(first at sample 0\)",
    ):
        data.Shard(info, "train", 0, 1, (3, 4), np.float32)
    mutate(path, lambda h: h["stats/std"].__setitem__(..., 1e-39))  # finite, but beyond float32
    info = data.inspect(path)
    with pytest.raises(
        UsageError,
        match=r"train/x \(standardised\) holds values up to 3e\+39, beyond the range of "
        "--dtype float32",
    ):
        data.Shard(info, "train", 0, 1, (3, 4), np.float32)
    assert data.Shard(info, "train", 0, 1, (3, 4), np.float64).x.max() == pytest.approx(3e39)


def with_names(path, names, dtype=None):
    return mutate(
        path, lambda h: h.create_dataset("class_names", data=names, dtype=dtype or h5py.string_dtype())
    )


def test_class_names_are_described_with_control_characters_escaped(tmp_path):
    names = ["cat", "dog", "emu", "gnu", "red\x1b[2Jpanda"]
    info = data.inspect(with_names(make_file(tmp_path / "toy.h5"), names))
    assert info.class_names == ("cat", "dog", "emu", "gnu", "red\\x1b[2Jpanda")
    info = data.inspect(with_names(make_file(tmp_path / "ascii.h5"), [b"a", b"b", b"c", b"d", b"e"], "S1"))
    assert info.class_names == ("a", "b", "c", "d", "e")


@pytest.mark.parametrize(
    "names,message",
    [
        (["a", "b", "c", "d"], r"class_names has shape \(4,\); it needs one name per class, shape \(5,\)"),
        (np.arange(5), "class_names has dtype int64; it must hold text"),
        (["a", "b", " ", "d", "e"], r"class_names\[2\] is empty"),
        (["a", "b", "c", "b", "e"], r"class_names\[3\] repeats class_names\[1\] \('b'\)"),
        (
            ["a", "b", "c", "d", "e" * 201],
            r"class_names\[4\] is 201 characters long; a class name has at most 200",
        ),
        ([b"a", b"b", b"\xff", b"d", b"e"], "class_names holds bytes that are not UTF-8 text"),
    ],
)
def test_bad_class_names_are_refused(tmp_path, names, message):
    dtype = h5py.string_dtype() if isinstance(names, list) and isinstance(names[0], str) else None
    if isinstance(names, list) and isinstance(names[0], bytes):
        dtype = h5py.string_dtype("utf-8", 1)
    path = make_file(tmp_path / "toy.h5")
    mutate(path, lambda h: h.create_dataset("class_names", data=names, dtype=dtype))
    with pytest.raises(UsageError, match=f"{tmp_path / 'toy.h5'}: {message}"):
        data.inspect(path)


@pytest.mark.parametrize(
    "names,message",
    [
        (["a", "b"], None),
        (["a", "b", "c"], r"feature_names has shape \(3,\); it needs one name per feature, shape \(2,\)"),
        (["a", "a"], r"feature_names\[1\] repeats feature_names\[0\] \('a'\)"),
        (["a", ""], r"feature_names\[1\] is empty; every feature needs a name"),
        (np.arange(2), "feature_names has dtype int64; it must hold text"),
    ],
)
def test_feature_names_are_read_checked_as_untrusted_text(tmp_path, names, message):
    path = write_dataset(
        tmp_path / "f.h5",
        "f",
        {"train": (np.zeros((4, 2)), np.zeros(4)), "test": (np.zeros((2, 2)), np.zeros(2))},
        0,
        "",
    )
    mutate(
        path,
        lambda h: h.create_dataset(
            "feature_names", data=names, dtype=None if message and "dtype" in message else h5py.string_dtype()
        ),
    )
    if message is None:
        assert data.inspect(path).feature_names == ("a", "b")
        return
    with pytest.raises(UsageError, match=f"{path}: {message}"):
        data.inspect(path)


#: names a CSV header may give beyond plain ASCII: characters that print as escapes (a no-break, a zero-width
#: and a narrow space, a BOM, right-to-left and left-to-right marks, a tab, a line separator), and a combining
#: accent and right-to-left text, which print as they are
INVISIBLE_NAMES = (
    "no\u00a0break",
    "zero\u200bwidth",
    "narrow\u202fspace",
    "bom\ufeff",
    "\u200fright",
    "left\u200e",
    "tab\tbed",
    "line\u2028sep",
    "cafe\u0301",
    "\u05e9\u05dd",
)


def test_feature_names_come_back_as_stored_whatever_characters_they_hold(tmp_path):
    """Issue 61, item 11: predict compares them with a CSV header's cells; read back escaped for printing
    (``'no\\xa0break'``), they matched no cell of the very header they came from."""
    names = INVISIBLE_NAMES + ("no\\xa0break",)  # (and the escape of the first, spelt out: a name of its own)
    path = write_dataset(
        tmp_path / "f.h5",
        "f",
        {"train": (np.zeros((4, len(names))), np.zeros(4)), "test": (np.zeros((2, len(names))), np.zeros(2))},
        0,
        "",
        feature_names=names,
    )
    assert data.inspect(path).feature_names == names


def test_class_names_need_classes(tmp_path):
    path = write_dataset(
        tmp_path / "r.h5",
        "r",
        {"train": (np.zeros((4, 2)), np.zeros(4)), "test": (np.zeros((2, 2)), np.zeros(2))},
        0,
        "",
    )
    with pytest.raises(UsageError, match="has class_names but num_classes = 0"):
        data.inspect(with_names(path, ["a", "b"]))


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_shards_are_disjoint_and_cover_the_split(tmp_path, workers):
    x = np.arange(40, dtype=np.float32).reshape(40, 1, 1).repeat(4, axis=2)
    info = data.inspect(make_file(tmp_path / "toy.h5", shape=(1, 4), train=(x, np.arange(40) % 5)))
    seen = np.concatenate(
        [data.Shard(info, "train", w, workers, (1, 4), np.float32).x[:, 0, 0] for w in range(workers)]
    )
    assert sorted(seen.tolist()) == list(range(40))
    assert [data.shard_size(40, workers, w) for w in range(workers)] == [
        len(data.Shard(info, "train", w, workers, (1, 4), np.float32)) for w in range(workers)
    ]


@pytest.mark.parametrize("batch,workers", [(64, 4), (10, 3), (7, 7), (100, 6)])
def test_local_batches_add_up_to_the_global_batch(batch, workers):
    sizes = [data.local_batch_size(batch, workers, w) for w in range(workers)]
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


def test_steps_per_epoch_are_n_over_the_global_batch_on_any_worker_count():
    assert data.steps_per_epoch(1437, 64, 4) == data.steps_per_epoch(1438, 64, 3) == 22
    assert data.steps_per_epoch(10, 4, 3) == 2  # 4 lanes of 3, 3, 2, 2 rows
    assert data.steps_per_epoch(3, 4, 4) == 0  # lane 3 has no samples
    with pytest.raises(UsageError, match="--batch-size 3 is smaller than the number of workers \\(4\\)"):
        data.steps_per_epoch(100, 3, 4)


def test_train_batches_are_a_sample_of_each_lane_a_step_and_skip_resumed_steps(tmp_path):
    from mpidist.data.order import order_for

    x = np.arange(40, dtype=np.float32).reshape(40, 1, 1)
    info = data.inspect(make_file(tmp_path / "toy.h5", shape=(1, 1), train=(x, np.arange(40) % 5)))
    lanes = data.Lanes.of(16, 2, 1)  # lanes 8..15 of 16: the last 8 of 40 rows in 16 lanes
    shard = data.Shard(info, "train", 0, 1, (1, 1), np.float32, lanes=lanes, buffer=6)
    assert shard.x[:, 0, 0].astype(int).tolist() == list(range(24, 40))  # lanes 8..15: rows 24..39, 2 each
    batches = data.train_batches(shard, 2, seed=0, epoch=3)
    got = [bx[:, 0, 0].astype(int).tolist() for bx, _ in batches]
    assert [sorted(pair) for pair in zip(*got)] == [[24 + 2 * lane, 25 + 2 * lane] for lane in range(8)]
    order = order_for(info, "train", 6, (1, 1), 16)
    expected = order.rows(lanes.ids[None, :], np.arange(2)[:, None], 0, 3).tolist()
    assert got == expected and got != [list(range(24, 40, 2)), list(range(25, 40, 2))]
    assert [bx[:, 0, 0].astype(int).tolist() for bx, _ in data.train_batches(shard, 2, 0, 3, skip=1)] == got[
        1:
    ]


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
    prefetcher = data.Prefetcher(iter(range(10**9)))
    assert [next(prefetcher) for _ in range(3)] == [0, 1, 2]
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


class _Split:
    """A stand-in for a chief's training split, every lane of ``global_batch``: sample i is filled with i."""

    def __init__(self, n, global_batch):
        from mpidist.data.order import LaneOrder

        self.x = np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1)
        self.y = np.arange(n, dtype=np.int64)
        self.count, self.lanes = n, data.Lanes(global_batch, 0, global_batch)  # (its rows: 0..n-1 in order)
        self.order, self.first = LaneOrder(n, global_batch, 2, 3), 0

    def __len__(self):
        return len(self.y)

    batches = data.Shard.batches  # a shard in memory's batches


@pytest.mark.mpi(min_size=2)
def test_in_graph_scatter_gives_each_worker_the_batches_its_own_lanes_would():
    from mpi4py import MPI

    from mpidist.parallel.data.scatter import ScatteredBatches

    world = MPI.COMM_WORLD
    size, rank = world.Get_size(), world.Get_rank()
    global_batch, steps, split = 2 * size + 1, 3, _Split(50, 2 * size + 1)
    source = data.global_batches(split, steps, seed=4, epoch=1) if rank == 0 else None
    feed = ScatteredBatches(world, source, global_batch, (3,), (), np.float32, np.int64, steps)
    mine = data.Lanes.of(global_batch, size, rank)  # the lanes this worker would read between-graph
    own = split.order.rows(mine.ids[None, :], np.arange(steps)[:, None], 4, 1)
    for step, (x, y) in enumerate(feed):
        np.testing.assert_array_equal(y, own[step])
        np.testing.assert_array_equal(x[:, 2], own[step].astype(np.float32))
    feed.close()


# --- labels per position (sequences) ------------------------------------------------------------------------


def token_file(path, n_train=40, n_test=10, length=6, classes=5):
    """Sequences ``(N, L)`` of ids whose label at each position is the next id: ``(id + 1) % classes``."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, n in (("train", n_train), ("test", n_test)):
        ids = rng.integers(0, classes, (n, length))
        splits[split] = (ids.astype(np.float32), (ids + 1) % classes)
    return write_dataset(path, "tokens", splits, classes, "made by a test", check_values=True)


def test_labels_with_a_sequence_axis_are_read_per_position_in_memory_and_streamed(tmp_path):
    info = data.inspect(token_file(tmp_path / "tokens.h5"))
    assert (info.target_width, info.target_shape, info.outputs) == (6, (6,), 5)
    shard = data.Shard(info, "train", 0, 2, (6,), np.float32)
    assert shard.y.shape == (20, 6) and shard.y.dtype == np.int64
    np.testing.assert_array_equal(shard.y, (shard.x.astype(np.int64) + 1) % 5)
    streamed = data.Stream(info, "train", 0, 1, (6,), np.float32, buffer=8)
    x, y = next(iter(streamed.eval_batches(8)))
    assert y.shape == (8, 6) and np.array_equal(y, (np.asarray(x).astype(np.int64) + 1) % 5)
    trained = data.Stream(info, "train", 0, 1, (6,), np.float32, buffer=20, lanes=Lanes(10, 0, 10))
    batches = trained.batches(4, 0, 0)
    for x, y in batches:
        assert y.shape == (10, 6) and np.array_equal(y, (np.asarray(x).astype(np.int64) + 1) % 5)
    batches.close()


def test_a_label_out_of_range_is_named_with_its_sample_and_position(tmp_path):
    path = token_file(tmp_path / "tokens.h5")
    with h5py.File(path, "a") as handle:
        labels = handle["train/y"][...]
        labels[13, 4] = 9
        handle["train/y"][...] = labels
    info = data.inspect(path)
    with pytest.raises(UsageError, match=r"label 9 at sample 13 position 4, outside \[0, 5\)"):
        data.Shard(info, "train", 0, 1, (6,), np.float32)
    splits = {
        "train": (np.zeros((2, 3), np.float32), np.array([[0, 1, 7], [0, 0, 0]])),
        "test": (np.zeros((1, 3), np.float32), np.zeros((1, 3), int)),
    }
    with pytest.raises(UsageError, match=r"train/y\[0, 2\] is 7, outside \[0, 5\)"):
        write_dataset(tmp_path / "bad.h5", "bad", splits, 5, "test", check_values=True)


@pytest.mark.parametrize(
    "labels,message",
    [
        (
            np.zeros((10, 2, 3), int),
            "integer class labels .*\\(N, L\\) for one per position, got shape \\(10, 2, 3\\)",
        ),
        (np.zeros((10, 0), int), "integer class labels"),
    ],
)
def test_labels_of_three_axes_or_no_positions_are_refused(tmp_path, labels, message):
    path = mutate(
        make_file(tmp_path / "toy.h5"),
        lambda h: (h.__delitem__("test/y"), h.create_dataset("test/y", data=labels)),
    )
    with pytest.raises(UsageError, match=message):
        data.inspect(path)


def test_values_beyond_the_dtype_are_refused_in_words_without_numpys_warning():
    """The refusal was preceded by numpy's 'overflow encountered in cast' and a line of mpidist's source."""
    import warnings

    from mpidist.data.samples import converted

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a warning would raise here, before the refusal)
        with pytest.raises(UsageError, match="holds values up to 1e\\+300, beyond the range of --dtype"):
            converted(np.full((2, 3), 1e300), np.float32, "train/x")
