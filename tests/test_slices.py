"""A rank resuming a split model reads its slices of a checkpoint into place, and no more (format 1 and 2, any
layout)."""

import json

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn.placement import Placement
from mpidist.nn.tensor import split_model
from mpidist.runtime.errors import UsageError
from mpidist.store import checkpoint
from test_sharded import write

METADATA = 1 << 20  # bytes an open reads beside the values asked for (superblocks, object headers, mappings)


def bytes_read():
    """What this process has read from files so far (``rchar``: every read call, cached or not)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar"))


@pytest.fixture(scope="module")
def model():
    # three Dense: the first two split by columns then rows in a tensor part, the third held whole by every
    # part
    model = nn.Sequential(
        [nn.Dense(512), nn.ReLU(), nn.Dense(512), nn.ReLU(), nn.Dense(512), nn.LayerNorm(), nn.Dense(8)],
        (64,),
        dtype=np.float64,
    )
    model.init_params(3)
    return model


def layouts(model):
    stages = [Placement.of_entries(model, 0, 4), Placement.of_entries(model, 4, len(model.entries))]
    return {"pipeline 2": stages, "tensor 3": [split_model(model, part, 3)[1] for part in range(3)]}


def restored(header, placement, dtype=np.float64):
    """``(params, m)`` of ``placement`` restored from ``header`` into fresh buffers."""
    buffers = {"params": np.full(placement.size, np.nan, dtype), "m": np.full(placement.size, np.nan, dtype)}
    header.restore(placement, buffers)
    return buffers["params"], buffers["m"]


def attributes():
    return {**checkpoint.attributes(7, 1, 2, json.dumps({"model": "test"}), 5, 2), "optimizer": {"steps": 7}}


@pytest.mark.skipif(
    not __import__("os").path.exists("/proc/self/io"), reason="counts bytes read by /proc/self/io"
)
@pytest.mark.parametrize("written, resumed", [("pipeline 2", "tensor 3"), ("tensor 3", "pipeline 2")])
def test_each_rank_reads_its_slices_of_a_sharded_checkpoint_and_no_more(tmp_path, model, written, resumed):
    moments = np.random.default_rng(0).random(model.num_params)
    index = write(tmp_path, model, layouts(model)[written], moments, attributes())
    whole_bytes = 2 * model.num_params * 8
    for placement in layouts(model)[resumed]:
        header = checkpoint.load(index, arrays=False)
        assert header.params is None and header.num_params == model.num_params
        params, m = np.empty(placement.size), np.empty(placement.size)
        before = bytes_read()
        header.restore(placement, {"params": params, "m": m})  # (into the buffers: no copy of a slice)
        read = bytes_read() - before
        np.testing.assert_array_equal(params, placement.take(model.params))
        np.testing.assert_array_equal(m, placement.take(moments))
        slices = 2 * placement.size * 8
        assert slices <= read <= slices + METADATA < whole_bytes, (read, slices, whole_bytes)


def test_the_ranks_check_the_parts_checksums_a_share_each(tmp_path, model):
    index = write(tmp_path, model, layouts(model)["tensor 3"], np.zeros(model.num_params), attributes())
    parts = sorted((tmp_path / "ckpt.parts").iterdir())
    header = checkpoint.load(index, arrays=False)
    before = bytes_read()
    header.check_parts((0, 0))
    alone = bytes_read() - before
    before = bytes_read()
    header.check_parts((1, 2))  # (the second part of three)
    hashed = bytes_read() - before - alone
    assert parts[1].stat().st_size <= hashed <= parts[1].stat().st_size + (64 << 10)
    with parts[1].open("r+b") as part:  # (the same size, another finite value: only its checksum tells)
        part.seek(-8, 2)
        part.write(np.float64(1.5).tobytes())
    header = checkpoint.load(index, arrays=False)  # (sizes only: the part is not read)
    # (in a run, the rank that checks it fails the start on every rank)
    for share in (
        (0, 2),
        (0, 3),
        (2, 3),
    ):
        header.check_parts(share)
    with pytest.raises(UsageError, match="ckpt.parts/rank-00001.h5 is not the file that was written"):
        header.check_parts((1, 3))
    with pytest.raises(UsageError, match="ckpt.parts/rank-00001.h5 is not the file that was written"):
        header.whole()  # (reading the whole checks every part)


def test_a_format_1_checkpoint_is_read_by_slices_too(tmp_path, model):
    moments = np.random.default_rng(2).random(model.num_params)
    path = checkpoint.save(
        tmp_path, model.params, {"m": moments}, 7, 7, 1, 2, json.dumps({"model": "test"}), 5, 2
    )
    for placement in layouts(model)["tensor 3"]:
        header = checkpoint.load(path, arrays=False)
        before = bytes_read()
        params, m = restored(header, placement, np.float32)  # (converted as read: a float32 run's buffers)
        assert bytes_read() - before <= 2 * placement.size * 8 + METADATA
        np.testing.assert_array_equal(params, placement.take(model.params).astype(np.float32))
        np.testing.assert_array_equal(m, placement.take(moments).astype(np.float32))
        # a checkpoint read whole (by another layout, or the survivors' state) gives the same slices
        again = restored(header.whole(), placement)
        np.testing.assert_array_equal(again[0], placement.take(model.params))
        np.testing.assert_array_equal(again[1], placement.take(moments))


def test_slices_holding_nan_or_a_replaced_checkpoint_are_refused_by_name(tmp_path, model):
    params = model.params.copy()
    params[-1] = np.nan  # (in the last Dense's bias, which the first stage does not hold)
    path = checkpoint.save(tmp_path, params, {}, 7, 7, 1, 2, json.dumps({"model": "test"}), 5, 2)
    first, last = layouts(model)["pipeline 2"]
    header = checkpoint.load(path, arrays=False)
    restored(header, first)
    with pytest.raises(UsageError, match=r"params holds NaN or Inf \(1 of this rank's \d+ values\)"):
        restored(header, last)
    (tmp_path / "other").mkdir()
    checkpoint.save(
        tmp_path / "other", model.params, {}, 9, 9, 1, 4, json.dumps({"model": "test"}), 5, 2
    ).replace(path)
    with pytest.raises(UsageError, match="the checkpoint changed while the run started"):
        restored(header, first)
