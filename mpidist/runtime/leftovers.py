"""What a command is writing right now, so that a signal that ends it where it stands leaves nothing behind.

A command other than ``train`` stopped by a signal ends at once (see
:func:`mpidist.runtime.preempt.interrupt_on_signals`): no ``finally`` of its
own runs, as an exception raised by a signal handler can land anywhere --
in a ``__del__`` or a weak reference's callback, which swallow it (the
command then went on, and wrote its output), or inside h5py while it holds
a file half-written.  So every writer names here, for as long as it writes,
what a stop must remove: a file aside (:mod:`mpidist.store.atomic`), a folder
aside, a scratch folder, a directory made for an output.  The handler
removes them (:func:`remove_all`) and ends the process.

Only the main thread's handler removes; entries come and go from any thread
(a dict's item set and pop are atomic under Python's lock).
"""

import contextlib
import itertools
import shutil
from pathlib import Path

_PENDING = {}
_TOKENS = itertools.count()


@contextlib.contextmanager
def pending(path, tree=False):
    """For the body's duration, ``path`` is removed if a signal ends the process: a file (unlinked), an empty
    directory (``rmdir``: a directory someone else filled meanwhile stays), or with ``tree`` a folder and all
    in it (only for folders the caller made for itself: an aside or a scratch folder).  Leaving the body
    removes
    nothing: the caller renamed or removed it itself."""
    token = next(_TOKENS)
    _PENDING[token] = (Path(path), tree)
    try:
        yield path
    finally:
        _PENDING.pop(token, None)


def remove_all():
    """Remove every pending path, the newest first (a file before the directory made for it); no error is
    raised: what cannot be removed stays."""
    for token in sorted(_PENDING, reverse=True):
        path, tree = _PENDING.pop(token, (None, False))
        if path is None:
            continue
        try:
            if tree:
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass
