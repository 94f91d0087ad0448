"""Parameter servers: ``--ps K`` ranks own the shards of the model; workers send them gradients.

* what every ps strategy shares: its shards, initial state and checkpoints
  (:mod:`~mpidist.parallel.ps.sharded`);
* ``ps-sync`` (:mod:`~mpidist.parallel.ps.sync`): a reduce-scatter to the
  shards' owners and an allgather back, every step; with ``--aggregate R``
  backup workers (:mod:`~mpidist.parallel.ps.backup`, the rules of their
  rounds in :mod:`~mpidist.parallel.ps.backup_rounds`);
* ``ps-async`` (:mod:`~mpidist.parallel.ps.asynchronous`): one-sided updates
  into the servers' windows (:mod:`~mpidist.parallel.ps.async_exchange`), a
  server's loop (:mod:`~mpidist.parallel.ps.async_server`), the staleness
  bound and serving rules without MPI (:mod:`~mpidist.parallel.ps.async_rounds`),
  and lost ranks under ``--elastic`` (:mod:`~mpidist.parallel.ps.lost_ranks`).

Imports the core (the top-level modules of :mod:`mpidist.parallel` but its
roll-call, ``__init__``, and ``holding``) and no other family.
"""
