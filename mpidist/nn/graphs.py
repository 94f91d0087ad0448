"""A training pass on a GPU as one CUDA graph: one launch where the pass was a hundred kernels.

A small model's step on a GPU waits for the host: each of its kernels costs
the host more to launch than the device to run (the MLP ran at 0.54-0.77 of
torch's speed).  :class:`PassGraphs` runs a pass of a given
:class:`~mpidist.nn.capture.PassKey` the way :class:`~mpidist.nn.capture.Captures`
decides: eagerly, captured into a graph (then launched), or replayed.

What makes a replay compute what the pass would:

* **its arrays stay its own.**  Everything the pass allocates, while it runs
  eagerly for the key and while it is captured, comes from a memory pool of
  the key's own (``cupy.cuda.using_allocator``), which nothing else draws
  from: memory the graph reads and writes is never handed to another array,
  even once Python has let go of the array it was.  The pool goes with the
  graph.
* **it reads and writes fixed places.**  The caller's ``record`` (made once
  per key, in its pool) holds the buffers the pass reads its inputs from
  and writes its results to; a replay computes into the same places.
  Anything the pass leaves in Python objects (a layer's cache) is as the
  capture left it: only the record's arrays are results.
* **what cannot be captured runs eagerly.**  A capture that fails (a pass
  that reads a value on the host, a library that refuses capture) is ended,
  the pass runs eagerly in its place, and that key runs eagerly for good;
  :attr:`PassGraphs.refused` says why.

The device's part (:class:`CudaGraphs`) is three calls; the tests give
:class:`PassGraphs` a stand-in for it that runs on the host.
"""

import contextlib

from .capture import KEEP, Captures


class PassGraphs:
    """Passes of each key run eagerly, captured or replayed, on ``device``.

    Args:
        device: what captures and launches (:class:`CudaGraphs`, or a stand-in with its methods).
        keep: graphs kept at most (:data:`~mpidist.nn.capture.KEEP`).
    """

    def __init__(self, device, keep=KEEP):
        self.device, self.rule = device, Captures(keep)
        self._pools, self._records, self._graphs = {}, {}, {}
        #: how many passes ran each way: ``{"eager": n, "capture": n, "replay": n}``
        self.ran = dict.fromkeys(("eager", "capture", "replay"), 0)
        #: keys whose capture failed, and why (they run eagerly)
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
            self.device.launch(self._graphs[key])
        elif decision == "capture":
            self._capture(key, record, work)
        else:
            with self.device.allocating(self._pool(key)):
                work(record)

    def _pool(self, key):
        """The key's own memory pool (made on first use)."""
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = self.device.pool()
        return pool

    def _capture(self, key, record, work):
        """Capture ``work`` into the key's graph and launch it; eagerly, for good, if the capture fails."""
        pool = self._pool(key)
        try:
            graph = self.device.capture(lambda: work(record), pool)
        except Exception as error:  # (any failure: the eager pass below raises what is the pass's own)
            self.rule.failed(key)
            self.refused[key] = f"{type(error).__name__}: {error}"
            self.ran["capture"] -= 1
            self.ran["eager"] += 1
            with self.device.allocating(pool):
                work(record)
            return
        self._graphs[key] = graph
        self.device.launch(graph)

    def _let_go(self):
        """Drop the graphs the rule let go of, with their pools and records."""
        kept = set(self.rule.held)
        for key in [key for key in self._graphs if key not in kept]:
            del self._graphs[key]
            self._pools.pop(key, None)
            self._records.pop(key, None)

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
