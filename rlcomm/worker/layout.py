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
from rlcomm.worker.sharding import NamedSharding

__all__ = ["DP_AXIS_NAMES", "RankLayoutMixin"]

#: Axis names treated as the data-parallel axis, in order of preference.
DP_AXIS_NAMES = ("data_parallel", "dp")


class RankLayoutMixin:
    """The layout part of ``WorkerGroup`` (``launch`` calls :meth:`_set_layout`)."""

    _sharding: NamedSharding | None = None
    _tied_groups: list[list[int]] | None = None
    _tied_bundles: list[tuple[int, list[int]]] | None = None

    def _set_layout(
        self,
        world_size: int,
        sharding: NamedSharding | None,
        bundle_indices_list: Sequence[tuple[int, Sequence[int]]] | None,
    ) -> None:
        """Validate and keep the rank layout and tied groups (called by ``launch``)."""
        if bundle_indices_list:
            groups, start = [], 0
            for _, local in bundle_indices_list:
                groups.append(list(range(start, start + len(local))))
                start += len(local)
            self._tied_bundles = [(int(n), list(local)) for n, local in bundle_indices_list]
        else:
            groups = [[r] for r in range(world_size)]
            self._tied_bundles = None
        self._tied_groups = groups
        if sharding is not None:
            if not isinstance(sharding, NamedSharding):
                raise TypeError(f"launch: sharding must be a NamedSharding, got {type(sharding).__name__}")
            if sharding.size != world_size:
                raise ValueError(
                    f"launch: the sharding {sharding} has {sharding.size} ranks but the group "
                    f"has {world_size} workers"
                )
        elif all(len(g) == 1 for g in groups):
            sharding = NamedSharding(list(range(world_size)), ["data_parallel"])
        elif len({len(g) for g in groups}) == 1:
            sharding = NamedSharding(groups, ["data_parallel", "tied_worker"])
        self._sharding = sharding

    def _worker_bundle_indices(self, rank: int, placement: Any = None) -> tuple[int, list[int]] | None:
        """What ``configure_worker`` gets as ``bundle_indices`` (NeMo-RL's rule): the tied
        group's ``(node_idx, local indices)`` for its first worker, ``None`` for its
        other workers; ``(node_rank, [local_rank])`` of ``placement`` for a worker that
        is not tied (without ``placement``: ``None``)."""
        if not self._tied_bundles or not self._tied_groups:
            if placement is None:
                return None
            return placement.node_rank, [placement.local_rank]
        for group, bundle in zip(self._tied_groups, self._tied_bundles, strict=True):
            if group[0] == rank:
                return bundle[0], list(bundle[1])
        return None

    @property
    def sharding_annotations(self) -> NamedSharding | None:
        """The group's :class:`NamedSharding` (given to ``launch`` or the default)."""
        return self._sharding

    @property
    def tied_workers_groups(self) -> list[list[int]]:
        """The worker indices of each tied group (one group per worker when untied)."""
        return [list(g) for g in self._tied_groups or []]

    @property
    def worker_to_tied_group_index(self) -> dict[int, int]:
        return {w: i for i, g in enumerate(self._tied_groups or []) for w in g}

    def _dp_axis(self) -> str:
        assert self._sharding is not None
        for name in DP_AXIS_NAMES:
            if name in self._sharding.names:
                return name
        raise WorkerGroupError(
            f"the sharding {self._sharding} has no data-parallel axis; name one of "
            f"{list(DP_AXIS_NAMES)}"
        )

    @property
    def dp_size(self) -> int:
        """The number of data-parallel shards (the tied groups when there is no sharding)."""
        if self._sharding is None:
            return len(self._tied_groups or [])
        axis = self._dp_axis()
        return self._sharding.get_axis_size(axis)

    def get_dp_leader_worker_idx(self, dp_shard_idx: int) -> int:
        """The worker at data-parallel index ``dp_shard_idx`` and 0 on every other axis
        (without sharding: the first worker of tied group ``dp_shard_idx``)."""
        sharding = self._sharding
        if sharding is None:
            groups = self._tied_groups or []
            if not 0 <= dp_shard_idx < len(groups):
                raise ValueError(f"dp shard {dp_shard_idx} not in 0..{len(groups) - 1}")
            return groups[dp_shard_idx][0]
        axis = self._dp_axis()
        coords = {name: 0 for name in sharding.names}
        coords[axis] = dp_shard_idx
        return sharding.get_ranks(**coords)  # type: ignore[return-value]

    @property
    def worker_metadata(self) -> list[dict[str, Any]]:
        """Per worker: rank, actor name, node, local rank, GPUs, tied group, coordinates."""
        tied_of = self.worker_to_tied_group_index
        out = []
        for p in self._placements:  # type: ignore[attr-defined]
            coords = self._sharding.get_worker_coords(p.rank) if self._sharding else None
            out.append(
                {
                    "rank": p.rank,
                    "name": actor_name(self._name, p.rank),  # type: ignore[attr-defined]
                    "node_idx": p.node_rank,
                    "local_rank": p.local_rank,
                    "accelerator_ids": list(p.accelerator_ids),
                    "tied_group_idx": tied_of.get(p.rank, p.rank),
                    "bundle_indices": self._worker_bundle_indices(p.rank, p),
                    "coords": coords,
                }
            )
        return out
