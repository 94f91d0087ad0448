"""What moving bytes costs: a latency and a time per byte (the alpha-beta model), fitted or given.

The collectives mpidist uses are costed from a link's two figures with the
textbook bounds of their algorithms (an allreduce moves ``2 (r-1)/r`` of
the buffer through each rank, in ``2 log2 r`` messages as MPI libraries run
large ones on a power of two of ranks); MPI libraries pick other algorithms for some sizes and rank
counts, which ``plan --check`` (:mod:`mpidist.plan.check`) shows.
"""

import dataclasses
import math
import re

import numpy as np

from ..runtime.errors import UsageError

UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclasses.dataclass(frozen=True)
class Link:
    """A link: ``latency`` seconds a message, ``per_byte`` seconds a byte."""

    latency: float
    per_byte: float

    def time(self, nbytes, messages=1):
        """Seconds for ``messages`` messages that move ``nbytes`` in all, one after another."""
        return messages * self.latency + nbytes * self.per_byte

    def allreduce(self, nbytes, ranks):
        """An allreduce of ``nbytes`` over ``ranks``, as the cheaper of the algorithms MPI libraries run a
        large one with: a ring (``2 (r-1)`` messages, ``2 (r-1)/r`` of the buffer through each rank) and
        Rabenseifner's (a reduce-scatter by recursive halving and an allgather by recursive doubling over the
        largest power of two ``p`` of ranks: ``2 log2 p`` messages, ``2 (p-1)/p`` of the buffer; the other
        ranks first hand their buffers in and at the end take the result back).  Both are a ring's two steps
        on 2 ranks, where the link is calibrated."""
        if ranks <= 1:
            return 0.0
        ring = 2 * self.reduce_scatter(nbytes, ranks)
        power = 1 << (ranks.bit_length() - 1)
        halving = (
            2 * (power.bit_length() - 1) * self.latency + 2 * (power - 1) / power * nbytes * self.per_byte
        )
        if power < ranks:
            halving += 2 * (self.latency + nbytes * self.per_byte)
        return min(ring, halving)

    def reduce_scatter(self, nbytes, ranks):
        """A ring reduce-scatter (or allgather) of ``nbytes`` over ``ranks``: ``r - 1`` steps of ``1/r``."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (self.latency + nbytes / ranks * self.per_byte)

    def describe(self):
        bandwidth = 1 / self.per_byte if self.per_byte > 0 else math.inf
        return f"{bandwidth / 1e9:.2f} GB/s, {self.latency * 1e6:.1f} us"


def fit(sizes, seconds):
    """The :class:`Link` that fits ``seconds`` (of messages of ``sizes`` bytes) best, by least squares on the
    relative error (small and large messages weigh alike); neither figure below zero."""
    sizes, seconds = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    if sizes.size < 2 or not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError("a link is fitted from two or more positive times")
    weights = 1 / seconds
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    if per_byte <= 0:  # (sizes too close to tell: all latency)
        return Link(float(np.median(seconds)), 0.0)
    if latency < 0:  # (a negative latency is noise around zero: the bandwidth alone)
        return Link(0.0, float(np.median(seconds / sizes)))
    return Link(float(latency), float(per_byte))


def parse_link(text, flag="--link"):
    """``"25GB/s,2us"`` -> :class:`Link`: a bandwidth (B/s, with k, M, G or T) and a latency (s, ms, us or
    ns)."""
    match = re.fullmatch(
        r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*([kmgt]?)b/s\s*,\s*([0-9.]+(?:e-?[0-9]+)?)\s*(s|ms|us|ns)\s*",
        str(text).lower(),
    )
    if match is None:
        raise UsageError(
            f"{flag} {text!r}: give a bandwidth and a latency, e.g. 25GB/s,2us (bandwidth in B/s, "
            "kB/s, MB/s, GB/s or TB/s; latency in s, ms, us or ns)"
        )
    bandwidth = float(match[1]) * UNITS[match[2]]
    latency = float(match[3]) * TIMES[match[4]]
    if not (math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(latency) and latency >= 0):
        raise UsageError(f"{flag} {text!r}: the bandwidth must be above zero and the latency finite")
    return Link(latency, 1 / bandwidth)
