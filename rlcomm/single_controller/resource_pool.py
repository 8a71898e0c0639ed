"""verl's resource pools: how many worker slots on how many nodes, shared by worker groups.

A :class:`RayResourcePool` reserves worker slots, GPUs with ``use_gpu=True`` or CPU
worker slots with ``use_gpu=False`` (see :class:`~rlcomm.cluster.Cluster`), on first
use. Every worker group built on a pool puts its rank ``i`` on the pool's slot ``i``, so
groups on one pool are colocated: they share its devices. Pools do not overlap: a new
pool takes slots no live pool holds, and gives them back when it is garbage collected.

Entry ``i`` of ``process_on_nodes`` goes to cluster node ``i`` when that node has room,
else to the first node that has. Merged and split pools share the slots of the pools
they come from.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlcomm.errors import WorkerGroupError
from rlcomm.placement import NodeSpec, Placement, build_placements

if TYPE_CHECKING:
    from rlcomm.cluster import Cluster

__all__ = [
    "RayResourcePool",
    "assign_pool_slots",
    "merge_resource_pool",
    "pool_placements",
    "split_resource_pool",
]


def assign_pool_slots(
    counts: Sequence[int],
    nodes: Sequence[NodeSpec],
    use_gpu: bool,
    taken: dict[int, set[int]],
    preferred: Sequence[int] | None = None,
) -> list[tuple[int, list[int]]]:
    """Pick a node and free local slots for each entry of ``counts`` (pure).

    Entry ``i`` prefers node ``preferred[i]`` (default ``i``), else the first node with
    room. ``taken`` (node rank -> local slot indices in use) is updated.

    Returns:
        ``(node_rank, [local slot indices])`` per entry.

    Raises:
        ValueError: an entry fits no node.
    """
    capacity = {n.node_rank: (n.num_accelerators if use_gpu else n.num_cpu_slots) for n in nodes}
    kind = "GPUs" if use_gpu else "CPU worker slots"
    out = []
    for i, count in enumerate(counts):
        want = i if preferred is None else preferred[i]
        order = ([want] if want in capacity else []) + [r for r in sorted(capacity) if r != want]
        for node in order:
            free = [s for s in range(capacity[node]) if s not in taken.setdefault(node, set())]
            if len(free) >= count:
                chosen = free[:count]
                taken[node].update(chosen)
                out.append((node, chosen))
                break
        else:
            room = {r: capacity[r] - len(taken.get(r, ())) for r in sorted(capacity)}
            raise ValueError(
                f"RayResourcePool: no node has {count} free {kind} for entry {i}; free per "
                f"node: {room}. Release pools you no longer use, or ask for fewer"
            )
    return out


def pool_placements(slots: Sequence[tuple[int, int, int]], use_gpu: bool) -> list[Placement]:
    """Placements for workers on ``(node_rank, local slot, hardware rank)`` slots (pure).

    ``local_rank`` and ``local_world_size`` follow the real layout: a worker's index
    among the pool's workers on its node, and their number.
    """
    return build_placements([[(hw, node, local)] for node, local, hw in slots], use_gpu)


class _Allocator:
    """Slots held by live pools in this process, by (node id, kind)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[tuple[str, str], set[int]] = {}

    def take(self, count: int, cluster: Cluster, use_gpu: bool, preferred: int) -> tuple[int, str, list[int]]:
        try:
            return self._take(count, cluster, use_gpu, preferred)
        except ValueError:
            # Dropped pools give their slots back when collected; one caught in a
            # reference cycle waits for the collector. Collect (no lock held: the
            # finalizers release slots under it), then try once more.
            gc.collect()
            return self._take(count, cluster, use_gpu, preferred)

    def _take(self, count: int, cluster: Cluster, use_gpu: bool, preferred: int) -> tuple[int, str, list[int]]:
        kind = "gpu" if use_gpu else "cpu"
        with self._lock:
            taken = {
                n.node_rank: set(self._taken.get((n.node_id, kind), ())) for n in cluster.nodes
            }
            [(node, local)] = assign_pool_slots(
                [count], cluster.node_specs(), use_gpu, taken, [preferred]
            )
            node_id = cluster.node(node).node_id
            self._taken.setdefault((node_id, kind), set()).update(local)
            return node, node_id, local

    def release(self, node_id: str, use_gpu: bool, local: list[int]) -> None:
        with self._lock:
            self._taken.get((node_id, "gpu" if use_gpu else "cpu"), set()).difference_update(local)


_ALLOCATOR = _Allocator()

#: CPU each bundle of :meth:`RayResourcePool.get_placement_groups` holds (next to none).
_PG_BUNDLE_CPU = 0.01


class _Slots:
    """One entry of ``process_on_nodes``: ``count`` slots on one node, taken on first use."""

    def __init__(self, count: int, use_gpu: bool, preferred_node: int, max_colocate_count: int):
        self.count = count
        self.use_gpu = use_gpu
        self.preferred_node = preferred_node
        self.max_colocate_count = max_colocate_count
        self.live_groups = 0
        self.node_rank: int | None = None
        self.local: list[int] = []
        self.hardware: list[int] = []
        self._lock = threading.Lock()

    def resolve(self, cluster: Cluster) -> None:
        with self._lock:
            if self.node_rank is not None:
                return
            if self.use_gpu and cluster.num_gpus == 0:
                raise ValueError(
                    "RayResourcePool: use_gpu=True but the cluster has no GPUs; build the pool "
                    "with use_gpu=False to run CPU workers"
                )
            node, node_id, local = _ALLOCATOR.take(self.count, cluster, self.use_gpu, self.preferred_node)
            base = sum(
                (n.num_gpus if self.use_gpu else n.num_cpu_slots)
                for n in cluster.nodes
                if n.node_rank < node
            )
            self.node_rank, self.local, self.hardware = node, local, [base + s for s in local]
            weakref.finalize(self, _ALLOCATOR.release, node_id, self.use_gpu, list(local))


class RayResourcePool:
    """Worker slots on nodes, shared by the worker groups built on it (verl's pool).

    Args:
        process_on_nodes: workers per node, e.g. ``[4]`` or ``[2, 4]``.
        use_gpu: one GPU per worker; ``False`` counts CPU worker slots instead (for
            clusters without GPUs).
        name_prefix: a prefix for the pool's name.
        max_colocate_count: at most this many live worker groups on one slot.

    Raises:
        ValueError: an empty list or a count below 1.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str = "",
        max_colocate_count: int = 10,
    ):
        counts = list(process_on_nodes or [])
        if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
            raise ValueError(f"RayResourcePool: process_on_nodes must list counts >= 1, got {process_on_nodes!r}")
        if max_colocate_count < 1:
            raise ValueError(f"RayResourcePool: max_colocate_count must be >= 1, got {max_colocate_count}")
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix
        self.max_colocate_count = max_colocate_count
        self._segments = [
            (_Slots(c, use_gpu, i, max_colocate_count), 0, c) for i, c in enumerate(counts)
        ]
        self._pgs: list[Any] | None = None

    @classmethod
    def _from_segments(cls, segments, use_gpu: bool, name_prefix: str, max_colocate_count: int):
        pool = cls.__new__(cls)
        pool.use_gpu = use_gpu
        pool.name_prefix = name_prefix
        pool.max_colocate_count = max_colocate_count
        pool._segments = list(segments)
        pool._pgs = None
        return pool

    @property
    def store(self) -> list[int]:
        """Workers per pool node (``process_on_nodes``)."""
        return [stop - start for _, start, stop in self._segments]

    @property
    def world_size(self) -> int:
        return sum(self.store)

    def local_rank_list(self) -> list[int]:
        """Each worker's index within its pool node: ``[2, 4]`` gives ``[0, 1, 0, 1, 2, 3]``."""
        return [i for n in self.store for i in range(n)]

    def local_world_size_list(self) -> list[int]:
        """Each worker's pool-node size: ``[2, 4]`` gives ``[2, 2, 4, 4, 4, 4]``."""
        return [n for n in self.store for _ in range(n)]

    def placements(self, cluster: Cluster) -> list[Placement]:
        """Take the pool's slots (first use only) and return one placement per worker.

        ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` of the workers follow the real layout
        (workers of one group on one physical node), not the pool's entries.

        Raises:
            ValueError: the slots do not fit the cluster, or ``use_gpu`` without GPUs.
        """
        slots = []
        for seg, start, stop in self._segments:
            seg.resolve(cluster)
            assert seg.node_rank is not None
            slots.extend(
                (seg.node_rank, seg.local[i], seg.hardware[i]) for i in range(start, stop)
            )
        return pool_placements(slots, self.use_gpu)

    def get_placement_groups(
        self,
        strategy: str = "STRICT_PACK",
        name: str | None = None,
        device_name: str = "cuda",
        cluster: Cluster | None = None,
    ) -> list[Any]:
        """verl's name: take the pool's slots now, and return one Ray placement group
        per pool node (entry ``i`` of ``process_on_nodes``) with one bundle per worker.

        rlcomm places workers by its own slots (node affinity), not by these groups:
        they mirror the pool's layout for code that inspects or removes them, and hold
        almost nothing (0.01 CPU per bundle, on the node of the slots). Made once and
        cached; removing them does not free the slots.

        Args:
            strategy: Ray's placement strategy of each group (verl: ``STRICT_PACK``).
            name: prefix of the groups' names (default: the pool's prefix).
            device_name: verl's; rlcomm finds devices itself (ignored).
            cluster: default: the running Ray's.

        Raises:
            ValueError: the slots do not fit the cluster.
        """
        if self._pgs is not None:
            return list(self._pgs)
        import ray
        from ray.util.placement_group import placement_group

        from rlcomm.cluster import Cluster as _Cluster

        cluster = cluster or _Cluster()
        self.placements(cluster)  # take the slots first
        prefix = name or f"{self.name_prefix}rlcomm_pool_{'_'.join(map(str, self.store))}:"
        pgs = []
        for i, (seg, start, stop) in enumerate(self._segments):
            node_id = cluster.node(seg.node_rank).node_id  # type: ignore[arg-type]
            pgs.append(
                placement_group(
                    [{"CPU": _PG_BUNDLE_CPU} for _ in range(stop - start)],
                    strategy=strategy,
                    name=f"{prefix}{i}",
                    _soft_target_node_id=node_id if strategy.startswith("STRICT") else None,
                )
            )
        ray.get([pg.ready() for pg in pgs], timeout=60)
        self._pgs = pgs
        return list(pgs)

    @property
    def pgs(self) -> list[Any] | None:
        """The placement groups of :meth:`get_placement_groups`, once made (verl)."""
        return None if self._pgs is None else list(self._pgs)

    def _acquire_group(self) -> None:
        """Count one more live worker group on every slot (checks max_colocate_count)."""
        distinct = list({id(s): s for s, _, _ in self._segments}.values())
        full = [s for s in distinct if s.live_groups >= s.max_colocate_count]
        if full:
            raise WorkerGroupError(
                f"RayResourcePool: {full[0].max_colocate_count} worker groups already run on "
                "this pool's slots (max_colocate_count); shut one down first"
            )
        for s in distinct:
            s.live_groups += 1

    def _release_group(self) -> None:
        for s in {id(s): s for s, _, _ in self._segments}.values():
            s.live_groups = max(0, s.live_groups - 1)

    def __repr__(self) -> str:
        return f"RayResourcePool({self.store}, use_gpu={self.use_gpu}, name_prefix={self.name_prefix!r})"


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """One pool holding ``rp1``'s slots, then ``rp2``'s (shared with them, not copied).

    Raises:
        ValueError: the pools differ in ``use_gpu``.
    """
    if rp1.use_gpu != rp2.use_gpu:
        raise ValueError("merge_resource_pool: cannot merge a GPU pool with a CPU pool")
    return RayResourcePool._from_segments(
        rp1._segments + rp2._segments,
        rp1.use_gpu,
        rp1.name_prefix,
        min(rp1.max_colocate_count, rp2.max_colocate_count),
    )


def split_resource_pool(
    resource_pool: RayResourcePool, split_size: int | Sequence[int]
) -> list[RayResourcePool]:
    """Cut a pool into consecutive sub-pools (sharing its slots).

    Args:
        resource_pool: the pool to cut.
        split_size: the size of every sub-pool (must divide the world size), or a list
            of sizes summing to it.

    Raises:
        ValueError: sizes that do not add up to the pool's world size.
    """
    world = resource_pool.world_size
    if isinstance(split_size, int):
        if split_size < 1 or world % split_size:
            raise ValueError(f"split_resource_pool: {split_size} does not divide the pool's {world} workers")
        sizes = [split_size] * (world // split_size)
    else:
        sizes = list(split_size)
        if any(s < 1 for s in sizes) or sum(sizes) != world:
            raise ValueError(f"split_resource_pool: sizes {sizes} must be >= 1 and sum to {world}")
    flat = [(seg, i) for seg, start, stop in resource_pool._segments for i in range(start, stop)]
    pools, pos = [], 0
    for size in sizes:
        segments: list[tuple[_Slots, int, int]] = []
        for seg, i in flat[pos : pos + size]:
            if segments and segments[-1][0] is seg and segments[-1][2] == i:
                segments[-1] = (seg, segments[-1][1], i + 1)
            else:
                segments.append((seg, i, i + 1))
        pools.append(
            RayResourcePool._from_segments(
                segments,
                resource_pool.use_gpu,
                resource_pool.name_prefix,
                resource_pool.max_colocate_count,
            )
        )
        pos += size
    return pools
