"""The arguments of NeMo-RL style calls on a :class:`~rlcomm.worker.group.WorkerGroup`.

``WorkerGroup``'s ``run_all_workers_multiple_data`` and ``run_all_workers_sharded_data``
give each called worker its own arguments; the functions here work out which ranks are
called and what each gets, from the group's :class:`~rlcomm.worker.layout.RankLayout`,
before anything runs remotely. Unlike NeMo-RL, positional arguments are accepted
everywhere, and argument errors are raised here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from rlcomm.worker.layout import RankLayout
from rlcomm.worker.sharding import pick_shard, plan_sharded_call, ranks_at_zero

#: Per called rank: its positional and its keyword arguments.
PerRank = tuple[list[tuple[Any, ...]], list[dict[str, Any]]]


class PerWorkerDataError(ValueError, AssertionError):
    """A per-worker argument list of ``run_all_workers_multiple_data`` that does not fit
    the workers. A ``ValueError``, and an ``AssertionError`` as NeMo-RL raises there."""


_PLAIN = (int, float, str, bool, bytes, type(None))


def called_ranks(layout: RankLayout, world: int, axes: Sequence[str] | None, where: str) -> list[int]:
    """The ranks a call runs on: all, or those at coordinate 0 along ``axes``."""
    if not axes:
        return list(range(world))
    if layout.sharding is None:
        raise ValueError(f"{where}: run_rank_0_only_axes needs a group launched with sharding=")
    return ranks_at_zero(layout.sharding, axes, where)


def check_common(kwargs: dict[str, Any], common: dict[str, Any], what: str, where: str) -> None:
    """A keyword argument may be per worker or common, not both."""
    both = sorted(set(common) & set(kwargs))
    if both:
        raise ValueError(f"{where}: {both} given both as {what} kwargs and in common_kwargs")


def multiple_data(
    layout: RankLayout, world: int, ranks: list[int], rank_0_only: bool,
    args: tuple[Any, ...], kwargs: dict[str, Any], common: dict[str, Any], where: str,
) -> PerRank:
    """``run_all_workers_multiple_data``'s arguments for each of ``ranks``: entry ``r`` of
    a per-worker list, of a per-tied-group list, or (``rank_0_only``) of a list with one
    entry per called rank.

    Raises:
        PerWorkerDataError: no per-worker argument, or one of no valid length.
    """
    groups = layout.tied_groups or [[r] for r in range(world)]
    tied_of = layout.tied_group_index()
    if not args and not kwargs:
        raise PerWorkerDataError(
            f"{where}: give at least one per-worker argument (a list with one entry per "
            "worker), or use run_all_workers_single_data"
        )
    valid = sorted({world, len(groups)} | ({len(ranks)} if rank_0_only else set()))
    for name, value in [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) not in valid:
            got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            per = "one entry per worker" + (
                f" ({world}) or per tied group ({len(groups)})" if len(groups) != world else f" ({world})"
            )
            if rank_0_only:
                per += f" or per called worker ({len(ranks)})"
            raise PerWorkerDataError(f"{where}: {name} must be a list with {per}, got {got}")
    position = {r: i for i, r in enumerate(ranks)}

    def pick(value: Sequence[Any], rank: int) -> Any:
        if len(value) == world:
            return value[rank]
        if len(value) == len(groups):
            return value[tied_of[rank]]
        return value[position[rank]]

    per_args = [tuple(pick(a, r) for a in args) for r in ranks]
    per_kwargs = [{**{k: pick(v, r) for k, v in kwargs.items()}, **common} for r in ranks]
    return per_args, per_kwargs


def sharded_data(
    layout: RankLayout,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    common: dict[str, Any],
    in_sharded_axes: list[str] | None,
    replicate_on_axes: list[str] | None,
    output_is_replicated: list[str] | None,
    make_dummy_calls_to_free_axes: bool,
    where: str,
) -> tuple[list[int], list[int], PerRank]:
    """``run_all_workers_sharded_data``'s plan: the called ranks, those whose results
    count, and each called rank's arguments (a slice shared by several workers is put
    into the object store once).

    Raises:
        ValueError: no sharding, unknown axes, an axis both sharded and replicated, or
            data that is not nested to the sharded axes' sizes.
    """
    sharding = layout.sharding
    if sharding is None:
        raise ValueError(f"{where}: the group has no sharding; launch it with sharding=")
    plan = plan_sharded_call(
        sharding, in_sharded_axes, replicate_on_axes, output_is_replicated,
        make_dummy_calls_to_free_axes, where,
    )
    sizes = [sharding.get_axis_size(a) for a in in_sharded_axes or []]
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    # One object per distinct (argument, slice), shared by every worker that gets it.
    users: dict[tuple[int, tuple[int, ...]], int] = {}
    for entry in plan:
        if entry.shard is not None:
            for i in range(len(named)):
                users[(i, entry.shard)] = users.get((i, entry.shard), 0) + 1
    slices: dict[tuple[int, tuple[int, ...]], Any] = {}
    for (i, shard), count in users.items():
        name, value = named[i]
        data = pick_shard(value, shard, sizes, name, where)
        slices[(i, shard)] = share_value(data) if count > 1 else data
    per_args, per_kwargs = [], []
    n_pos = len(args)
    for entry in plan:
        if entry.shard is None:
            values = [None] * len(named)
        else:
            values = [slices[(i, entry.shard)] for i in range(len(named))]
        per_args.append(tuple(values[:n_pos]))
        per_kwargs.append({**dict(zip(kwargs, values[n_pos:], strict=True)), **common})
    ranks = [e.rank for e in plan]
    return ranks, [e.rank for e in plan if e.returns], (per_args, per_kwargs)


def share_value(value: Any) -> Any:
    """``value`` put into the object store once, for several workers to receive.

    Returns an ``ObjectRef`` (Ray resolves it back to the value when it is a top-level
    argument), or ``value`` itself when it is trivial to send (numbers, strings, None,
    refs).
    """
    if isinstance(value, _PLAIN) or isinstance(value, (ray.ObjectRef, ray.ObjectRefGenerator)):
        return value
    if isinstance(value, np.generic):
        return value
    return ray.put(value)
