"""What ``plan`` reasons about: a layout of a run's ranks (:class:`Layout`) and what it predicts of one
(:class:`Prediction`), the records :mod:`mpidist.plan.step` costs and its callers compare."""

import dataclasses

from ..parallel.mesh import MeshShape

DEFAULT_BUCKET_MB = 64.0  # train's --bucket-mb


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run's ranks go: ``nodes`` x ``per_node`` ranks, and the strategy's own settings."""

    strategy: str
    nodes: int
    per_node: int
    batch: int  # the global batch
    ps: int = 0
    stages: int = 1
    micro_batches: int = 4
    schedule: str = "1f1b"
    tensor: int = 1
    exchange: str = "auto"  # allreduce: auto (one model per node on CPUs), mpi
    shard: str = "none"
    bucket_mb: float = DEFAULT_BUCKET_MB  # allreduce with MPI's exchange: its buckets

    @property
    def ranks(self):
        return self.nodes * self.per_node

    @property
    def replicas(self):
        """The data-parallel groups of the grid the ranks make (:class:`~mpidist.parallel.mesh.MeshShape`)."""
        return MeshShape(self.ranks, self.stages, self.tensor).size("replica")

    def describe(self):
        extra = {
            "ps-sync": f" --ps {self.ps}",
            "ps-async": f" --ps {self.ps}",
            "pipeline": f" --stages {self.stages} --micro-batches {self.micro_batches}",
        }.get(self.strategy, "")
        if self.tensor > 1:
            extra += f" --tensor {self.tensor}"
        if self.exchange != "auto":
            extra += f" --exchange {self.exchange}"
        if self.shard != "none":
            extra += f" --shard {self.shard}"
        if self.bucket_mb != DEFAULT_BUCKET_MB:
            extra += f" --bucket-mb {self.bucket_mb:g}"
        return self.strategy + extra

    @property
    def buckets(self):
        """Whether the step's gradients go through MPI's bucketed ``Iallreduce`` (whose buckets backward can
        hide): ``allreduce`` with MPI's exchange (chosen, or one rank a node), whole parameters, no shards."""
        return (
            self.strategy == "allreduce"
            and self.tensor == 1
            and self.shard == "none"
            and (self.exchange == "mpi" or self.per_node == 1)
        )


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Seconds per step in parts (``compute``, ``exchange``, ``optimizer``, ``bubble``, ``wait`` and ``loop``:
    what ``train`` does besides the strategy's step), the samples per second they give, the bytes every rank
    holds (``memory``: the chief no more than the others, since no layout assembles a split model on it)."""

    layout: Layout
    compute: float
    exchange: float
    optimizer: float
    bubble: float
    wait: float
    memory: int
    loop: float = 0.0
    together: float = 1.0  # the share of the step's compute during which the node's other ranks compute too

    @property
    def step(self):
        return self.compute + self.exchange + self.optimizer + self.bubble + self.wait + self.loop

    @property
    def samples_per_s(self):
        return self.layout.batch / self.step

    @property
    def node_memory(self):
        """Bytes of a node: its ranks'."""
        return self.memory * self.layout.per_node
