"""How bytes between ranks travel when arrays live on GPUs: the routes, the facts that decide, the choice.

Each route is chosen once at start-up from facts about the job, by a pure
function (:func:`choose`) that the tests check by a table on any machine:

* ``mpi``: host (numpy) arrays, handed to MPI as they are (MPI's shared
  memory within a node, its network between nodes);
* ``ipc``: two ranks of one node (or one GPU) map each other's device
  buffers by CUDA IPC handles; MPI carries only the handles and the order;
* ``nccl``: NCCL's collectives (``cupy.cuda.nccl``, bootstrapped over MPI):
  a sum over several GPUs;
* ``cuda-aware``: MPI reads and writes device memory itself
  (``MPIX_Query_cuda_support``);
* ``host-staged``: a device array is copied to pinned host memory, moved by
  MPI, copied back (always possible, the slowest).

Measured on an H200 (``gpu/check.sh``), 64 MiB: a device copy 474-543 GB/s,
a host-staged send 3.3-6 GB/s: a faster route is taken wherever one exists.
"""

import dataclasses

from .xp import turned_off

#: the routes, fastest first where several could serve
ROUTES = ("mpi", "ipc", "nccl", "cuda-aware", "host-staged")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What decides a route.

    Attributes:
        device: the arrays live on GPUs (cupy); False: host arrays.
        same_node: every rank the bytes go between is on one node (a send's two ends; a sum's group).
        ipc: CUDA IPC handles can be opened between these processes.
        nccl: NCCL is there (``cupy.cuda.nccl`` with its library).
        cuda_aware: MPI reads and writes device memory.
    """

    device: bool = False
    same_node: bool = False
    ipc: bool = False
    nccl: bool = False
    cuda_aware: bool = False

    @classmethod
    def between(cls, one, other):
        """The facts of a transfer between two ranks of :class:`RankFacts` ``one`` and ``other`` (NCCL's
        point-to-point sends are not built: a send goes by IPC, a CUDA-aware MPI or the host)."""
        return cls(
            device=one.device and other.device,
            same_node=one.node == other.node,
            ipc=one.ipc and other.ipc,
            cuda_aware=one.cuda_aware and other.cuda_aware,
        )


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """What one rank tells the others a route between them depends on.

    Attributes:
        node: a name of its node, the same for every rank of it.
        device: its arrays live on a GPU.
        ipc: CUDA IPC handles can be made and opened here.
        cuda_aware: its MPI reads and writes device memory.
    """

    node: int = 0
    device: bool = False
    ipc: bool = False
    cuda_aware: bool = False

    @classmethod
    def of(cls, node, device, ipc=False, cuda_aware=False):
        """This rank's facts; IPC where ``ipc`` says so or the device supports it
        (``MPIDIST_IPC=0`` turns it off, for a container that forbids it)."""
        possible = device and (ipc or _ipc_possible())
        return cls(int(node), bool(device), bool(possible), bool(device and cuda_aware))


def choose(kind, facts):
    """``(route, why)`` for ``kind`` of transfer: ``"send"`` (a pipeline's activations and gradients between
    two ranks) or ``"sum"`` (a gradient allreduce over a group).

    >>> choose("send", Facts(device=True, same_node=True, ipc=True))[0]
    'ipc'
    >>> choose("sum", Facts(device=True))[0]
    'host-staged'
    """
    if kind not in ("send", "sum"):
        raise ValueError(f"a route is chosen for a send or a sum, not {kind!r}")
    if not facts.device:
        return "mpi", "host arrays: MPI moves them as they are"
    local = facts.same_node and facts.ipc
    if kind == "send":
        if local:
            return "ipc", "both ends on one node: device to device by CUDA IPC handles"
        if facts.cuda_aware:
            return "cuda-aware", "MPI reads device memory"
        if facts.nccl:
            return "nccl", "NCCL's send and receive (MPI is not CUDA-aware)"
    else:
        if facts.nccl:
            return "nccl", "NCCL's allreduce over the group's GPUs"
        if local:
            return "ipc", "every rank on one node: each sums its part from the others' mapped buffers"
        if facts.cuda_aware:
            return "cuda-aware", "MPI sums device memory"
    return "host-staged", _why_staged(facts)


def _why_staged(facts):
    """Why nothing faster than staging through the host serves: every missing fact, in words."""
    missing = []
    if not (facts.same_node and facts.ipc):
        missing.append("no CUDA IPC between these ranks" if facts.same_node else "ranks on several nodes")
    if not facts.cuda_aware:
        missing.append("MPI is not CUDA-aware")
    if not facts.nccl:
        missing.append("no NCCL")
    return "; ".join(missing)


def probe(same_node, cuda_aware):
    """The :class:`Facts` of this process (a GPU's found through cupy; ``same_node`` and ``cuda_aware`` as the
    caller knows them)."""
    try:
        import cupy

        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # (no cupy, no driver, no GPU: host arrays)
        return Facts(same_node=same_node, cuda_aware=cuda_aware)
    return Facts(
        device=devices > 0,
        same_node=same_node,
        ipc=_ipc_possible(),
        nccl=_nccl(),
        cuda_aware=cuda_aware,
    )


def _ipc_possible():
    """Whether this process can export device memory to another (``MPIDIST_IPC=0``: no)."""
    if turned_off("MPIDIST_IPC"):
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and hasattr(cupy.cuda.runtime, "ipcGetMemHandle")
    except Exception:  # (no cupy, no driver, no GPU)
        return False


def _nccl():
    """Whether NCCL can be loaded through cupy."""
    try:
        from cupy.cuda import nccl

        return nccl.get_version() > 0
    except Exception:
        return False


def described(facts):
    """The routes ``facts`` give, in one line (``info``'s)."""
    if not facts.device:
        return "no GPU: host arrays go through MPI as they are"
    parts = []
    for kind in ("send", "sum"):
        route, why = choose(kind, facts)
        parts.append(f"{kind}: {route} ({why})")
    return "; ".join(parts)
