"""Sharded checkpoints (format 2): part files of each rank's slices, and an index of virtual datasets over
them."""

import json
import shutil

import h5py
import numpy as np
import pytest

from mpidist import nn
from mpidist.nn.placement import Placement, parameter
from mpidist.nn.tensor import split_model
from mpidist.store import sharded


def whole():
    # Dense pairs split by columns then rows, a LayerNorm every part holds whole, a conv kernel (4 axes)
    model = nn.Sequential(
        [
            nn.Conv2D(4, 3),
            nn.ReLU(),
            nn.Flatten(),
            nn.Dense(6),
            nn.ReLU(),
            nn.Dense(5),
            nn.LayerNorm(),
            nn.Dense(3),
        ],
        (5, 5, 2),
        dtype=np.float64,
    )
    model.init_params(2)
    return model


def parameters(model):
    return [
        (sharded.parameter_name(entry, type(layer).__name__, name), shape, offset)
        for entry, (layer, name, offset, shape, _) in enumerate(model.entries)
    ]


def layouts(model):
    """Each layout's placements: two pipeline stages, three tensor parts, and a replica that writes
    nothing."""
    cut = 4
    stages = [Placement.of_entries(model, 0, cut), Placement.of_entries(model, cut, len(model.entries))]
    parts = [split_model(model, part, 3)[1] for part in range(3)]
    replica = Placement.of_entries(model, 0, cut, writes=False)
    return {"pipeline": stages, "tensor": parts, "pipeline with a replica": stages + [replica]}


def write(folder, model, placements, moments, attrs=None):
    """Each rank's part of ``model.params`` and of ``moments`` (an optimizer array), then the index (with
    ``attrs``, a checkpoint's attributes, or a few)."""
    (folder / "ckpt.parts").mkdir(parents=True)
    parts = []
    for rank, placement in enumerate(placements):
        arrays = {
            "params": placement.written(placement.take(model.params)),
            "optimizer/m": placement.written(placement.take(moments)),
        }
        file = f"ckpt.parts/{sharded.part_name(rank)}"
        record = sharded.write_part(folder / file, placement.describe(), arrays)
        parts.append((file, placement.describe(), record))
    sharded.write_index(
        folder / "ckpt.h5",
        parameters(model),
        parts,
        ["params", "optimizer/m"],
        model.dtype,
        attrs or {"step": 7, "config": {"model": "test"}, "optimizer": {"steps": 7}},
    )
    return folder / "ckpt.h5"


@pytest.mark.parametrize("layout", ["pipeline", "tensor", "pipeline with a replica"])
def test_h5py_reads_every_parameter_whole_by_name_and_shape_and_the_flat_arrays(tmp_path, layout):
    model = whole()
    moments = np.random.default_rng(0).random(model.num_params)
    index = write(tmp_path, model, layouts(model)[layout], moments)
    with h5py.File(index, "r") as handle:
        assert sharded.verify(index, handle) is None
        assert handle.attrs["step"] == 7 and json.loads(handle.attrs["config"]) == {"model": "test"}
        assert handle["optimizer"].attrs["steps"] == 7
        np.testing.assert_array_equal(handle["params"][...], model.params)
        np.testing.assert_array_equal(handle["optimizer/m"][...], moments)
        names = list(handle["parameters"])
        assert names == [name for name, _, _ in parameters(model)]
        for entry, (_, _, _, shape, _) in enumerate(model.entries):
            stored = handle["parameters"][names[entry]]
            assert stored.shape == tuple(shape)
            np.testing.assert_array_equal(stored[...], parameter(model, model.params, entry))


def test_a_moved_checkpoint_directory_still_reads(tmp_path):
    model = whole()
    write(tmp_path / "here", model, layouts(model)["tensor"], np.zeros(model.num_params))
    shutil.move(tmp_path / "here", tmp_path / "there")
    index = tmp_path / "there" / "ckpt.h5"
    with h5py.File(index, "r") as handle:
        assert sharded.verify(index, handle) is None
        np.testing.assert_array_equal(handle["params"][...], model.params)


def test_a_missing_or_changed_part_is_found_before_anything_is_read(tmp_path):
    model = whole()
    index = write(tmp_path, model, layouts(model)["tensor"], np.zeros(model.num_params))
    part = tmp_path / "ckpt.parts" / sharded.part_name(1)
    with h5py.File(part, "r+") as handle:  # a value changed in place: the same size, another checksum
        handle["params"][0] += 1
    with h5py.File(index, "r") as handle:
        assert "ckpt.parts/rank-00001.h5 is not the file that was written" in sharded.verify(index, handle)
    part.unlink()
    with h5py.File(index, "r") as handle:
        assert sharded.verify(index, handle) == "part ckpt.parts/rank-00001.h5 is missing"
        # what HDF5 alone would give: the missing part's values as the fill value, silently
        assert np.isnan(handle["params"][...]).any()


def test_an_index_naming_files_outside_its_folder_or_sources_it_does_not_list_is_refused(tmp_path):
    model = whole()
    index = write(tmp_path, model, layouts(model)["pipeline"], np.zeros(model.num_params))
    with h5py.File(index, "r+") as handle:
        listed = json.loads(handle.attrs[sharded.PARTS])
        handle.attrs[sharded.PARTS] = json.dumps(listed[:1])
    with h5py.File(index, "r") as handle:
        assert "which is not one of its parts" in sharded.verify(index, handle)
    for file in ("../elsewhere.h5", "/etc/passwd", ""):
        with h5py.File(index, "r+") as handle:
            handle.attrs[sharded.PARTS] = json.dumps([{"file": file, "bytes": 1, "sha256": "0"}])
        with h5py.File(index, "r") as handle:
            assert "is not a file inside the checkpoint's folder" in sharded.verify(index, handle)
    with h5py.File(index, "r+") as handle:
        handle.attrs[sharded.PARTS] = "not json"
    with h5py.File(index, "r") as handle:
        assert "is not a JSON list" in sharded.verify(index, handle)


def test_removing_a_checkpoints_parts_takes_its_folder(tmp_path):
    model = whole()
    write(tmp_path, model, layouts(model)["pipeline"], np.zeros(model.num_params))
    sharded.remove_parts(tmp_path / "ckpt.parts")
    assert not (tmp_path / "ckpt.parts").exists()


def test_rectangles_cut_on_several_axes_map_into_the_whole_in_c_order(tmp_path):
    from mpidist.nn.placement import Region

    model = whole()
    # the conv kernel: cut on the first axis and the last, then the first alone
    a, b, c, d = model.entries[0][3]
    pieces = [
        ((0, 0, 0, 0), (a - 1, b, c, d // 2)),
        ((0, 0, 0, d // 2), (a - 1, b, c, d)),
        ((a - 1, 0, 0, 0), (a, b, c, d)),
    ]
    placements = []
    for rank, (start, stop) in enumerate(pieces):
        regions = [Region(0, start, stop, 0)]
        if rank == 0:  # (the rest of the model, whole, on the first rank)
            lo = regions[0].size
            for entry in range(1, len(model.entries)):
                shape = model.entries[entry][3]
                regions.append(Region(entry, (0,) * len(shape), tuple(shape), lo))
                lo += regions[-1].size
        placements.append(Placement(model, regions))
    assert a > 1 and d > 1
    index = write(tmp_path, model, placements, np.arange(model.num_params, dtype=np.float64))
    with h5py.File(index, "r") as handle:
        np.testing.assert_array_equal(handle["params"][...], model.params)
        np.testing.assert_array_equal(handle["optimizer/m"][...], np.arange(model.num_params))
        np.testing.assert_array_equal(
            handle["parameters"][parameters(model)[0][0]][...], parameter(model, model.params, 0)
        )


def test_a_sharded_checkpoint_loads_as_a_whole_one_after_its_parts_are_checked(tmp_path):
    from mpidist.runtime.errors import UsageError
    from mpidist.store import checkpoint

    model = whole()
    moments = np.random.default_rng(1).random(model.num_params)
    attrs = checkpoint.attributes(
        12, 2, 3, json.dumps({"model": "test", "seed": 5}), 5, 3, lineage="0123abcd"
    )
    write(tmp_path, model, layouts(model)["tensor"], moments, {**attrs, "optimizer": {"steps": 12}})
    loaded = checkpoint.load(tmp_path / "ckpt.h5")
    np.testing.assert_array_equal(loaded.params, model.params)
    np.testing.assert_array_equal(loaded.optimizer_state["m"], moments)
    assert (
        loaded.step,
        loaded.epoch,
        loaded.epoch_step,
        loaded.optimizer_steps,
        loaded.seed,
        loaded.lineage,
    ) == (12, 2, 3, 12, 5, "0123abcd")
    (tmp_path / "ckpt.parts" / sharded.part_name(2)).unlink()
    with pytest.raises(UsageError, match="part ckpt.parts/rank-00002.h5 is missing"):
        checkpoint.load(tmp_path / "ckpt.h5")


def test_a_format_1_checkpoint_with_a_virtual_dataset_is_refused(tmp_path):
    # (format 1 holds its arrays itself: a virtual one there could read any file)
    from mpidist.runtime.errors import UsageError
    from mpidist.store import checkpoint

    model = whole()
    index = write(tmp_path, model, layouts(model)["pipeline"], np.zeros(model.num_params))
    with h5py.File(index, "r+") as handle:
        handle.attrs["format"] = checkpoint.FORMAT
    with pytest.raises(UsageError, match="params is not an array of floats stored in this file"):
        checkpoint.load(index)
