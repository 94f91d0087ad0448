"""What a user's file holds beside its arrays is measured before it is read, and refused past its bound
unread: names, statistics and attributes of datasets (checkpoints': tests/test_checkpoint.py) (issue 61,
item 6).

The peaks are measured in a fresh interpreter (its ``ru_maxrss`` before and after the read): what main took
for the issue's file of 0.4 MB was 924 MiB."""

import struct
import subprocess
import sys
import zlib

import h5py
import numpy as np
import pytest

from conftest import ROOT, child_environ
from mpidist import data
from mpidist.runtime.errors import UsageError
from mpidist.tools.ingest import write_dataset

MiB = 1 << 20


def dataset(path, features=4):
    rng = np.random.default_rng(0)
    splits = {
        "train": (rng.random((20, features)).astype(np.float32), np.arange(20) % 3),
        "test": (rng.random((5, features)).astype(np.float32), np.arange(5) % 3),
    }
    return write_dataset(path, "toy", splits, 3, "made by a test")


def zeros_compressed(nbytes):
    """``nbytes`` of zeros as one zlib stream (HDF5's gzip filter), made without compressing them all: after a
    full flush a compressor forgets what came before, so each MiB compresses to the same bytes."""

    def alone(size):  # (raw deflate blocks of ``size`` zeros that depend on nothing before them)
        packer = zlib.compressobj(9, zlib.DEFLATED, -15)
        return packer.compress(bytes(size)) + packer.flush(zlib.Z_FULL_FLUSH)

    adler = ((nbytes % 65521) << 16) | 1  # (of zeros: its first sum stays 1, its second counts the bytes)
    end = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # (an empty last block)
    blocks = alone(MiB) * (nbytes // MiB) + alone(nbytes % MiB)
    return b"\x78\xda" + blocks + end + struct.pack(">I", adler)


def one_compressed_chunk(handle, name, shape, dtype, chunks, maxshape=None):
    """Dataset ``name`` of one gzip'ed chunk of zeros, written as stored (nothing that large is made)."""
    item = handle.create_dataset(
        name, shape=shape, dtype=dtype, chunks=chunks, maxshape=maxshape, compression="gzip"
    )
    size = int(np.prod(chunks)) * np.dtype(dtype).itemsize
    item.id.write_direct_chunk((0,) * len(shape), zeros_compressed(size))


PEAK = """
import resource, sys
from mpidist import data
from mpidist.runtime.errors import UsageError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    data.inspect(sys.argv[1])
    print("read")
except UsageError as err:
    print(err)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def inspected_in_a_fresh_process(path):
    """What ``data.inspect(path)`` says in a fresh interpreter, and the MiB its peak grew by meanwhile."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_environ(PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    *said, grown = done.stdout.strip().splitlines()
    return "\n".join(said), int(grown)


def test_names_that_would_decompress_to_400_mb_are_refused_before_they_are_read(tmp_path):
    # the file: 4,000 features, their names 100,000-byte texts gzip'ed to 0.4 MB
    path = dataset(tmp_path / "names.h5", features=4000)
    with h5py.File(path, "a") as handle:
        one_compressed_chunk(handle, "feature_names", (4000,), "S100000", (4000,))
    assert path.stat().st_size < MiB
    said, grown = inspected_in_a_fresh_process(path)
    assert said == (
        f"{path}: feature_names is stored as texts of 100,000 bytes each; one takes at most 800: not read"
    )
    assert grown < 64, f"the peak grew by {grown} MiB"


def test_names_that_point_at_one_long_text_are_refused_after_reading_one(tmp_path):
    # texts of variable length live in the file's heap, each name an address: 4,000 names can all point at
    # one text of 100,000 bytes, 400 MB read whole from a file of 0.3 MB
    path = dataset(tmp_path / "heap.h5", features=4000)
    names = ["y" * 100_000] + [f"f{index}" for index in range(1, 4000)]
    with h5py.File(path, "a") as handle:
        handle.create_dataset("feature_names", data=names, dtype=h5py.string_dtype())
        at, stored = handle["feature_names"].id.get_offset(), handle["feature_names"].id.get_storage_size()
    width = stored // 4000  # (a length, then the heap's address of the text)
    with open(path, "r+b") as file:
        file.seek(at)
        first = file.read(width)
        assert struct.unpack("<I", first[:4]) == (100_000,)
        file.seek(at)
        file.write(first * 4000)
    assert path.stat().st_size < MiB
    said, grown = inspected_in_a_fresh_process(path)
    assert said == f"{path}: feature_names[0] is 100,000 bytes long; one takes at most 800"
    assert grown < 64, f"the peak grew by {grown} MiB"


def test_statistics_in_a_chunk_far_larger_than_their_values_are_refused_unread(tmp_path):
    path = dataset(tmp_path / "stats.h5")
    with h5py.File(path, "a") as handle:
        # 4 values in a chunk of 2^25 (one that grows along its first axis may be larger than the dataset)
        one_compressed_chunk(handle, "stats/mean", (4,), np.float64, (1 << 25,), maxshape=(None,))
        handle["stats/std"] = np.ones(4)
    with pytest.raises(UsageError) as refused:
        data.inspect(path)
    assert str(refused.value) == (
        f"{path}: stats/mean is stored in chunks of 256.0 MiB each (chunk shape (33554432,)), which a read "
        "decompresses whole, for values of 32 B: not read"
    )


def dense_copy(path, **attrs):
    """``path`` written again with HDF5's dense attribute storage (an attribute over 64 KiB needs it), with
    ``attrs`` set."""
    dense = path.with_name("dense-" + path.name)
    with h5py.File(path, "r") as source, h5py.File(dense, "w", libver="latest") as copy:
        for name in source:
            source.copy(source[name], copy, name)
        copy.attrs.update({**source.attrs, **attrs})
    return dense


@pytest.mark.parametrize(
    "value, words",
    [
        (
            np.bytes_(b"n" * (2 * MiB)),
            "attribute name holds 2.0 MiB (1 value(s) of 2,097,152 bytes), more than",
        ),
        (
            np.zeros(300_000),
            "attribute name holds 2.3 MiB (300,000 value(s) of 8 bytes), more than the 1.0 MiB",
        ),
        (
            np.array(["toy"] * 1000, dtype=h5py.string_dtype()),
            "attribute name holds 1,000 value(s) of variable length; an attribute mpidist reads holds one",
        ),
    ],
    ids=["a long text", "many numbers", "many texts"],
)
def test_a_datasets_attributes_are_refused_by_their_size_before_they_are_read(tmp_path, value, words):
    path = dense_copy(dataset(tmp_path / "toy.h5"), name=value)
    with pytest.raises(UsageError) as refused:
        data.inspect(path)
    assert str(refused.value).startswith(f"{path}: {words}"), str(refused.value)


def test_texts_of_variable_length_in_chunks_read_whole_and_checked(tmp_path):
    from mpidist.store import bounded

    names = [f"feature {index}" for index in range(3000)]
    path = tmp_path / "names.h5"
    with h5py.File(path, "w") as handle:
        handle.create_dataset(
            "names", data=names, dtype=h5py.string_dtype(), chunks=(1000,), compression="gzip"
        )
    refuse = lambda item, problem: UsageError(f"{item} {problem}")  # noqa: E731
    # (a chunk cache smaller than a chunk: the dataset is read through one that holds it)
    with h5py.File(path, "r", rdcc_nbytes=1024) as handle:
        assert bounded.texts(handle["names"], "names", 800, refuse) == [name.encode() for name in names]
        with pytest.raises(UsageError, match=r"names\[0\] is 9 bytes long; one takes at most 8"):
            bounded.texts(handle["names"], "names", 8, refuse)
