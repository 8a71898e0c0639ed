"""The rank layout of a worker group: its :class:`~rlcomm.worker.sharding.NamedSharding`,
NeMo-RL's tied worker groups, the data-parallel axis and each worker's metadata.

Without a sharding given to ``launch`` a group has a default layout: ``["data_parallel"]``
over the workers, or ``["data_parallel", "tied_worker"]`` (one row per tied group) when the
tied groups all have the same size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlcomm.comm.identity import actor_name
from rlcomm.errors import WorkerGroupError
from rlcomm.placement import Placement
from rlcomm.worker.sharding import NamedSharding

__all__ = ["DP_AXIS_NAMES", "RankLayout"]

#: Axis names treated as the data-parallel axis, in order of preference.
DP_AXIS_NAMES = ("data_parallel", "dp")


class RankLayout:
    """The ranks of a group of ``world_size`` workers: their sharding and tied groups
    (none of either for a group not launched yet, ``world_size`` 0).

    Args:
        world_size: the number of workers.
        sharding: the group's named axes (default: see the module docstring).
        bundle_indices_list: NeMo-RL's tied groups, ``[(node_rank, [local indices]), ...]``.

    Raises:
        TypeError: ``sharding`` is not a :class:`NamedSharding`.
        ValueError: the sharding does not have ``world_size`` ranks.
    """

    def __init__(
        self,
        world_size: int,
        sharding: NamedSharding | None = None,
        bundle_indices_list: Sequence[tuple[int, Sequence[int]]] | None = None,
    ):
        if bundle_indices_list:
            groups, start = [], 0
            for _, local in bundle_indices_list:
                groups.append(list(range(start, start + len(local))))
                start += len(local)
            self._tied_bundles: list[tuple[int, list[int]]] | None = [
                (int(n), list(local)) for n, local in bundle_indices_list
            ]
        else:
            groups = [[r] for r in range(world_size)]
            self._tied_bundles = None
        self.tied_groups: list[list[int]] = groups
        if sharding is not None:
            if not isinstance(sharding, NamedSharding):
                raise TypeError(f"launch: sharding must be a NamedSharding, got {type(sharding).__name__}")
            if sharding.size != world_size:
                raise ValueError(
                    f"launch: the sharding {sharding} has {sharding.size} ranks but the group "
                    f"has {world_size} workers"
                )
        elif groups and all(len(g) == 1 for g in groups):
            sharding = NamedSharding(list(range(world_size)), ["data_parallel"])
        elif len({len(g) for g in groups}) == 1:
            sharding = NamedSharding(groups, ["data_parallel", "tied_worker"])
        self.sharding: NamedSharding | None = sharding

    def bundle_indices(self, rank: int, placement: Placement | None = None) -> tuple[int, list[int]] | None:
        """What ``configure_worker`` gets as ``bundle_indices`` (NeMo-RL's rule): the tied
        group's ``(node_idx, local indices)`` for its first worker, ``None`` for its
        other workers; ``(node_rank, [local_rank])`` of ``placement`` for a worker that
        is not tied (without ``placement``: ``None``)."""
        if not self._tied_bundles:
            if placement is None:
                return None
            return placement.node_rank, [placement.local_rank]
        for group, bundle in zip(self.tied_groups, self._tied_bundles, strict=True):
            if group[0] == rank:
                return bundle[0], list(bundle[1])
        return None

    def tied_group_index(self) -> dict[int, int]:
        """Worker index to the index of its tied group."""
        return {w: i for i, g in enumerate(self.tied_groups) for w in g}

    def dp_axis(self) -> str:
        """The sharding's data-parallel axis.

        Raises:
            WorkerGroupError: it has none.
        """
        assert self.sharding is not None
        for name in DP_AXIS_NAMES:
            if name in self.sharding.names:
                return name
        raise WorkerGroupError(
            f"the sharding {self.sharding} has no data-parallel axis; name one of "
            f"{list(DP_AXIS_NAMES)}"
        )

    def dp_size(self) -> int:
        """The number of data-parallel shards (the tied groups when there is no sharding)."""
        if self.sharding is None:
            return len(self.tied_groups)
        return self.sharding.get_axis_size(self.dp_axis())

    def dp_leader(self, dp_shard_idx: int) -> int:
        """The worker at data-parallel index ``dp_shard_idx`` and 0 on every other axis
        (without sharding: the first worker of tied group ``dp_shard_idx``)."""
        sharding = self.sharding
        if sharding is None:
            groups = self.tied_groups
            if not 0 <= dp_shard_idx < len(groups):
                raise ValueError(f"dp shard {dp_shard_idx} not in 0..{len(groups) - 1}")
            return groups[dp_shard_idx][0]
        coords = {name: 0 for name in sharding.names}
        coords[self.dp_axis()] = dp_shard_idx
        rank = sharding.get_ranks(**coords)
        assert isinstance(rank, int)
        return rank

    def metadata(self, group_name: str, placements: Sequence[Placement]) -> list[dict[str, Any]]:
        """Per worker: rank, actor name, node, local rank, GPUs, tied group, coordinates."""
        tied_of = self.tied_group_index()
        sharding = self.sharding
        return [
            {
                "rank": p.rank,
                "name": actor_name(group_name, p.rank),
                "node_idx": p.node_rank,
                "local_rank": p.local_rank,
                "accelerator_ids": list(p.accelerator_ids),
                "tied_group_idx": tied_of.get(p.rank, p.rank),
                "bundle_indices": self.bundle_indices(p.rank, p),
                "coords": sharding.get_worker_coords(p.rank) if sharding else None,
            }
            for p in placements
        ]
