"""The cluster: which Ray nodes exist, and what each one offers."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import ray

from rlcomm.errors import RlcommError
from rlcomm.placement import NodeSpec

logger = logging.getLogger(__name__)

#: Namespace of every named actor rlcomm creates (worker ranks, registry, channels).
RLCOMM_NAMESPACE = "rlcomm"


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node.

    Attributes:
        node_rank: its index in the cluster (the head node is 0, the rest in Ray's order).
        node_id: Ray's hex node id.
        ip: the node's address.
        num_cpus: CPUs Ray reports for it.
        num_gpus: CUDA GPUs Ray reports for it.
        num_cpu_slots: CPU workers it hosts when placement counts CPU slots.
    """

    node_rank: int
    node_id: str
    ip: str
    num_cpus: int
    num_gpus: int
    num_cpu_slots: int

    def spec(self) -> NodeSpec:
        return NodeSpec(self.node_rank, self.num_gpus, self.num_cpu_slots)


class Cluster:
    """A handle on a Ray cluster, attached to or started on construction.

    Attaches to the Ray of this process (``ray.is_initialized()``), else to ``RAY_ADDRESS``,
    else starts a local Ray (no dashboard). Then waits, at most ``timeout`` seconds, until
    ``num_nodes`` nodes are alive.

    Args:
        num_nodes: nodes to wait for; ``None`` takes whatever is alive.
        timeout: seconds to wait for ``num_nodes`` nodes.
        cpu_slots_per_node: CPU workers a node hosts under hardware-rank placement when the
            cluster has no accelerators; default ``max(16, 4 * cpus)`` (workers take no CPU
            reservation, so a 2-core node runs many).
        ray_init_kwargs: extra arguments for ``ray.init`` when a Ray is started or attached.

    Raises:
        RlcommError: if the nodes are not all alive in time.
    """

    def __init__(
        self,
        num_nodes: int | None = None,
        timeout: float = 60.0,
        cpu_slots_per_node: int | None = None,
        ray_init_kwargs: dict | None = None,
    ):
        if num_nodes is not None and num_nodes < 1:
            raise ValueError(f"Cluster: num_nodes must be >= 1, got {num_nodes}")
        if not ray.is_initialized():
            kwargs = {"include_dashboard": False, "logging_level": logging.WARNING}
            kwargs.update(ray_init_kwargs or {})
            if os.environ.get("RAY_ADDRESS"):
                kwargs.setdefault("address", os.environ["RAY_ADDRESS"])
            ray.init(**kwargs)
        self._cpu_slots_per_node = cpu_slots_per_node
        deadline = time.monotonic() + timeout
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if num_nodes is None or len(alive) >= num_nodes:
                break
            if time.monotonic() > deadline:
                raise RlcommError(
                    f"Cluster: waited {timeout:.0f}s for {num_nodes} nodes, only {len(alive)} "
                    "alive; start more with `ray start --address=...` or lower num_nodes"
                )
            time.sleep(0.2)
        self.nodes: list[NodeInfo] = self._read_nodes(alive)

    def _read_nodes(self, alive: list[dict]) -> list[NodeInfo]:
        head_first = sorted(
            alive, key=lambda n: 0 if "node:__internal_head__" in n.get("Resources", {}) else 1
        )
        nodes = []
        for rank, raw in enumerate(head_first):
            res = raw.get("Resources", {})
            cpus = int(res.get("CPU", 0))
            slots = self._cpu_slots_per_node or max(16, 4 * cpus)
            nodes.append(
                NodeInfo(
                    node_rank=rank,
                    node_id=raw["NodeID"],
                    ip=raw["NodeManagerAddress"],
                    num_cpus=cpus,
                    num_gpus=int(res.get("GPU", 0)),
                    num_cpu_slots=slots,
                )
            )
        return nodes

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_gpus(self) -> int:
        """CUDA GPUs across all nodes."""
        return sum(n.num_gpus for n in self.nodes)

    def node_specs(self) -> list[NodeSpec]:
        return [n.spec() for n in self.nodes]

    def node(self, node_rank: int) -> NodeInfo:
        if not 0 <= node_rank < len(self.nodes):
            raise ValueError(f"node rank {node_rank} out of range 0..{len(self.nodes) - 1}")
        return self.nodes[node_rank]

    def node_rank_of(self, node_id: str) -> int:
        for n in self.nodes:
            if n.node_id == node_id:
                return n.node_rank
        raise ValueError(f"node id {node_id} is not part of this cluster")

    def __repr__(self) -> str:
        return f"Cluster(num_nodes={self.num_nodes}, num_gpus={self.num_gpus})"
