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
from mpidist.store import parts_debris, sharded
from crafted import MARKER, recorded_again


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
    from mpidist.loop.sharded_save import parameters as named

    return named(model)


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
        names = [name for name, _, _ in parameters(model)]  # (HDF5 lists them sorted: by layer, then name)
        assert list(handle["parameters"]) == sorted(names)
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
        assert "is a virtual dataset reading 'ckpt.parts/rank-00001.h5'" in sharded.verify(index, handle)
    # (HDF5 expands "%b" in a source's name to the index's own: a part named so is another file than read)
    for file in ("../elsewhere.h5", "/etc/passwd", "", "ckpt.parts/%b.h5"):
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
    parts_debris.remove_parts(tmp_path / "ckpt.parts")
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
    with pytest.raises(UsageError, match="is a virtual dataset reading 'ckpt.parts/rank-00000.h5': refused"):
        checkpoint.load(index)


# -- nothing read from outside the checkpoint's folder (issue 61, item 5) -----------------------------------


def outside(tmp_path, count):
    """A raw file and an HDF5 file (its ``x``) of ``count`` markers, outside the checkpoint's folder."""
    folder = tmp_path / "outside"
    folder.mkdir(exist_ok=True)
    np.full(count, MARKER).tofile(folder / "values.bin")
    with h5py.File(folder / "values.h5", "w") as handle:
        handle["x"] = np.full(count, MARKER)
    return folder / "values.bin", folder / "values.h5"


def stored_elsewhere(handle, name, raw, source):
    size = handle[name].size
    del handle[name]
    handle.create_dataset(name, shape=(size,), dtype=np.float64, external=[(str(raw), 0, size * 8)])


def linked_out(handle, name, raw, source):
    del handle[name]
    handle[name] = h5py.ExternalLink(str(source), "/x")


def virtual_over_outside(handle, name, raw, source):
    size = handle[name].size
    del handle[name]
    layout = h5py.VirtualLayout((size,), np.float64)
    layout[:] = h5py.VirtualSource(str(source), "x", (size,))
    handle.create_virtual_dataset(name, layout)


def soft_link_through_a_door(handle, name, raw, source):
    del handle[name]
    handle["door"] = h5py.ExternalLink(str(source), "/")
    handle[name] = h5py.SoftLink("/door/x")


def a_link_out_that_nothing_reads(handle, name, raw, source):
    handle["notes"] = h5py.ExternalLink(str(source), "/x")


def a_chunk_far_larger_than_its_values(handle, name, raw, source):
    from test_bounded import one_compressed_chunk

    size = handle[name].size
    del handle[name]
    one_compressed_chunk(handle, name, (size,), np.float64, (1 << 25,), maxshape=(None,))


CRAFTS = {
    "external storage": (stored_elsewhere, "keeps its values in '"),
    "an external link": (linked_out, "is an external link to '"),
    "a virtual dataset over another file": (virtual_over_outside, "is a virtual dataset reading '"),
    "a soft link through an external link": (soft_link_through_a_door, "'door' is an external link to '"),
    "an external link nothing reads": (a_link_out_that_nothing_reads, "'notes' is an external link to '"),
    "a chunk of 256 MiB": (
        a_chunk_far_larger_than_its_values,
        "'params' is stored in chunks of 256.0 MiB each",
    ),
}


@pytest.mark.parametrize("craft", list(CRAFTS))
def test_a_part_that_reads_another_file_or_a_huge_chunk_is_refused_before_anything_is_read(tmp_path, craft):
    from mpidist.runtime.errors import UsageError
    from mpidist.store import checkpoint

    model = whole()
    attrs = {**checkpoint.attributes(7, 0, 7, json.dumps({"model": "test"}), 5, 3), "optimizer": {"steps": 7}}
    index = write(tmp_path / "ck", model, layouts(model)["tensor"], np.zeros(model.num_params), attrs)
    part = index.parent / "ckpt.parts" / sharded.part_name(1)
    change, words = CRAFTS[craft]
    with h5py.File(part, "r+") as handle:
        raw, source = outside(tmp_path, handle["params"].size)
        change(handle, "params", raw, source)
    recorded_again(index)
    with pytest.raises(UsageError) as refused:
        checkpoint.load(index)
    message = str(refused.value)
    assert message.startswith(f"{index}: part ckpt.parts/rank-00001.h5: '") and words in message, message
    assert message.endswith("not read" if "chunk" in craft else "refused, as it reads another file"), message
    # the header alone reads no part; the share that holds part 1 refuses it, the others' pass
    saved = checkpoint.load(index, arrays=False)
    with pytest.raises(UsageError) as refused:
        saved.check_parts((1, 3))
    assert str(refused.value) == message
    saved.check_parts((0, 3)).check_parts((2, 3))


INDEX_CRAFTS = {
    "external storage": (stored_elsewhere, "keeps its values in '"),
    "an external link": (linked_out, "is an external link to '"),
    "a virtual dataset over another file": (virtual_over_outside, "is a virtual dataset reading '"),
}


@pytest.mark.parametrize("craft", list(INDEX_CRAFTS))
def test_an_index_item_that_reads_another_file_is_refused_before_anything_is_read(tmp_path, craft):
    from mpidist.runtime.errors import UsageError
    from mpidist.store import checkpoint

    model = whole()
    attrs = {**checkpoint.attributes(7, 0, 7, json.dumps({"model": "test"}), 5, 3), "optimizer": {"steps": 7}}
    index = write(tmp_path / "ck", model, layouts(model)["pipeline"], np.zeros(model.num_params), attrs)
    name = f"{sharded.PARAMETERS}/{parameters(model)[0][0]}"  # (read by users' h5py, not by mpidist)
    change, words = INDEX_CRAFTS[craft]
    with h5py.File(index, "r+") as handle:
        raw, source = outside(tmp_path, handle[name].size)
        change(handle, name, raw, source)
    for arrays in (True, False):
        with pytest.raises(UsageError) as refused:
            checkpoint.load(index, arrays=arrays)
        assert f"'{name}' {words}" in str(refused.value), str(refused.value)


def test_a_part_that_is_a_link_out_of_the_folder_is_refused_though_its_checksum_matches(tmp_path):
    from mpidist.runtime.errors import UsageError
    from mpidist.store import checkpoint

    model = whole()
    attrs = {**checkpoint.attributes(7, 0, 7, json.dumps({"model": "test"}), 5, 3), "optimizer": {"steps": 7}}
    index = write(tmp_path / "ck", model, layouts(model)["tensor"], np.zeros(model.num_params), attrs)
    folder = index.parent / "ckpt.parts"
    (tmp_path / "outside").mkdir()
    # a part that is a link to a file outside, byte for byte the part that was written
    part = folder / sharded.part_name(1)
    shutil.move(part, tmp_path / "outside" / part.name)
    part.symlink_to(tmp_path / "outside" / part.name)
    with pytest.raises(
        UsageError, match="rank-00001.h5 is a symbolic link, or lies under one, that leads out"
    ):
        checkpoint.load(index)
    # the parts folder itself a link to a folder outside
    part.unlink()
    shutil.move(tmp_path / "outside" / part.name, part)
    shutil.move(folder, tmp_path / "outside" / "ckpt.parts")
    folder.symlink_to(tmp_path / "outside" / "ckpt.parts")
    with pytest.raises(
        UsageError, match="rank-00000.h5 is a symbolic link, or lies under one, that leads out"
    ):
        checkpoint.load(index, arrays=False)
    # a link that stays inside the checkpoint's folder reads as the file it names
    folder.unlink()
    shutil.move(tmp_path / "outside" / "ckpt.parts", folder)
    shutil.move(part, folder / "kept.h5")
    part.symlink_to("kept.h5")
    np.testing.assert_array_equal(checkpoint.load(index).params, model.params)
