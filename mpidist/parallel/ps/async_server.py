"""The ps side of ``ps-async``: a ps rank's serving loop over its windows (see
:mod:`mpidist.parallel.ps.asynchronous`).

Each time round, the pure rules of :mod:`~mpidist.parallel.ps.async_rounds`
decide what to do from what the windows say; this loop carries it out: take
the inbox and apply it, pass a stop request on, write a checkpoint's shards,
leave.
"""

import time

import numpy as np

from ...runtime import recorder
from ..base import finite
from .async_rounds import (
    Act,
    POLL_SECONDS,
    carries_gradient,
    follower_action,
    inbox_action,
    next_pause,
    watches_checkpoints,
)

TRACER = recorder.tracer()


class AsyncServer:
    """A ps rank of a :class:`~mpidist.parallel.ps.asynchronous.PsAsyncStrategy` serving until the run ends.

    Args:
        strategy: the ps rank's strategy (its windows, shard, optimizer, figures).
    """

    def __init__(self, strategy):
        self.strategy = strategy

    def serve(self, control=None):
        """ps loop: apply what arrives until every worker has finished and the inbox is empty.

        Each time round, :mod:`~mpidist.parallel.ps.async_rounds` decides what to do
        from what the windows say.  ``control`` (see
        :class:`mpidist.loop.training.ServerControl`): a signal this ps received is
        passed on to the workers as a stop request; the first ps also decides
        when a mid-run checkpoint is due (by the chief's step clock or the
        time), and every ps then sends it its shard, between two of its own
        updates.  The shards are each consistent, not mutually simultaneous:
        as in any asynchronous parameter server, they may be a few updates
        apart.  The first ps alone decides when serving is over, so no ps
        leaves while a checkpoint could still ask for its shard.
        """
        strategy = self.strategy
        rank, workers, exchange, serving = (
            strategy.cluster.rank,
            strategy.cluster.num_workers,
            strategy.exchange,
            strategy.serving,
        )
        strategy.track("serve")
        first = rank == strategy.ps_ranks[0]
        arrived = np.zeros_like(strategy.shard_values)
        pause = POLL_SECONDS
        drained = False
        while True:
            strategy.look_for_the_lost()
            if control is not None:
                if control.signalled():
                    strategy.request_stop(control.signalled())
                if watches_checkpoints(first, control.periodic, drained):
                    step = serving.run_step(int(exchange.clocks()[0]))
                    if step is not None and control.checkpoint_due(step):
                        exchange.set_control(serving.snapshots + 1, False)
                        self._snapshot(control, step)
            if not first:
                asked, over = exchange.control()
                act = follower_action(asked, serving.snapshots, drained, over)
                if act is Act.SNAPSHOT:
                    self._snapshot(control, None)
                    continue
                if act is Act.LEAVE:
                    return
            # Poll the 8-byte arrival count, not the inbox: taking a 2.7 MB inbox every
            # 0.2 ms while idle would flood the memory bus the workers compute on.
            # Workers flush a gradient before counting it, so a count means the data is in.
            pending = exchange.pending(rank)
            done = exchange.workers_done() if not pending and not drained else None
            act = inbox_action(pending, drained, done, workers)
            if act is Act.IDLE:  # (measured: polling took 71% system time on this VM's shared cores)
                time.sleep(pause)
                pause = next_pause(pause)
                continue
            if act is Act.TAKE:
                pause = POLL_SECONDS
            self._take_and_apply(arrived, rank)
            if act is Act.DRAIN:
                drained = True
                if first:
                    exchange.set_control(serving.snapshots, True)
                    return

    def _snapshot(self, control, step):
        """Collective over the ps ranks: the first one gathers the shards and writes them (at ``step``)."""
        strategy = self.strategy
        strategy.serving.snapshots += 1
        state = strategy.gather_on_first_ps(strategy.shard_values)
        if state is not None:
            control.write(step, state)

    def _take_and_apply(self, arrived, rank):
        """This ps's inbox into ``arrived``, applied at the learning rate of its gradients' mean step."""
        strategy = self.strategy
        arrivals, steps = strategy.exchange.take(arrived, rank)
        strategy.figures["gradients"] += arrivals
        strategy.serving.took(arrivals, steps)
        if not carries_gradient(arrived):
            return
        # (--trace: the serve phase, update by update)
        with TRACER.span("update", "serve", tid=recorder.STEPS):
            if strategy.nan_guard.update_allowed(
                finite(arrived), f"gradients arriving at ps rank {rank} were"
            ):
                strategy.optimizer.step(
                    strategy.shard_values, arrived, strategy.recipe.lr(strategy.serving.learning_step)
                )
                strategy.exchange.publish(strategy.shard_values, rank)
                strategy.figures["updates"] += 1
