"""``python -m mpidist info``: what this job runs on, as the chief sees it."""

import platform
import sys

import h5py
import mpi4py
import numpy as np
from mpi4py import MPI

from .. import __version__, data
from ..nn import MODELS, cudnn_conv
from ..runtime import device_buffers, routes
from ..runtime.cluster import node_layout
from ..runtime.memory import default_budget, human, ranks_per_node
from ..runtime.ulfm import ulfm_support
from ..runtime.xp import turned_off

THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


def _gpus():
    try:
        import cupy

        return f"cupy {cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} GPU(s) visible"
    except Exception as err:  # missing cupy or driver: say why, never fail
        return f"none ({type(err).__name__}: {err})".splitlines()[0][:100]


def _gpu_kernels():
    """Which paths a GPU step takes here: cuDNN's convolutions, CUDA graphs of a pass, NCCL's sums."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no GPU"
    except Exception:  # (missing cupy or driver: _gpus says which)
        return "no GPU"
    why_not = cudnn_conv.refused(np.float32)
    graphs_off = turned_off("MPIDIST_GRAPHS")
    try:
        from cupy.cuda import nccl

        missing = "MPI (no NCCL: pip install nvidia-nccl-cu13)"
        sums = f"NCCL {nccl.get_version()}" if nccl.available else missing
    except Exception as err:  # (a library that does not load: say so)
        sums = f"MPI (no NCCL: {type(err).__name__})"
    return (
        f"convolutions {'cuDNN' if why_not is None else 'im2col: ' + why_not}; "
        f"passes {'eager (MPIDIST_GRAPHS=0)' if graphs_off else 'CUDA graphs'}; allreduce sums by {sums}"
    )


def report(world, models_only=False):
    """Collective: the text rank 0 prints (None on other ranks)."""
    if models_only:
        if world.Get_rank() != 0:
            return None
        width = max(map(len, MODELS)) + 1
        return "\n".join(f"{name:<{width}} {text}" for name, (_, text) in MODELS.items())
    # nodes as MPI sees them (the ranks that share memory): host names alone may not tell them apart
    node, index, _, _ = node_layout(world)
    hosts = world.gather((index, MPI.Get_processor_name()), root=0)
    node.Free()
    if world.Get_rank() != 0:
        return None
    per_node = {}
    for index, host in hosts:
        per_node.setdefault(index, [host, 0])[1] += 1
    # (the library's own padding, "MPICH Version:      5.0.2", folded to one space)
    version = " ".join(MPI.Get_library_version().replace("\x00", "").split("\n", 1)[0].split())
    elastic, why_not = ulfm_support()
    rows = [
        ("mpidist", __version__),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("mpi4py", mpi4py.__version__),
        ("MPI library", f"{version} ({device_buffers.mpi_library_path() or 'path unknown'})"),
        ("MPI standard", "{}.{}".format(*MPI.Get_version())),
        ("thread level", THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread()))),
        (
            "CUDA-aware MPI",
            f"{'yes' if device_buffers.cuda_aware() else 'no'}; GPU arrays travel "
            f"{device_buffers.transfer_path()} (override: MPIDIST_CUDA_AWARE=0|1)",
        ),
        ("--elastic", "yes: this MPI reports dead processes (ULFM)" if elastic else f"no: {why_not}"),
        (
            "ranks",
            f"{world.Get_size()} on {len(per_node)} node(s): "
            + ", ".join(f"node {i} ({host}) x{n}" for i, (host, n) in sorted(per_node.items())),
        ),
        ("numpy / h5py", f"{np.__version__} / {h5py.__version__} (HDF5 {h5py.version.hdf5_version})"),
        ("GPUs", _gpus()),
        ("GPU routes", routes.described(routes.probe(len(per_node) == 1, device_buffers.cuda_aware()))),
        ("GPU kernels", _gpu_kernels()),
        ("models", ", ".join(MODELS)),
        ("bundled datasets", ", ".join(data.bundled_names()) or "none found"),
        (
            "data budget",
            f"{human(default_budget())} per rank (--memory-budget auto: half the node's free memory "
            f"over {ranks_per_node()} rank(s) per node); a rank whose shards need more streams them",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
