"""Worker addresses: a group name and a rank path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RankLike = int | Sequence[int]


def normalize_rank(rank: RankLike) -> tuple[int, ...]:
    """An int rank or a rank path (list/tuple of ints) as a tuple of ints.

    Raises:
        ValueError: on an empty path, a negative rank or a non-int entry.
    """
    path = (rank,) if isinstance(rank, int) else tuple(rank)
    if not path or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
        raise ValueError(f"a rank must be an int >= 0 or a non-empty list of them, got {rank!r}")
    return path


@dataclass(frozen=True, order=True)
class WorkerAddress:
    """Identifies one worker: its group name and its rank path.

    A Ray-launched worker has a one-element path ``(rank,)``; a sub-worker forked by a
    worker extends its parent's path. ``str(addr)`` is ``group:0`` or ``group:0.1``.
    """

    group_name: str
    rank_path: tuple[int, ...]

    @classmethod
    def of(cls, group_name: str, rank: RankLike) -> WorkerAddress:
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"a group name must be a non-empty str, got {group_name!r}")
        return cls(group_name, normalize_rank(rank))

    @property
    def rank(self) -> int:
        """The rank in the root group (the path's first element)."""
        return self.rank_path[0]

    def child(self, rank: int) -> WorkerAddress:
        return WorkerAddress(self.group_name, (*self.rank_path, rank))

    def __str__(self) -> str:
        return f"{self.group_name}:{'.'.join(map(str, self.rank_path))}"
