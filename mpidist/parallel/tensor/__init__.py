"""Tensor parallelism (``--tensor T``): each large layer split across the ``T`` ranks of a tensor group.

The part a rank holds and its group's sums are :class:`~mpidist.parallel.tensor.part.TensorPart`, which
registers itself as the split of the mesh's ``part`` axis; ``allreduce`` and ``pipeline`` compose with it
through the core (:mod:`mpidist.parallel.parts`), never importing this family.  The arithmetic of the
split is :mod:`mpidist.nn.tensor`.
"""

from .part import TensorPart  # (importing it registers it as the part axis's split)

__all__ = ["TensorPart"]
