"""Where an HDF5 file's bytes come from: the items of an untrusted file that would make a read open another.

HDF5 lets a file's items live elsewhere: an external link names an object of
another file, a virtual dataset maps datasets of other files, and external
storage keeps a dataset's raw values in plain files named by path.  Reading
such an item reads whatever file it names, with the reader's rights, so a
file crafted to point at another of the user's files (a private key read as
"parameters", a pipe that blocks forever) would be read as if it were its
own.  No item is read before HDF5's own description of it (its link's class,
its dataset's layout and storage) says its bytes are in the file itself or in
the files the caller trusts (a sharded checkpoint's parts); no link is
followed and no other file opened to find out.
"""

import h5py

from ..runtime.text import printable

REFUSED = "refused, as it reads another file"


def _text(name):
    """A name HDF5 gave as bytes, as text to show."""
    return printable(name.decode("utf-8", "replace") if isinstance(name, bytes) else name)


def elsewhere(dataset, allowed=()):
    """What makes ``dataset``'s values (an h5py dataset or its id) come from another file than its own, in
    words; None where nothing does.

    Args:
        dataset: an open dataset.
        allowed: the files a virtual dataset may read, as it names them (``"."``, its own file, is always
            allowed).

    Returns:
        ``"keeps its values in 'x.bin' (HDF5 external storage)"``, ``"is a virtual dataset reading
        'y.h5'"``, or None.
    """
    plist = (dataset.id if isinstance(dataset, h5py.Dataset) else dataset).get_create_plist()
    if plist.get_external_count():
        return f"keeps its values in {_text(plist.get_external(0)[0])!r} (HDF5 external storage)"
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        for index in range(plist.get_virtual_count()):
            source = plist.get_virtual_filename(index)
            if source != "." and source not in allowed:
                return f"is a virtual dataset reading {_text(source)!r}"
    return None


def other_file(handle, item):
    """Whether ``item`` (an object reached by name from the open file ``handle``) lives in another file: a
    soft link can lead through an external link that the name itself does not show."""
    return item.id.fileno != handle.id.fileno


def outside(handle, allowed=()):
    """The first item of the open file ``handle`` that would read another file than this one (or the
    ``allowed`` ones, see :func:`elsewhere`), in words; None where every item's bytes are here.

    Every link is looked at and none is followed: a link of any class but hard or soft (an external link, or
    a user-defined one, which HDF5 resolves through a callback) is refused wherever it is, as any soft link or
    a virtual dataset's source name could reach through it; with none, every name resolves inside the file.
    Every dataset's storage is looked at (:func:`elsewhere`).  Costs one look at each link and dataset: no
    value is read.
    """
    links = []  # (the callback only gathers: an exception raised inside it becomes h5py's SystemError)
    handle.id.links.visit(lambda name, info: links.append((name, info.type)), info=True)
    for name, kind in links:
        if kind == h5py.h5l.TYPE_SOFT:
            continue
        if kind != h5py.h5l.TYPE_HARD:
            return f"'{_text(name)}' is {_link(handle, name, kind)}: {REFUSED}"
        item = h5py.h5o.open(handle.id, name)
        problem = elsewhere(item, allowed) if isinstance(item, h5py.h5d.DatasetID) else None
        if problem:
            return f"'{_text(name)}' {problem}: {REFUSED}"
    return None


def _link(handle, name, kind):
    """A link that is neither hard nor soft, in words."""
    if kind == h5py.h5l.TYPE_EXTERNAL:
        try:
            target = handle.get(name.decode("utf-8", "surrogateescape"), getlink=True).filename
        except (KeyError, RuntimeError, OSError, ValueError, UnicodeError):
            target = "another file"
        return f"an external link to {_text(target)!r}"
    return f"a user-defined link (class {kind}), which HDF5 resolves by a callback"
