"""Pipeline parallelism: a model's layers in stages on consecutive ranks, micro-batches flowing through them.

* what ``pipeline`` is (:mod:`~mpidist.parallel.pipeline.declared`) and does
  (:mod:`~mpidist.parallel.pipeline.strategy`);
* which layers each stage holds (:mod:`~mpidist.parallel.pipeline.balance`)
  and a stage's place and links (:mod:`~mpidist.parallel.pipeline.stage`);
* schedules as pure functions (:mod:`~mpidist.parallel.pipeline.schedule`),
  the runner that executes one (:mod:`~mpidist.parallel.pipeline.schedule_runner`)
  and the workspace slots of the micro-batches in flight
  (:mod:`~mpidist.parallel.pipeline.slots`);
* the survivors of a lost rank (:mod:`~mpidist.parallel.pipeline.recovery`).

Imports the core (the top-level modules of :mod:`mpidist.parallel` but its
roll-call, ``__init__``, and ``holding``) and no other family; a stage split
over a tensor group reaches its part through :func:`~mpidist.parallel.parts.split_over`.
"""
