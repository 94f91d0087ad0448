"""``ingest --shard-size`` and ``--compression``, and the synthetic source: datasets written a block at a
time."""

import h5py
import numpy as np
import pytest

from mpidist import data
from mpidist.data import writer as dataset_writer
from mpidist.runtime.errors import UsageError
from mpidist.tools.ingest import ingest

from conftest import events, mpidist


def arrays(path):
    """Every split's (x, y) of a dataset (file or directory), read whole, in order."""
    info = data.inspect(path)
    out = {}
    for split in info.sizes:
        xs, ys = [], []
        for member in info.files:
            with h5py.File(member.path) as handle:
                xs.append(handle[f"{split}/x"][...])
                ys.append(handle[f"{split}/y"][...])
        out[split] = np.concatenate(xs), np.concatenate(ys)
    return out


@pytest.fixture
def npz(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(503, 3, 2))
    np.savez(tmp_path / "src.npz", x=x, y=(x[:, 0, 0] > 0).astype(np.int64) + 2 * (x[:, 1, 1] > 0))
    return tmp_path / "src.npz"


@pytest.mark.parametrize("source", ["npz", "digits"])
def test_shards_concatenated_are_the_single_file(tmp_path, npz, source):
    source = str(npz) if source == "npz" else source
    single = ingest(source, tmp_path / "one.h5", standardize=True)
    ingest(source, tmp_path / "many", shard_size=100, standardize=True)
    files = sorted((tmp_path / "many").iterdir())
    train = single.sizes["train"]
    assert len(files) == -(-train // 100) and [f.name for f in files] == [
        f"{single.name}-{k:05d}.h5" for k in range(len(files))
    ]
    whole, parts = arrays(tmp_path / "one.h5"), arrays(tmp_path / "many")
    for split in whole:
        np.testing.assert_array_equal(whole[split][0], parts[split][0])
        np.testing.assert_array_equal(whole[split][1], parts[split][1])
    with h5py.File(tmp_path / "one.h5") as one:
        for path in files:
            with h5py.File(path) as part:
                assert dict(part.attrs) == dict(one.attrs)
                np.testing.assert_array_equal(part["stats/mean"][...], one["stats/mean"][...])
                assert len(part["train/x"]) <= 100 and part["train/x"].chunks[1:] == part["train/x"].shape[1:]
    assert not list(tmp_path.glob(".many.tmp-*"))


@pytest.mark.parametrize("compression", ["gzip", "lzf", "none"])
def test_every_compression_reads_back_the_same_rows(tmp_path, npz, compression):
    ingest(str(npz), tmp_path / "d.h5", compression=compression)
    ingest(str(npz), tmp_path / "ref.h5", compression="none")
    got, expected = arrays(tmp_path / "d.h5"), arrays(tmp_path / "ref.h5")
    for split in expected:
        np.testing.assert_array_equal(got[split][0], expected[split][0])
    with h5py.File(tmp_path / "d.h5") as handle:
        assert handle["train/x"].compression == (None if compression == "none" else compression)
    streamed = data.Stream(data.inspect(tmp_path / "d.h5"), "train", 0, 1, (3, 2), np.float64, buffer=30)
    np.testing.assert_array_equal(
        np.concatenate([x for x, _ in streamed.eval_batches()]), expected["train"][0]
    )


def test_bad_shard_sizes_and_occupied_outputs_are_refused_and_nothing_is_left(tmp_path, npz, monkeypatch):
    for size in (0, -3, 2.5, True):
        with pytest.raises(UsageError, match="--shard-size"):
            ingest(str(npz), tmp_path / "out", shard_size=size)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UsageError, match="exists and is not empty"):
        ingest(str(npz), tmp_path / "full", shard_size=100)
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"

    def fail(path, rows, parts, compression):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dataset_writer, "write_file", fail)
    with pytest.raises(UsageError, match="No space left on device"):
        ingest(str(npz), tmp_path / "out", shard_size=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "src.npz"]


def test_synthetic_data_is_the_same_however_it_is_written(tmp_path, monkeypatch):
    ingest("synthetic:9000,5,3", tmp_path / "one.h5", seed=4, compression="none")
    monkeypatch.setattr(dataset_writer, "WRITE_BYTES", 777)  # other write blocks, the same rows
    ingest("synthetic:9000,5,3", tmp_path / "many", seed=4, shard_size=2500)
    one, many = arrays(tmp_path / "one.h5"), arrays(tmp_path / "many")
    assert one["train"][0].shape == (7200, 5) and one["test"][0].shape == (1800, 5)
    assert one["train"][0].dtype == np.float32 and set(np.unique(one["train"][1])) == {0, 1, 2}
    for split in one:
        np.testing.assert_array_equal(one[split][0], many[split][0])
        np.testing.assert_array_equal(one[split][1], many[split][1])
    other = ingest("synthetic:9000,5,3", tmp_path / "other.h5", seed=5)
    assert not np.array_equal(arrays(other)["train"][0], one["train"][0])
    for spec in ("synthetic:10", "synthetic:1,5,3", "synthetic:100,5,1"):
        with pytest.raises(UsageError, match="synthetic"):
            ingest(spec, tmp_path / "bad.h5")


@pytest.fixture(scope="module")
def digits_one_and_many(tmp_path_factory):
    """digits ingested as one file and as shards of 200 rows, once for the module (the runs only read
    them)."""
    folder = tmp_path_factory.mktemp("digits")
    done, _ = mpidist(1, "ingest", "digits", str(folder / "one.h5"))
    assert done.returncode == 0, done.stderr
    done, _ = mpidist(1, "ingest", "digits", str(folder / "many"), "--shard-size", "200")
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    return folder


@pytest.mark.parametrize("mode,tolerance", [("memory", 0.0), ("stream", 0.0)])
def test_a_directory_of_shards_trains_to_the_accuracy_of_the_single_file(
    tmp_path, digits_one_and_many, mode, tolerance
):
    """In memory or streamed, the shards give the order the single file gives (the order never depends on how
    the rows are cut into files or chunks), so the same run."""
    accuracy = {}
    for name in ("one.h5", "many"):
        metrics = tmp_path / f"{name}.jsonl"
        done, _ = mpidist(
            2,
            "train",
            "--data",
            str(digits_one_and_many / name),
            "--data-mode",
            mode,
            "--shuffle-buffer",
            "300",
            "--epochs",
            "8",
            "--metrics",
            str(metrics),
            "--progress",
            "none",
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        accuracy[name] = events(metrics, "done")[0]["test_accuracy"]
    assert accuracy["one.h5"] > 0.9
    assert abs(accuracy["one.h5"] - accuracy["many"]) <= tolerance, accuracy


def test_a_stream_read_around_the_page_cache_trains_exactly_as_one_read_through_it(tmp_path):
    """--stream-io only changes how the bytes arrive: the same samples in the same order, so the same run."""
    done, _ = mpidist(
        1, "ingest", "digits", str(tmp_path / "many"), "--shard-size", "300", "--compression", "none"
    )
    assert done.returncode == 0, done.stderr
    finals = {}
    for io in ("direct", "cached"):
        metrics = tmp_path / f"{io}.jsonl"
        done, _ = mpidist(
            2,
            "train",
            "--data",
            str(tmp_path / "many"),
            "--data-mode",
            "stream",
            "--stream-io",
            io,
            "--shuffle-buffer",
            "200",
            "--epochs",
            "2",
            "--metrics",
            str(metrics),
            "--progress",
            "none",
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        finals[io] = events(metrics, "done")[0]
    assert finals["direct"]["test_accuracy"] > 0.5
    assert finals["direct"]["test_accuracy"] == finals["cached"]["test_accuracy"]
    assert finals["direct"]["test_loss"] == finals["cached"]["test_loss"]
