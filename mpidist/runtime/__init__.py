"""The process and MPI: the bottom layer, which every other imports from.

Cluster roles and communicators (:mod:`~mpidist.runtime.cluster`), the only
modules that hand arrays to MPI (:mod:`~mpidist.runtime.comm`,
:mod:`~mpidist.runtime.rma`), the buffer a device array reaches MPI as
(:mod:`~mpidist.runtime.device_buffers`), numpy/cupy (:mod:`~mpidist.runtime.xp`), BLAS
threads, memory limits, exit codes and errors, job-wide agreement and abort,
stop signals, the main thread's whereabouts and its event recorder, and
ULFM's building blocks.  Nothing here knows about models, data or strategies.
"""
