"""Data parallelism: every worker computes gradients of the model (or of its part) on its own samples.

* the replicated step (:mod:`~mpidist.parallel.data.replicated`, its state in
  :mod:`~mpidist.parallel.data.replica_state`) that ``local``
  (:mod:`~mpidist.parallel.data.local`), ``allreduce``
  (:mod:`~mpidist.parallel.data.allreduce`, declared in
  :mod:`~mpidist.parallel.data.declared`) and ``local-sgd``
  (:mod:`~mpidist.parallel.data.local_sgd`) share, a 16-bit model's float32
  master (:mod:`~mpidist.parallel.data.mixed`), in-graph replication's
  scattered batches (:mod:`~mpidist.parallel.data.scatter`), a GPU's pass
  replayed as a CUDA graph (:mod:`~mpidist.parallel.data.graphed_passes`);
* the exchanges that sum the gradients: buckets over MPI
  (:mod:`~mpidist.parallel.data.exchange`) or NCCL on GPUs
  (:mod:`~mpidist.parallel.data.nccl_exchange`), 16-bit with error feedback
  (:mod:`~mpidist.parallel.data.compression`), a node's shared window
  (:mod:`~mpidist.parallel.data.shared_memory`), one copy of the model per
  node (:mod:`~mpidist.parallel.data.node_model`) with a ring between nodes
  (:mod:`~mpidist.parallel.data.ring`);
* sharded state: ``--shard optimizer``
  (:mod:`~mpidist.parallel.data.optimizer_shard`) and ``--shard parameters``
  (:mod:`~mpidist.parallel.data.fully_sharded`, its units
  :mod:`~mpidist.parallel.data.units`, their gathers
  :mod:`~mpidist.parallel.data.gathering` and the routes those take, into
  each rank's slots or once per node :mod:`~mpidist.parallel.data.unit_routes`).

Imports the core (the top-level modules of :mod:`mpidist.parallel` but its
roll-call, ``__init__``, and ``holding``) and no other family; it reaches a
tensor part through :func:`~mpidist.parallel.parts.split_over`.
"""
