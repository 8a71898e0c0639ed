"""Named-axis rank layouts (NeMo-RL's ``NamedSharding``) and the plans of sharded calls.

Pure: no Ray. :class:`NamedSharding` says which worker sits at which coordinate of a
mesh such as ``dp x tp``; :func:`plan_sharded_call` says, for a call that shards its data
along some axes, which worker gets which slice and whose output is returned. The
Ray side is :mod:`rlcomm.worker.sharded_calls`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "NamedSharding",
    "ShardedCallEntry",
    "pick_shard",
    "plan_sharded_call",
    "ranks_at_zero",
]


class NamedSharding:
    """An n-d arrangement of worker ranks with named axes.

    ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])`` puts ranks 0 and 1 in data-parallel
    shard 0 (tensor-parallel ranks 0 and 1) and ranks 2 and 3 in shard 1.

    Args:
        layout: a nested sequence (or array) of ints holding every rank ``0..size-1``
            exactly once.
        names: one distinct name per dimension, outermost first.

    Raises:
        ValueError: a ragged or non-integer layout, ranks missing or repeated, or names
            that do not match the dimensions.
    """

    def __init__(self, layout: Sequence[Any] | np.ndarray, names: Sequence[str]):
        try:
            arr = np.asarray(layout)
        except ValueError as exc:  # ragged nested lists
            raise ValueError(f"NamedSharding: layout is not a regular n-d array: {exc}") from None
        if arr.dtype == object or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"NamedSharding: layout must be a non-empty n-d array of ints, got {layout!r}")
        names = list(names)
        if len(names) != arr.ndim:
            raise ValueError(
                f"NamedSharding: {len(names)} names {names} for a {arr.ndim}-d layout of shape "
                f"{arr.shape}"
            )
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"NamedSharding: names must be distinct non-empty strings, got {names}")
        if sorted(arr.flatten().tolist()) != list(range(arr.size)):
            raise ValueError(
                f"NamedSharding: the layout must hold each rank 0..{arr.size - 1} exactly once, "
                f"got {arr.tolist()}"
            )
        self._layout = arr.astype(np.int64)
        self._names = names
        self._coords = {int(r): tuple(int(i) for i in idx) for idx, r in np.ndenumerate(arr)}

    @property
    def names(self) -> list[str]:
        """The axis names, outermost first."""
        return list(self._names)

    @property
    def ndim(self) -> int:
        return len(self._names)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(zip(self._names, self._layout.shape, strict=True))

    @property
    def size(self) -> int:
        """The number of ranks."""
        return int(self._layout.size)

    @property
    def layout(self) -> np.ndarray:
        """A copy of the rank array."""
        return self._layout.copy()

    def get_axis_index(self, name: str) -> int:
        """The position of axis ``name``.

        Raises:
            ValueError: no axis of that name.
        """
        if name not in self._names:
            raise ValueError(f"NamedSharding: no axis {name!r}; the axes are {self._names}")
        return self._names.index(name)

    def get_axis_size(self, name: str) -> int:
        return int(self._layout.shape[self.get_axis_index(name)])

    def get_ranks(self, **axis_indices: int) -> int | list:
        """The ranks at the given axis indices.

        ``get_ranks(dp=1)`` on ``[[0, 1], [2, 3]], ["dp", "tp"]`` is ``[2, 3]``; with every
        axis given the result is one int rank.

        Raises:
            ValueError: an unknown axis or an index out of range.
        """
        index: list[Any] = [slice(None)] * self.ndim
        for name, i in axis_indices.items():
            axis = self.get_axis_index(name)
            size = self._layout.shape[axis]
            if not isinstance(i, (int, np.integer)) or not 0 <= i < size:
                raise ValueError(f"NamedSharding: {name}={i!r} is out of range 0..{size - 1}")
            index[axis] = int(i)
        sub = self._layout[tuple(index)]
        return int(sub) if np.ndim(sub) == 0 else sub.tolist()

    def get_worker_coords(self, rank: int) -> dict[str, int]:
        """Axis name -> coordinate of ``rank``.

        Raises:
            ValueError: ``rank`` is not in the layout.
        """
        if rank not in self._coords:
            raise ValueError(f"NamedSharding: rank {rank} is not in the layout (0..{self.size - 1})")
        return dict(zip(self._names, self._coords[rank], strict=True))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, NamedSharding)
            and self._names == other._names
            and np.array_equal(self._layout, other._layout)
        )

    def __hash__(self) -> int:
        return hash((tuple(self._names), self._layout.tobytes(), self._layout.shape))

    def __repr__(self) -> str:
        return f"NamedSharding({self._layout.tolist()}, names={self._names})"


def _check_axes(sharding: NamedSharding, axes: Sequence[str] | None, arg: str, where: str) -> list[str]:
    axes = list(axes or [])
    unknown = [a for a in axes if a not in sharding.names]
    if unknown:
        raise ValueError(f"{where}: {arg} names unknown axes {unknown}; the axes are {sharding.names}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{where}: {arg} repeats an axis: {axes}")
    return axes


def ranks_at_zero(
    sharding: NamedSharding, axes: Sequence[str] | None, where: str = "run_rank_0_only_axes"
) -> list[int]:
    """The ranks whose coordinate is 0 along every axis in ``axes`` (all ranks if none)."""
    axes = _check_axes(sharding, axes, "run_rank_0_only_axes", where)
    return [
        r for r in range(sharding.size)
        if all(sharding.get_worker_coords(r)[a] == 0 for a in axes)
    ]


@dataclass(frozen=True)
class ShardedCallEntry:
    """One worker's part of a sharded call.

    Attributes:
        rank: the worker.
        shard: its index along the sharded axes (in ``in_sharded_axes`` order), or ``None``
            for a dummy call (every sharded argument is ``None``).
        returns: whether its output is part of the call's results.
    """

    rank: int
    shard: tuple[int, ...] | None
    returns: bool


def plan_sharded_call(
    sharding: NamedSharding,
    in_sharded_axes: Sequence[str] | None = None,
    replicate_on_axes: Sequence[str] | None = None,
    output_is_replicated: Sequence[str] | None = None,
    make_dummy_calls_to_free_axes: bool = False,
    where: str = "run_all_workers_sharded_data",
) -> list[ShardedCallEntry]:
    """Who is called with which slice, and whose output counts, by rank.

    - Along ``in_sharded_axes`` the data is already split: a worker gets the slice at its
      coordinates along those axes.
    - Along ``replicate_on_axes`` every worker gets the same slice.
    - Along the other (free) axes only coordinate 0 is called; with
      ``make_dummy_calls_to_free_axes`` the others are called with ``None`` data and
      their outputs dropped.
    - Outputs are returned only from coordinate 0 along ``output_is_replicated`` (and
      along free axes).

    Raises:
        ValueError: unknown or repeated axes, or an axis both sharded and replicated.
    """
    sharded = _check_axes(sharding, in_sharded_axes, "in_sharded_axes", where)
    replicated = _check_axes(sharding, replicate_on_axes, "replicate_on_axes", where)
    out_rep = _check_axes(sharding, output_is_replicated, "output_is_replicated", where)
    both = sorted(set(sharded) & set(replicated))
    if both:
        raise ValueError(f"{where}: axes {both} are in both in_sharded_axes and replicate_on_axes")
    free = [a for a in sharding.names if a not in sharded and a not in replicated]
    plan = []
    for rank in range(sharding.size):
        coords = sharding.get_worker_coords(rank)
        if any(coords[a] != 0 for a in free):
            if make_dummy_calls_to_free_axes:
                plan.append(ShardedCallEntry(rank, None, False))
            continue
        returns = all(coords[a] == 0 for a in out_rep)
        plan.append(ShardedCallEntry(rank, tuple(coords[a] for a in sharded), returns))
    return plan


def pick_shard(
    value: Any, shard: tuple[int, ...], sizes: Sequence[int], arg: str, where: str
) -> Any:
    """``value[shard[0]][shard[1]]...``, checking each level's length against ``sizes``.

    Raises:
        ValueError: a level is not a sequence or has the wrong length.
    """
    node = value
    for depth, (i, size) in enumerate(zip(shard, sizes, strict=True)):
        if not isinstance(node, (list, tuple)) or len(node) != size:
            got = f"length {len(node)}" if isinstance(node, (list, tuple)) else type(node).__name__
            raise ValueError(
                f"{where}: {arg} must be a nested list with {size} entries at depth {depth} "
                f"(one per index of the sharded axis), got {got}"
            )
        node = node[i]
    return node
