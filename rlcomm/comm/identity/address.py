"""Worker addresses: a group name and a rank path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RankLike = int | Sequence[int]

#: Addresses made by :meth:`WorkerAddress.of` from an int rank, by ``(group, rank)``: a
#: send or receive names its peer this way on every call. Immutable, so shared.
_OF_CACHE: dict[tuple[str, int], WorkerAddress] = {}
_OF_CACHE_SIZE = 4096


def normalize_rank(rank: RankLike) -> tuple[int, ...]:
    """An int rank or a rank path (list/tuple of ints) as a tuple of ints.

    Raises:
        ValueError: on an empty path, a negative rank or a non-int entry.
    """
    path = (rank,) if isinstance(rank, int) else tuple(rank)
    if not path or any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
        raise ValueError(f"a rank must be an int >= 0 or a non-empty list of them, got {rank!r}")
    return path


@dataclass(frozen=True, order=True, init=False)
class WorkerAddress:
    """Identifies one worker: its group name and its rank path.

    A Ray-launched worker has a one-element path ``(rank,)``; a sub-worker forked by a
    worker extends its parent's path. ``str(addr)`` is ``group:0`` or ``group:0.1``.

    It is also RLinf's ``WorkerAddress``: ``WorkerAddress(root_group_name, ranks)``
    takes an int or a list of ints (``[]`` is the root of the group), and it has
    ``root_group_name``, ``rank`` (the last rank of the path), ``rank_path``,
    ``get_name()`` (``"group:0:1"``), ``get_parent_rank()``, ``get_parent_address()``,
    ``get_child_address(rank)``, ``from_name(name)`` and ``from_parent_name_rank``.
    Unlike RLinf's, it is immutable and ``rank_path`` is a tuple (it compares equal
    to the tuple, not to a list).

    Args:
        group_name: the root worker group's name (RLinf: ``root_group_name``).
        rank_path: an int or a sequence of ints (RLinf: ``ranks``).
    """

    group_name: str
    rank_path: tuple[int, ...]

    def __init__(
        self,
        group_name: str | None = None,
        rank_path: RankLike = (),
        *,
        root_group_name: str | None = None,
        ranks: RankLike | None = None,
    ):
        if root_group_name is not None:
            if group_name is not None:
                raise TypeError("WorkerAddress: give group_name or root_group_name, not both")
            group_name = root_group_name
        if ranks is not None:
            rank_path = ranks
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"WorkerAddress: a group name must be a non-empty str, got {group_name!r}")
        path = (rank_path,) if isinstance(rank_path, int) else tuple(rank_path)
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in path):
            raise ValueError(f"WorkerAddress: ranks must be ints >= 0, got {rank_path!r}")
        object.__setattr__(self, "group_name", group_name)
        object.__setattr__(self, "rank_path", path)
        # Hashed once: an address keys the connection lookup of every message.
        object.__setattr__(self, "_hash", hash((group_name, path)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __reduce__(self) -> tuple:
        # Rebuilt through __init__: a string's hash differs from process to process.
        return (WorkerAddress, (self.group_name, self.rank_path))

    @classmethod
    def of(cls, group_name: str, rank: RankLike) -> WorkerAddress:
        """The address of ``rank`` (an int or a non-empty rank path) in ``group_name``.

        Raises:
            ValueError: an empty name or path, or a bad rank.
        """
        if type(rank) is int and type(group_name) is str:  # the per-message case: cached
            key = (group_name, rank)
            address = _OF_CACHE.get(key)
            if address is None:
                if len(_OF_CACHE) >= _OF_CACHE_SIZE:
                    _OF_CACHE.clear()
                address = _OF_CACHE[key] = cls._checked(group_name, rank)
            return address
        return cls._checked(group_name, rank)

    @classmethod
    def _checked(cls, group_name: str, rank: RankLike) -> WorkerAddress:
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"a group name must be a non-empty str, got {group_name!r}")
        return cls(group_name, normalize_rank(rank))

    @property
    def root_group_name(self) -> str:
        """The name of the root worker group (RLinf's name for ``group_name``)."""
        return self.group_name

    @property
    def rank(self) -> int:
        """The worker's rank among its siblings: the path's last element (0 for ``[]``),
        as in RLinf. For a Ray-launched worker it is its rank in the group."""
        return self.rank_path[-1] if self.rank_path else 0

    @property
    def root_rank(self) -> int:
        """The rank in the root group (the path's first element; 0 for ``[]``)."""
        return self.rank_path[0] if self.rank_path else 0

    def child(self, rank: int) -> WorkerAddress:
        return WorkerAddress(self.group_name, (*self.rank_path, rank))

    # -- RLinf's names ------------------------------------------------------------------

    def get_name(self) -> str:
        """RLinf's text form: the group name and each rank after a ``:``, ``"g:5"``."""
        return self.group_name + "".join(f":{r}" for r in self.rank_path)

    def get_parent_rank(self) -> int:
        """The parent's rank: the path's second-to-last element, 0 at the top."""
        return self.rank_path[-2] if len(self.rank_path) > 1 else 0

    def get_parent_address(self) -> WorkerAddress | None:
        """The address one level up (``None`` for the root, whose path is empty)."""
        if not self.rank_path:
            return None
        return WorkerAddress(self.group_name, self.rank_path[:-1])

    def get_child_address(self, rank: int) -> WorkerAddress:
        """The address of child ``rank`` of this worker."""
        return self.child(rank)

    @classmethod
    def from_name(cls, worker_name: str) -> WorkerAddress:
        """Parse :meth:`get_name`'s form, ``"group:0:1"``.

        Raises:
            ValueError: a rank that is not an int.
        """
        group, *ranks = worker_name.split(":")
        try:
            path = tuple(int(r) for r in ranks)
        except ValueError:
            raise ValueError(
                f"WorkerAddress.from_name: {worker_name!r} is not 'group:rank[:rank...]'"
            ) from None
        return cls(group, path)

    @classmethod
    def from_parent_name_rank(cls, parent_name: str, rank: int) -> WorkerAddress:
        """The address of child ``rank`` of the worker named ``parent_name``."""
        return cls.from_name(parent_name).get_child_address(rank)

    def __str__(self) -> str:
        return f"{self.group_name}:{'.'.join(map(str, self.rank_path))}"
