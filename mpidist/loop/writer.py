"""A checkpoint file written by a thread of its own, while training goes on, and how often one may be."""

import threading
import time

#: the share of the chief's time (one core's) writing behind training may take, its copy included: after a
#: write that cost C seconds of CPU the writer rests until C / WRITER_SHARE seconds after the write began, so
#: ``--checkpoint-every 1`` writes as often as that allows (without: 25% of the samples/s of mlp-wide on 2
#: ranks of a 2-core machine, each checkpoint costing 2.6 ms of CPU against 7 ms steps)
WRITER_SHARE = 0.025


class BehindWrite:
    """One checkpoint file (a whole checkpoint, a sharded one's part or index) written by a thread of its own;
    :meth:`result` is what ``work`` returned, or raises what it raised.

    Args:
        work: writes the file, returns its path (or its record).
        where: ``(step, epoch)`` of the checkpoint.
        spent: CPU seconds the training thread spent on it already (the copy).
    """

    def __init__(self, work, where, spent=0.0):
        self.step, self.where = where[0], where
        self.began, self.spent = time.monotonic(), spent
        self._path, self._error = None, None
        # (a daemon: a job that aborts does not wait for it; its file stays aside, for the next run to remove)
        self._thread = threading.Thread(
            target=self._run, args=(work,), daemon=True, name="mpidist-checkpoint"
        )
        self._thread.start()

    def _run(self, work):
        began = time.thread_time()
        try:
            self._path = work()
        except BaseException as err:  # (raised again in the training thread, by result())
            self._error = err
        finally:
            self.spent += time.thread_time() - began

    def free_at(self):
        """When (monotonic) the writer is free again after this write: its cost spread at
        :data:`WRITER_SHARE`."""
        return self.began + self.spent / WRITER_SHARE

    def is_alive(self):
        return self._thread.is_alive()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._path
