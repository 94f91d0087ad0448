"""mpidist: train neural networks on many processes with MPI.

Parameter-server, allreduce and pipeline strategies on mpi4py, numpy/cupy and
h5py; launched with ``mpiexec -n N python -m mpidist``.
"""

__version__ = "0.1.0"
