"""Arrays a model reuses from one training step to the next.

A training step of a fixed batch shape computes arrays of the same shapes
every time: activations, masks, gradients flowing back, the loss's
probabilities.  Allocating them afresh each step costs more than it seems:
arrays above glibc's mmap threshold (128 KiB: a 128 x 512 float32 activation
is 256 KiB) come from ``mmap`` and are page-faulted in on first touch, every
step.  A :class:`Workspace` hands each layer the same array for the same
purpose instead, so once the first step has run a step allocates nothing.

The rule that makes reuse safe: an array from the workspace is valid until
the same layer asks for the same name again, i.e. until the next training
forward/backward of the same *slot*.  :class:`~mpidist.nn.Sequential`
activates the workspace for training passes only (``forward(x,
training=True)`` and the ``backward`` after it); inference allocates, so
outputs a caller keeps (predictions) are never overwritten.  A pipeline
stage, which holds several micro-batches in flight, gives each its own slot.
"""

from ..runtime import aligned


class Workspace:
    """Reusable arrays keyed by ``(slot, owner, name)``; reallocated when a shape or dtype changes.

    Args:
        xp: array module (numpy or cupy).
    """

    def __init__(self, xp):
        self.xp = xp
        self.active = False  # Sequential turns it on for training passes
        self.slot = 0  # a pipeline stage's micro-batch slot
        self._arrays = {}

    def array(self, owner, name, shape, dtype, fill=None):
        """The array ``owner`` keeps under ``name`` in the current slot, of ``shape`` and ``dtype``.

        Uninitialised, or with ``fill`` every element ``fill`` when it is made
        (and as its owner left it afterwards: a padded buffer whose zero borders
        are never written, a column matrix whose column of ones is never written).
        """
        key = (self.slot, id(owner), name)
        found = self._arrays.get(key)
        if found is None or found.shape != shape or found.dtype != dtype:
            found = self._arrays[key] = _made(self.xp, shape, dtype, fill)
        return found

    @property
    def nbytes(self):
        """Bytes of the arrays held now, every slot's (a training step's activations, gradients, loss)."""
        return sum(int(array.nbytes) for array in self._arrays.values())


class UsesWorkspace:
    """Mixin of layers and losses: :meth:`scratch` arrays from a :class:`Workspace`, where one is set."""

    #: Set by :class:`~mpidist.nn.Sequential` (layers) and :meth:`~mpidist.nn.Sequential.use_workspace`
    #: (losses).
    workspace = None

    def scratch(self, name, shape, dtype, fill=None):
        """An uninitialised array for ``name``: the same one every training step, a new one otherwise.

        Layers and losses compute their outputs and gradients into these
        (``out=``), so a training step allocates nothing once warm.  The array
        stays valid until this object asks for ``name`` again.  ``fill``: every
        element ``fill`` when first made, as its owner left it afterwards (a
        buffer whose zero borders are never written).
        """
        workspace = self.workspace
        if workspace is None or not workspace.active:
            return _made(self.xp, shape, dtype, fill)
        return workspace.array(self, name, tuple(shape), dtype, fill)

    def scratch_like(self, name, like, dtype=None):
        """:meth:`scratch` of ``like``'s shape *and memory order*.

        Convolutions compute channels-last and hand on ``(N, C, H, W)``
        transposed views; an elementwise layer or a pooling that follows keeps
        that memory order, so every pass walks memory in order and the next
        convolution finds its input channels-last already.
        """
        if like.flags.c_contiguous:  # the common case, without working out an order
            return self.scratch(name, like.shape, like.dtype if dtype is None else dtype)
        order = memory_order(like)
        stored = self.scratch(
            name, tuple(like.shape[axis] for axis in order), like.dtype if dtype is None else dtype
        )
        return stored.transpose(inverse(order))


def memory_order(array):
    """Axes of ``array`` from the outermost in memory to the innermost (``(0, 2, 3, 1)`` for NCHW views of
    NHWC)."""
    return tuple(sorted(range(array.ndim), key=lambda axis: -abs(array.strides[axis])))


def inverse(order):
    """The permutation undoing ``order``."""
    undo = [0] * len(order)
    for position, axis in enumerate(order):
        undo[axis] = position
    return tuple(undo)


def _made(xp, shape, dtype, fill):
    """A new array: uninitialised, or every element ``fill``."""
    return aligned.empty(xp, shape, dtype) if fill is None else aligned.full(xp, shape, fill, dtype)
