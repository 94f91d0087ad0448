"""What ``--shard parameters``' units cost ``plan`` to move: the calibrated model's units, the workers of a
node that share one copy of each, and a step's gathers and sums between ranks (:mod:`mpidist.plan.step`
costs the rest of the step)."""

import numpy as np

from ..parallel.data.units import node_sharing, units_of
from .buckets import MIB


def shared_by(layout):
    """The workers of a node that read one copy of each gathered unit (:func:`~mpidist.parallel.data.units.
    node_sharing`: ``--exchange auto`` on CPUs, the replicas of a part on a node; ``mpi``: one copy each)."""
    return node_sharing(layout.exchange, layout.per_node, max(layout.tensor, 1))


def unit_traffic(cal, layout, padded, sharing):
    """Seconds a step of ``--shard parameters`` moves and sums its units (``padded``: each unit's bytes,
    padded to equal blocks): forward's gathers, backward's again but the last two's, the sums.

    Gathered on every rank, each is one ring over every worker; once per node (``sharing`` workers a node),
    a gather is ``L`` rings between the nodes of ``1/L`` of the unit each, at once through the node's one
    link (the unit's bytes leave the node as one ring's would), and a sum adds the node's slots in place,
    then such rings sum each slice between the nodes."""
    workers, calls = layout.replicas, padded + padded[:-2] + padded
    if sharing == 1:
        link = cal.link_for(layout)
        moved = sum(link.reduce_scatter(nbytes, workers) for nbytes in calls)
        return moved + (workers - 1) / workers * sum(padded) * cal.sum_per_byte
    nodes, between = workers // sharing, 0.0
    if nodes > 1:
        between = sum(cal.network.reduce_scatter(nbytes, nodes) for nbytes in calls)
    summed = ((sharing - 1) + (nodes - 1) / nodes) / sharing * sum(padded) * cal.sum_per_byte
    return between + summed


def units_of_model(cal, bucket_mb):
    """The calibrated model's ``--shard parameters`` units at ``bucket_mb``."""
    offsets = np.cumsum([0] + [layer.params for layer in cal.layers[:-1]]).tolist()
    return units_of(offsets, cal.params, bucket_mb * MIB, cal.itemsize)
