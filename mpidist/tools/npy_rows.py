"""``.npy`` arrays as ``predict`` reads them: a header alone (shape, order, type: never unpickled),
and the rows of an ``.npz``'s member a block at a time."""

import numpy as np


def npy_header(handle):
    """``(shape, fortran_order, dtype)`` of the ``.npy`` stream ``handle``, from its header alone."""
    fmt = np.lib.format
    version = fmt.read_magic(handle)
    if version == (1, 0):
        return fmt.read_array_header_1_0(handle)
    if version == (2, 0):
        return fmt.read_array_header_2_0(handle)
    raise ValueError(f".npy format version {version} is not one of plain numbers (1.0 or 2.0)")


class MemberRows:
    """Rows of a C-order ``.npy`` member of a zip archive (an ``.npz``), read a block at a time.

    ``np.load`` decompresses a member whole: read so a block at a time, a
    compressed ``.npz`` of a million samples took four times as long as its
    ``.npy`` and held the whole array per block.  The member is kept open
    between reads instead, so blocks read in order (as every rank reads its
    share) decompress each byte once; a block before the last one read opens
    it again.
    """

    def __init__(self, path, name, dtype, shape):
        self.path, self.name, self.dtype, self.shape = path, name, dtype, shape
        self.archive = self.stream = None
        self.next_row = 0

    def read(self, lo, hi):
        """Rows ``lo`` to ``hi`` as a new array."""
        if self.stream is None or lo < self.next_row:
            self._open()
        rows = np.empty((hi - lo,) + tuple(self.shape[1:]), self.dtype)
        row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:]))
        self.stream.seek(self.start + lo * row_bytes)  # (forward: decompressed and passed over)
        view = memoryview(rows.reshape(-1).view(np.uint8))  # (the rows' bytes, none for no rows)
        done = 0
        while done < len(view):
            count = self.stream.readinto(view[done:])
            if not count:
                raise ValueError(f"{self.name} ends before row {hi:,} of {self.shape[0]:,}: cut short")
            done += count
        self.next_row = hi
        if hi >= self.shape[0]:  # (the last rows: let the file go)
            self.close()
        return rows

    def _open(self):
        import zipfile

        self.close()
        self.archive = zipfile.ZipFile(self.path)
        self.stream = self.archive.open(self.name)
        npy_header(self.stream)
        self.start, self.next_row = self.stream.tell(), 0

    def close(self):
        if self.stream is not None:
            self.stream.close()
            self.archive.close()
        self.archive = self.stream = None
