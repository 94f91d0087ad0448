"""What an untrusted HDF5 file holds beside its arrays, read whole only once its size is known to be small.

h5py reads an attribute, or a dataset indexed with ``[()]``, whole: as many
bytes as the file says it holds, decompressed.  A file of a few hundred
kilobytes can say hundreds of megabytes (4,000 names of 100,000 bytes each,
gzip'ed; a chunk of 800 MB of zeros behind a dataset of four values), and
the refusal that follows the read comes after the memory is taken.  So what
a reader takes whole from a user's file -- attributes, names, statistics --
is measured first, from what HDF5 says of its type, dataspace and chunks,
and refused past a bound before a byte of it is read:

* an attribute (:class:`Attributes`): its values' count times their size,
  at most :data:`ATTRIBUTE_BYTES` unless the reader says otherwise
  (attributes are never compressed).  Text of variable length, whose length
  HDF5 tells only by reading it, is one value at most, refused past the bound
  once read, before anything parses it;
* a dataset read whole (:func:`values`, :func:`texts`): its values in memory
  and each chunk a read decompresses.  Text of variable length is read a
  value at a time, each refused past its bound as soon as it is read: the
  values of such text are addresses in the file's heap, and any number of
  them may name one long text, which a read of them all would copy as often;
* the arrays of a checkpoint (:func:`oversized_chunks`): a chunk far larger
  than its array, which only an array of unlimited extent can have, is
  refused, as a read of any of its values decompresses it whole.

What one value of variable length claims to be is HDF5's to check: HDF5 2.0
sets aside the length a value's address claims (up to 4 GiB) before it
compares it with the text in the heap, and no call of its API shows that
length first; mpidist reads no more than one such value at a time.

Each refusal names the item, the size it claims and the bound.
"""

import h5py
import numpy as np

from ..runtime.memory import check_fits, human
from ..runtime.text import printable

ATTRIBUTE_BYTES = 1 << 20  # what an attribute may hold: mpidist's are a few numbers, names and JSON tables
HEAP_ID_BYTES = 16  # a value of variable length as a dataset's chunk stores it: its length and heap address
FLOOR_CHUNK = 1 << 20  # chunk bytes allowed whatever the values take (h5py's own chunks stay below 1 MiB)


def variable(kind):
    """Whether the HDF5 type ``kind`` (an h5py type id) holds values of variable length anywhere in it."""
    cls = kind.get_class()
    if cls == h5py.h5t.STRING:
        return kind.is_variable_str()
    if cls == h5py.h5t.VLEN:
        return True
    if cls == h5py.h5t.COMPOUND:
        return any(variable(kind.get_member_type(index)) for index in range(kind.get_nmembers()))
    if cls == h5py.h5t.ARRAY:
        return variable(kind.get_super())
    return False


def _count(space):
    """How many values an HDF5 dataspace holds (none for an empty one)."""
    return 0 if space.get_simple_extent_type() == h5py.h5s.NULL else int(space.get_simple_extent_npoints())


class Attributes:
    """An HDF5 object's attributes, each read only once its size is known to be within a bound: ``get`` and
    ``in`` as h5py's ``attrs``.

    Args:
        owner: the h5py file, group or dataset.
        bad: ``bad(item, problem)`` -> the exception to raise (``item``: ``"attribute config"``).
        limit: the bytes one attribute may hold; ``limits`` maps a name to its own.
    """

    def __init__(self, owner, bad, limit=ATTRIBUTE_BYTES, limits=None):
        self.owner, self.bad, self.limit, self.limits = owner, bad, limit, limits or {}

    def __contains__(self, name):
        return name in self.owner.attrs

    def get(self, name, default=None):
        """Attribute ``name``'s value, or ``default`` where there is none; ``bad`` where it is too large."""
        if name not in self.owner.attrs:
            return default
        limit = self.limits.get(name, self.limit)
        attribute = self.owner.attrs.get_id(name)
        count, kind = _count(attribute.get_space()), attribute.get_type()
        if variable(kind):
            if kind.get_class() != h5py.h5t.STRING or count > 1:
                raise self.bad(
                    f"attribute {name}",
                    f"holds {count:,} value(s) of variable length; an attribute mpidist reads holds one "
                    "number or one text: not read",
                )
        elif count * kind.get_size() > limit:
            raise self.bad(
                f"attribute {name}",
                f"holds {human(count * kind.get_size())} ({count:,} value(s) of {kind.get_size():,} bytes), "
                f"more than the {human(limit)} an attribute may: not read",
            )
        value = self.owner.attrs[name]
        if isinstance(value, (str, bytes)) and len(value) > limit:  # (one text of variable length)
            raise self.bad(
                f"attribute {name}", f"is a text of {len(value):,} characters, more than {human(limit)}"
            )
        return value


def chunk_bytes(dataset):
    """Bytes of one chunk of ``dataset`` as a read decompresses it (0 where it is not stored in chunks)."""
    if dataset.chunks is None:
        return 0
    size = dataset.id.get_type().get_size()
    if variable(dataset.id.get_type()):
        size = max(size, HEAP_ID_BYTES)
    return int(np.prod(dataset.chunks, dtype=np.int64)) * size


def chunk_problem(dataset, needed=None):
    """Why a read of ``dataset`` would decompress more than its values take (``needed`` bytes; default: its
    count times its stored size) and more than :data:`FLOOR_CHUNK`, in words; None where it would not.  Only a
    chunk larger than its dataset, of unlimited extent, can: 4 values in a chunk of 2^25."""
    if needed is None:
        needed = int(dataset.size) * max(dataset.id.get_type().get_size(), 1)
    chunk = chunk_bytes(dataset)
    if chunk <= max(needed, FLOOR_CHUNK):
        return None
    return (
        f"is stored in chunks of {human(chunk)} each (chunk shape {tuple(dataset.chunks)}), which a read "
        f"decompresses whole, for values of {human(needed)}: not read"
    )


def oversized_chunks(handle):
    """The first dataset of the open file ``handle`` whose chunks :func:`chunk_problem` refuses, in words
    (``"'params' is stored in chunks of ..."``); None where there is none.  Looks at each dataset, reads
    none."""
    found = []  # (the visit only gathers: an exception raised inside it becomes h5py's SystemError)
    handle.visititems(lambda name, item: found.append(name) if isinstance(item, h5py.Dataset) else None)
    for name in found:
        problem = chunk_problem(handle[name])
        if problem:
            return f"'{printable(name)}' {problem}"
    return None


def _check_chunks(dataset, what, needed, bad):
    """Refuse ``dataset`` where :func:`chunk_problem` does; its chunk's bytes."""
    problem = chunk_problem(dataset, needed)
    if problem:
        raise bad(what, problem)
    return chunk_bytes(dataset)


def values(dataset, what, limit, bad):
    """``dataset``'s values (numbers, of a fixed size), read whole once they take at most ``limit`` bytes,
    each chunk no more than they do (or :data:`FLOOR_CHUNK`), and this rank may hold them.

    Args:
        dataset: an open h5py dataset.
        what: its name in messages (``"stats/mean"``).
        limit: the bytes its values may take.
        bad: ``bad(item, problem)`` -> the exception to raise.
    """
    if variable(dataset.id.get_type()):
        raise bad(what, "holds values of variable length; it must hold numbers")
    needed = int(dataset.size) * dataset.dtype.itemsize
    if needed > limit:
        raise bad(what, f"holds {human(needed)}, more than the {human(limit)} it may: not read")
    _check_chunks(dataset, what, needed, bad)
    check_fits(needed, what)
    return dataset[()]


def texts(dataset, what, longest, bad):
    """The text values of the 1-D ``dataset`` (a string dtype), as bytes, each at most ``longest`` bytes.

    Fixed-length text is refused before it is read where its values are stored wider than ``longest``; text
    of variable length is read a value at a time (through a chunk cache that holds a chunk, so each chunk is
    decompressed once), each refused as soon as it is read.

    Args:
        dataset: an open h5py dataset of one axis.
        what: its name in messages (``"feature_names"``).
        longest: the bytes one value may take.
        bad: ``bad(item, problem)`` -> the exception to raise (``item``: ``what``, or ``what[index]``).
    """
    count = int(dataset.shape[0])
    if not variable(dataset.id.get_type()):
        width = dataset.dtype.itemsize
        if width > longest:
            raise bad(
                what, f"is stored as texts of {width:,} bytes each; one takes at most {longest:,}: not read"
            )
        _check_chunks(dataset, what, count * width, bad)
        check_fits(count * width, what)
        return [bytes(value) for value in dataset[()]]
    chunk = _check_chunks(dataset, what, count * HEAP_ID_BYTES, bad)
    one = np.empty(1, dtype=h5py.string_dtype())
    memory, found = h5py.h5s.create_simple((1,)), []
    item = _with_cache(dataset, chunk)
    space = item.get_space()
    for index in range(count):
        space.select_hyperslab((index,), (1,))
        item.read(memory, space, one)
        value = one[0] if isinstance(one[0], bytes) else str(one[0]).encode("utf-8", "surrogateescape")
        if len(value) > longest:
            raise bad(f"{what}[{index}]", f"is {len(value):,} bytes long; one takes at most {longest:,}")
        found.append(value)
    return found


def _with_cache(dataset, chunk):
    """``dataset``'s id, opened again with a chunk cache that holds one chunk of ``chunk`` bytes where the
    default holds less (a value at a time would decompress its chunk each time)."""
    access = dataset.id.get_access_plist()
    slots, cache, weight = access.get_chunk_cache()
    if chunk <= cache:
        return dataset.id
    access.set_chunk_cache(slots, chunk, weight)
    return h5py.h5d.open(dataset.file.id, dataset.name.encode("utf-8", "surrogateescape"), access)
