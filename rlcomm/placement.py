"""Placement strategies: pure functions from a cluster's node list to worker placements.

A *hardware rank* numbers the accelerators of the cluster in node order (node 0's GPUs
first, then node 1's, ...). On a cluster without accelerators, hardware ranks number the
CPU worker slots of each node instead (see :class:`~rlcomm.cluster.Cluster`), so the same
strategies place CPU workers. Nothing here touches Ray: strategies are unit-tested alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeSpec:
    """What a placement strategy needs to know of a node.

    Attributes:
        node_rank: the node's index in the cluster (0 is the head node).
        num_accelerators: CUDA GPUs on the node (0 for none).
        num_cpu_slots: how many CPU workers the node hosts when there are no accelerators.
    """

    node_rank: int
    num_accelerators: int
    num_cpu_slots: int


@dataclass(frozen=True)
class Placement:
    """Where one worker of a group runs.

    Attributes:
        rank: the worker's rank in its group.
        node_rank: the node it runs on.
        local_rank: its index among the group's workers on that node.
        local_world_size: how many workers of the group share that node.
        accelerator_ids: local GPU indices on that node given to the worker (empty for CPU).
        hardware_ranks: the global hardware ranks it occupies.
    """

    rank: int
    node_rank: int
    local_rank: int
    local_world_size: int
    accelerator_ids: tuple[int, ...]
    hardware_ranks: tuple[int, ...]


class PlacementStrategy:
    """Base class: turns a node list into an ordered list of :class:`Placement`."""

    def get_placements(self, nodes: Sequence[NodeSpec]) -> list[Placement]:
        raise NotImplementedError


def _hardware_table(nodes: Sequence[NodeSpec]) -> tuple[list[tuple[int, int]], bool]:
    """Global hardware rank -> (node_rank, local index); and whether they are accelerators."""
    use_accel = any(n.num_accelerators > 0 for n in nodes)
    table: list[tuple[int, int]] = []
    for node in nodes:
        count = node.num_accelerators if use_accel else node.num_cpu_slots
        table.extend((node.node_rank, i) for i in range(count))
    return table, use_accel


def build_placements(
    groups: Sequence[Sequence[tuple[int, int, int]]], use_accel: bool
) -> list[Placement]:
    """Placements, in rank order, from each process's list of (hardware_rank, node_rank,
    local_index); local ranks and local world sizes follow the layout."""
    per_node: Counter[int] = Counter(g[0][1] for g in groups)
    seen: Counter[int] = Counter()
    placements = []
    for rank, group in enumerate(groups):
        node_rank = group[0][1]
        placements.append(
            Placement(
                rank=rank,
                node_rank=node_rank,
                local_rank=seen[node_rank],
                local_world_size=per_node[node_rank],
                accelerator_ids=tuple(local for _, _, local in group) if use_accel else (),
                hardware_ranks=tuple(hw for hw, _, _ in group),
            )
        )
        seen[node_rank] += 1
    return placements


def _resolve(
    strategy: str, hardware_lists: list[list[int]], nodes: Sequence[NodeSpec]
) -> list[Placement]:
    table, use_accel = _hardware_table(nodes)
    kind = "accelerators" if use_accel else "CPU worker slots"
    groups = []
    for hw_list in hardware_lists:
        for hw in hw_list:
            if not 0 <= hw < len(table):
                raise ValueError(
                    f"{strategy}: hardware rank {hw} is out of range; the cluster has "
                    f"{len(table)} {kind} (hardware ranks 0..{len(table) - 1})"
                )
        entries = [(hw, *table[hw]) for hw in hw_list]
        if len({node for _, node, _ in entries}) > 1:
            raise ValueError(
                f"{strategy}: hardware ranks {hw_list} of one process span several nodes; "
                "a process must sit on one node"
            )
        groups.append(entries)
    return build_placements(groups, use_accel)


class PackedPlacementStrategy(PlacementStrategy):
    """Packs processes onto consecutive hardware ranks ``start..end`` (inclusive).

    Each process gets ``num_hardware_per_process`` hardware ranks. With ``stride > 1`` the
    ranks of one process are ``stride`` apart: for ``start=0, end=7,
    num_hardware_per_process=2, stride=2`` the processes get ``[0, 2], [1, 3], [4, 6],
    [5, 7]``.

    Raises:
        ValueError: on ``end < start``, negative values, a range whose length is not a
            multiple of ``num_hardware_per_process * stride``, or (at placement time) a
            range beyond the cluster's hardware.
    """

    def __init__(
        self,
        start_hardware_rank: int,
        end_hardware_rank: int,
        num_hardware_per_process: int = 1,
        stride: int = 1,
    ):
        if start_hardware_rank < 0 or end_hardware_rank < start_hardware_rank:
            raise ValueError(
                f"PackedPlacementStrategy: need 0 <= start_hardware_rank <= end_hardware_rank, "
                f"got {start_hardware_rank}..{end_hardware_rank}"
            )
        if num_hardware_per_process < 1 or stride < 1:
            raise ValueError(
                "PackedPlacementStrategy: num_hardware_per_process and stride must be >= 1, got "
                f"{num_hardware_per_process} and {stride}"
            )
        span = end_hardware_rank - start_hardware_rank + 1
        block = num_hardware_per_process * stride
        if span % block:
            raise ValueError(
                f"PackedPlacementStrategy: the range {start_hardware_rank}..{end_hardware_rank} "
                f"({span} hardware ranks) is not a multiple of num_hardware_per_process * stride "
                f"= {block}"
            )
        self.start_hardware_rank = start_hardware_rank
        self.end_hardware_rank = end_hardware_rank
        self.num_hardware_per_process = num_hardware_per_process
        self.stride = stride

    def hardware_lists(self) -> list[list[int]]:
        """The hardware ranks of each process, in rank order."""
        per, stride = self.num_hardware_per_process, self.stride
        block = per * stride
        lists = []
        for block_start in range(self.start_hardware_rank, self.end_hardware_rank + 1, block):
            for j in range(stride):
                lists.append([block_start + j + k * stride for k in range(per)])
        return lists

    def get_placements(self, nodes: Sequence[NodeSpec]) -> list[Placement]:
        return _resolve("PackedPlacementStrategy", self.hardware_lists(), nodes)

    def __repr__(self) -> str:
        return (
            f"PackedPlacementStrategy({self.start_hardware_rank}, {self.end_hardware_rank}, "
            f"num_hardware_per_process={self.num_hardware_per_process}, stride={self.stride})"
        )


class FlexiblePlacementStrategy(PlacementStrategy):
    """One process per entry of ``hardware_ranks_list``, each entry the hardware ranks it owns.

    Raises:
        ValueError: on an empty list or entry, a hardware rank used twice, an entry that
            spans nodes, or a rank beyond the cluster's hardware.
    """

    def __init__(self, hardware_ranks_list: Sequence[Sequence[int]]):
        lists = [list(entry) for entry in hardware_ranks_list]
        if not lists or any(not entry for entry in lists):
            raise ValueError(
                "FlexiblePlacementStrategy: hardware_ranks_list must be a non-empty list of "
                f"non-empty lists, got {hardware_ranks_list!r}"
            )
        counts = Counter(hw for entry in lists for hw in entry)
        reused = sorted(hw for hw, c in counts.items() if c > 1)
        if reused:
            raise ValueError(
                f"FlexiblePlacementStrategy: hardware ranks {reused} are given to more than one "
                "process"
            )
        if any(hw < 0 for hw in counts):
            raise ValueError(f"FlexiblePlacementStrategy: negative hardware rank in {lists}")
        self.hardware_ranks_list = lists

    def get_placements(self, nodes: Sequence[NodeSpec]) -> list[Placement]:
        return _resolve("FlexiblePlacementStrategy", self.hardware_ranks_list, nodes)

    def __repr__(self) -> str:
        return f"FlexiblePlacementStrategy({self.hardware_ranks_list})"


class NodePlacementStrategy(PlacementStrategy):
    """One CPU worker per entry of ``node_ranks``, on that node (repeats allowed).

    Raises:
        ValueError: on an empty list, a negative rank, or a node rank the cluster lacks.
    """

    def __init__(self, node_ranks: Sequence[int]):
        ranks = list(node_ranks)
        if not ranks:
            raise ValueError("NodePlacementStrategy: node_ranks must not be empty")
        if any(not isinstance(r, int) or r < 0 for r in ranks):
            raise ValueError(f"NodePlacementStrategy: node ranks must be ints >= 0, got {ranks}")
        self.node_ranks = ranks

    def get_placements(self, nodes: Sequence[NodeSpec]) -> list[Placement]:
        known = {n.node_rank for n in nodes}
        missing = sorted({r for r in self.node_ranks if r not in known})
        if missing:
            raise ValueError(
                f"NodePlacementStrategy: node ranks {missing} do not exist; the cluster has "
                f"{len(nodes)} node(s) (ranks 0..{len(nodes) - 1})"
            )
        groups = [[(-1, node_rank, 0)] for node_rank in self.node_ranks]
        placements = build_placements(groups, use_accel=False)
        return [
            Placement(p.rank, p.node_rank, p.local_rank, p.local_world_size, (), ())
            for p in placements
        ]

    def __repr__(self) -> str:
        return f"NodePlacementStrategy({self.node_ranks})"


class BundlePlacementStrategy(PlacementStrategy):
    """One process per local index of each ``(node_rank, [local indices])`` entry.

    NeMo-RL's ``bundle_indices_list``: each entry is a *tied group* of processes on one
    node, e.g. ``[(0, [0, 1]), (0, [2, 3])]`` puts two groups of two on node 0. Local
    indices are GPU indices on that node, or CPU worker slots on a cluster without GPUs.
    Ranks follow the list order.

    Raises:
        ValueError: an empty list or entry, a negative index, a slot used twice, or (at
            placement time) a node or local index the cluster lacks.
    """

    def __init__(self, bundle_indices_list: Sequence[tuple[int, Sequence[int]]]):
        entries = [(node, list(local)) for node, local in bundle_indices_list]
        if not entries or any(not local for _, local in entries):
            raise ValueError(
                "BundlePlacementStrategy: bundle_indices_list must be a non-empty list of "
                f"(node_rank, [local indices]) with non-empty index lists, got {bundle_indices_list!r}"
            )
        slots = [(node, i) for node, local in entries for i in local]
        if any(not isinstance(v, int) or v < 0 for slot in slots for v in slot):
            raise ValueError(f"BundlePlacementStrategy: node ranks and indices must be ints >= 0: {entries}")
        reused = sorted(s for s, c in Counter(slots).items() if c > 1)
        if reused:
            raise ValueError(f"BundlePlacementStrategy: (node, index) slots {reused} are used twice")
        self.bundle_indices_list = entries

    def get_placements(self, nodes: Sequence[NodeSpec]) -> list[Placement]:
        table, use_accel = _hardware_table(nodes)
        hardware = {slot: hw for hw, slot in enumerate(table)}
        kind = "GPUs" if use_accel else "CPU worker slots"
        groups = []
        for node, local in self.bundle_indices_list:
            for i in local:
                if (node, i) not in hardware:
                    have = sum(1 for n, _ in table if n == node)
                    raise ValueError(
                        f"BundlePlacementStrategy: node {node} has no local index {i} "
                        f"({have} {kind} there; the cluster has {len(nodes)} node(s))"
                    )
                groups.append([(hardware[(node, i)], node, i)])
        return build_placements(groups, use_accel)

    def __repr__(self) -> str:
        return f"BundlePlacementStrategy({self.bundle_indices_list})"
