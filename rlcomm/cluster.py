"""The cluster: which Ray nodes exist, and what each one offers."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

import ray

from rlcomm.errors import RlcommError
from rlcomm.placement import NodeSpec
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Namespace of every named actor rlcomm creates (worker ranks, registry, channels).
RLCOMM_NAMESPACE = "rlcomm"


_LOCAL_ADDRESSES = ("auto", "local")
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _drop_auth_enabled_notice(record: logging.LogRecord) -> bool:
    """Ray warns, on each local start, that it turned token authentication on (its
    default, which rlcomm keeps). While rlcomm starts Ray, that one notice is dropped;
    the warning that authentication is off is not."""
    return not record.getMessage().startswith("Token authentication is enabled")


def _probe(address: str, deadline: float) -> str | None:
    """None once ``address`` (``host:port`` or ``ray://host:port``) takes TCP
    connections, else what went wrong when ``deadline`` passed."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return f"{address!r} is not of the form host:port"
    problem = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), max(0.1, min(2.0, left))):
                return None
        except OSError as exc:
            problem = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() + 0.5 > deadline:
            return problem
        time.sleep(0.5)


def connect_ray(address: str | None, timeout: float, ray_init_kwargs: dict | None = None,
                start_local: bool = True) -> None:
    """Attach this process to the Ray at ``address``, or start a local Ray when
    ``address`` is None and ``start_local``; waits at most about ``timeout`` seconds.

    The wait is bounded by probing ``address`` over TCP before ``ray.init``: Ray's own
    connect retries for minutes. Something that answers there but is no Ray head node
    can still hold ``ray.init`` up. Ray's notice that token authentication is on (its
    default) is not shown.

    Raises:
        RlcommError: nothing answers at ``address`` in time (the message names it and
            says what to do), or no address is given and ``start_local`` is False.
    """
    what_to_do = (
        "start Ray there (`ray start --head`), fix RAY_ADDRESS, or unset it to start a "
        "local Ray"
    )
    if address is None and not start_local:
        raise RlcommError(
            "no Ray is attached to this process and RAY_ADDRESS is not set; create a "
            "Cluster() first, or set RAY_ADDRESS to the head node's address (host:6379)"
        )
    deadline = time.monotonic() + timeout
    if address is not None and address not in _LOCAL_ADDRESSES:
        problem = _probe(address, deadline)
        if problem is not None:
            raise RlcommError(
                f"could not reach Ray at {address!r} (from RAY_ADDRESS or "
                f"ray_init_kwargs) within {timeout:g}s: {problem}; {what_to_do}"
            )
    kwargs: dict = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address is not None:
        kwargs["address"] = address
        if address != "local":  # "local" starts a new Ray, as None may
            kwargs.pop("include_dashboard")
    kwargs.update(ray_init_kwargs or {})
    notice = logging.getLogger(_RAY_AUTH_LOGGER)
    notice.addFilter(_drop_auth_enabled_notice)
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RlcommError(
            f"could not attach to Ray at {address or 'a new local Ray'!r}: "
            f"{type(exc).__name__}: {exc}; {what_to_do}"
        ) from exc
    finally:
        notice.removeFilter(_drop_auth_enabled_notice)


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

    Attaches to the Ray of this process (``ray.is_initialized()``), else to ``RAY_ADDRESS``
    (or ``ray_init_kwargs["address"]``), else starts a local Ray (no dashboard). Without
    an address Ray itself first looks for a cluster started by ``ray start`` on this
    machine and attaches to it; ``RAY_ADDRESS=local`` always starts a new one. Attaching
    is bounded by ``timeout`` and the ``connect_timeout`` setting (30 s): an address where
    nothing answers raises :class:`RlcommError` naming it. Then waits, at most ``timeout``
    seconds in all, until ``num_nodes`` nodes are alive.

    Args:
        num_nodes: nodes to wait for; ``None`` takes whatever is alive.
        timeout: seconds to wait for ``num_nodes`` nodes.
        cpu_slots_per_node: CPU workers a node hosts under hardware-rank placement when the
            cluster has no accelerators; default ``max(16, 4 * cpus)`` (workers take no CPU
            reservation, so a 2-core node runs many).
        ray_init_kwargs: extra arguments for ``ray.init`` when a Ray is started or attached.

    Raises:
        RlcommError: Ray could not be reached, or the nodes are not all alive in time.
    """

    def __init__(
        self,
        num_nodes: int | None = None,
        timeout: float = 60.0,
        cpu_slots_per_node: int | None = None,
        ray_init_kwargs: dict | None = None,
    ):
        if isinstance(num_nodes, bool) or not (num_nodes is None or isinstance(num_nodes, int)):
            raise TypeError(f"Cluster: num_nodes must be an int or None, got {num_nodes!r}")
        if num_nodes is not None and num_nodes < 1:
            raise ValueError(f"Cluster: num_nodes must be >= 1, got {num_nodes}")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"Cluster: timeout must be a number of seconds > 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        if not ray.is_initialized():
            kwargs = dict(ray_init_kwargs or {})
            address = kwargs.pop("address", None) or os.environ.get("RAY_ADDRESS") or None
            connect_ray(address, min(timeout, get_settings().connect_timeout), kwargs)
        self._cpu_slots_per_node = cpu_slots_per_node
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
