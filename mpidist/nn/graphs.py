"""A training pass on a GPU as one CUDA graph: one launch where the pass was a hundred kernels.

A small model's step on a GPU waits for the host: each of its kernels costs
the host more to launch than the device to run (the MLP ran at 0.54-0.77 of
torch's speed).  :class:`PassGraphs` runs a pass of a given
:class:`~mpidist.nn.capture.PassKey` the way :class:`~mpidist.nn.capture.Captures`
decides: eagerly, captured into a graph (then launched), or replayed.

What makes a replay compute what the pass would:

* **its memory stays its own.**  Everything the pass allocates, while it
  runs eagerly for the key the first time and while it is captured, comes
  from a memory pool of the key's own (``cupy.cuda.using_allocator``), which
  nothing else draws from: memory the graph reads and writes is never handed
  to another array, even once Python has let go of the array it was.  What
  the pass's objects held before the capture (an evaluation's cached row
  indices, a workspace array another key made) is pinned while the graph is
  kept (:mod:`mpidist.nn.pass_state`).  A pool is never dropped while
  arrays use it (cupy would free their memory): a graph that goes gives
  its pool's free blocks back to the device, and a finished run's pools
  are kept until their arrays are gone.
* **it reads and writes fixed places.**  The caller's ``record`` (made once
  per key, in its pool) holds the buffers the pass reads its inputs from
  and writes its results to; a replay computes into the same places.
  Anything the pass leaves in Python objects (a layer's cache) is as the
  capture left it: only the record's arrays are results.
* **what cannot be captured runs eagerly.**  A capture that fails (a pass
  that reads a value on the host, a library that refuses capture) is ended,
  the pass's objects are put back as they were before it (what it made was
  never computed), the pass runs eagerly in its place, and that key runs
  eagerly for good, from the default pool; :attr:`PassGraphs.refused` says
  why.

The device's part (:class:`CudaGraphs`) is a few calls; the tests give
:class:`PassGraphs` a stand-in for it that runs on the host.
"""

import contextlib

from .capture import KEEP, Captures
from .pass_state import PassState


#: the pools of finished runs whose arrays are still in use (a model outlives its run's graphs: its
#: workspace arrays came from them): cupy frees a pool's memory, arrays still using it or not, when the
#: pool goes, so each is kept until nothing uses it (:func:`_sweep`)
_RETIRED = []


class PassGraphs:
    """Passes of each key run eagerly, captured or replayed, on ``device``.

    Args:
        device: what captures and launches (:class:`CudaGraphs`, or a stand-in with its methods).
        objects: a function giving the objects a pass changes (its layers, its loss, the workspace): what a
            graph pins and a refused capture puts back (:class:`~mpidist.nn.pass_state.PassState`).
        keep: graphs kept at most (:data:`~mpidist.nn.capture.KEEP`).
    """

    def __init__(self, device, objects=tuple, keep=KEEP):
        self.device, self.objects, self.rule = device, objects, Captures(keep)
        self._pools, self._records, self._graphs = {}, {}, {}
        #: how many passes ran each way: ``{"eager": n, "capture": n, "replay": n}``
        self.ran = dict.fromkeys(("eager", "capture", "replay"), 0)
        #: keys whose capture failed, and why (they run eagerly, from the default pool)
        self.refused = {}

    def record(self, key, make):
        """The arrays a pass of ``key`` reads its inputs from and leaves its results in: ``make()``'s, made
        once, from the key's pool."""
        record = self._records.get(key)
        if record is None:
            with self.device.allocating(self._pool(key)):
                record = self._records[key] = make()
        return record

    def run(self, key, work):
        """Run ``work(record)``, a pass of ``key``, on the key's :meth:`record` (its inputs copied in first).

        ``work`` must read its inputs from the record and leave its results
        there: a replay runs no Python, it recomputes the record's arrays.
        """
        record = self._records[key]
        decision = self.rule.decide(key)
        self._let_go()
        self.ran[decision] += 1
        if decision == "replay":
            self.device.launch(self._graphs[key][0])
        elif decision == "capture":
            self._capture(key, record, work)
        elif key in self.refused:
            work(record)
        else:  # (its first pass: what it makes, the graph will use)
            with self.device.allocating(self._pool(key)):
                work(record)

    def _pool(self, key):
        """The key's own memory pool (made on first use, kept)."""
        pool = self._pools.get(key)
        if pool is None:
            _sweep()
            pool = self._pools[key] = self.device.pool()
        return pool

    def _capture(self, key, record, work):
        """Capture ``work`` into the key's graph and launch it; eagerly, for good, if the capture fails."""
        before = PassState(self.objects())
        try:
            graph = self.device.capture(lambda: work(record), self._pool(key))
        except Exception as error:  # (any failure: the eager pass below raises what is the pass's own)
            before.restore()  # (what the capture made was never computed: the eager pass makes it anew)
            self.rule.failed(key)
            self.refused[key] = f"{type(error).__name__}: {error}"
            self.ran["capture"] -= 1
            self.ran["eager"] += 1
            work(record)
            return
        # what the graph reads and writes stays allocated while it is kept: what the objects held before the
        # capture (made by other passes, in other pools) and after it
        self._graphs[key] = (graph, before.pinned() + PassState(self.objects()).pinned())
        self.device.launch(graph)

    def _let_go(self):
        """Drop the graphs the rule let go of (their pools' free blocks go back to the device)."""
        kept = set(self.rule.held)
        for key in [key for key in self._graphs if key not in kept]:
            del self._graphs[key]
            self.device.release(self._pools[key])

    def free(self):
        """Drop every graph and record (the run is over); the pools give their free blocks back to the device
        and go once nothing uses them."""
        self.rule.forget()
        self._graphs.clear()
        self._records.clear()
        _RETIRED.extend((self.device, pool) for pool in self._pools.values())
        self._pools.clear()
        _sweep()

    @property
    def held(self):
        """How many graphs are kept now."""
        return len(self._graphs)

    def summary(self):
        """``"eager n, capture n, replay n"`` and a refused capture's reason, for a run's report."""
        counts = ", ".join(f"{how} {count}" for how, count in self.ran.items())
        if not self.refused:
            return counts
        return f"{counts}; eager for good: {next(iter(self.refused.values()))}"


def _sweep():
    """Give the retired pools' free blocks back to the device; let go of those nothing uses any more."""
    kept = []
    for owner, pool in _RETIRED:
        owner.release(pool)
        if owner.used(pool):
            kept.append((owner, pool))
    _RETIRED[:] = kept


class CudaGraphs:
    """Captures on a stream of its own, launches on the current one (cupy's graphs).

    The capture stream does not wait for the default stream (``non_blocking``):
    a capture runs nothing, and each launch is queued on the stream the rest
    of the step uses, so it follows what came before and precedes what reads
    its results.
    """

    def __init__(self, cupy):
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def pool(self):
        return self.cupy.cuda.MemoryPool()

    def allocating(self, pool):
        return self.cupy.cuda.using_allocator(pool.malloc)

    def release(self, pool):
        """``pool``'s free blocks back to the device (its blocks in use stay: arrays still hold them)."""
        pool.free_all_blocks()

    def used(self, pool):
        """Whether arrays still use memory of ``pool``."""
        return pool.used_bytes() > 0

    def capture(self, work, pool):
        """``work``'s kernels as a graph (raises where they cannot be captured, the capture ended)."""
        stream = self.stream
        with self.allocating(pool), stream:
            stream.begin_capture()
            try:
                work()
            except BaseException:
                with contextlib.suppress(Exception):  # (ends the capture: the stream is usable again)
                    stream.end_capture()
                raise
            return stream.end_capture()

    def launch(self, graph):
        graph.launch(stream=self.cupy.cuda.get_current_stream())
