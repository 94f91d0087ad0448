"""New HDF5 files whose failed writes (a full disk, a quota, a file-size limit) reach the caller as one
OSError.

HDF5 cannot recover from a write that fails while it closes a file: h5py's
close raises, the library keeps the file half-closed, and when the process
exits HDF5's own shutdown meets that state and the process dies of a
segmentation fault (exit 139; HDF5 2.0 with h5py 3.16 -- a second close, even
once the disk has room again, does not help).  HDF5 holds writes in its
caches, so any write may first fail at the close.

So every HDF5 file mpidist writes is opened through :func:`created`: HDF5
writes into a Python file object (h5py's ``fileobj`` driver) that never fails
to it.  The first ``OSError`` of the file system is kept, the writes after it
are dropped (counted as written), and once h5py has closed the file --
cleanly, as far as HDF5 knows -- the kept error is raised.  The file on disk
is then worthless; every caller writes aside (:mod:`mpidist.store.atomic`) and
removes it, so the final name keeps its previous file.
"""

import contextlib
import io

import h5py


class _Guarded(io.RawIOBase):
    """A file HDF5 writes through without ever seeing a failure: ``kept`` is the first ``OSError``, if any."""

    def __init__(self, path):
        super().__init__()
        self.raw = open(path, "w+b", buffering=0)
        self.kept = None

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=io.SEEK_SET):
        return self.raw.seek(offset, whence)

    def tell(self):
        return self.raw.tell()

    def readinto(self, buffer):
        view = memoryview(buffer).cast("B")
        done = self.raw.readinto(view) or 0
        if done < len(view):  # (past the end, or a dropped write: zeros, as HDF5 reads an unwritten region)
            view[done:] = bytes(len(view) - done)
        return len(view)

    def write(self, data):
        size = len(memoryview(data).cast("B"))
        if self.kept is None:
            try:
                return self.raw.write(data)
            except OSError as err:
                self.kept = err
        self.raw.seek(size, io.SEEK_CUR)  # (dropped: HDF5 goes on as if written, and closes cleanly)
        return size

    def truncate(self, size=None):
        if self.kept is None:
            try:
                return self.raw.truncate(size)
            except OSError as err:
                self.kept = err
        return self.raw.tell() if size is None else size

    def flush(self):
        pass

    def close(self):
        if not self.closed:
            self.raw.close()
        super().close()


@contextlib.contextmanager
def created(path, **options):
    """A new HDF5 file at ``path`` (``h5py.File(path, "w", **options)``), closed on leaving.

    Raises:
        OSError: the first write the file system refused (``errno`` ENOSPC, EDQUOT, EFBIG, ...), once HDF5 has
            closed the file; also where the body raised something else after such a write (what HDF5 read back
            of a dropped write is not worth a traceback).
    """
    guard = _Guarded(path)
    try:
        with h5py.File(guard, "w", **options) as handle:
            yield handle
    except Exception:
        guard.close()
        if guard.kept is not None:
            raise guard.kept from None
        raise
    guard.close()
    if guard.kept is not None:
        raise guard.kept
