"""Dispatch math for single-controller calls: cut a call's batches into per-rank chunks,
join the results, plan chunks of data that lives elsewhere, and lay out n-d meshes.

Pure: no Ray, no I/O, so every rule here is unit-tested alone. The verl-style worker group
(:mod:`rlcomm.single_controller`) and the NeMo-RL-style calls on
:class:`~rlcomm.worker.group.WorkerGroup` build on it. What a batch is, and how one is
split, padded and joined, is in :mod:`rlcomm.worker.batch`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcomm.worker.batch import (
    batch_kind,
    batch_len,
    concat_batches,
    is_batch,
    pad_amount,
    split_batch,
    split_sizes,
    strip_padding,
)

__all__ = [
    "MeshTable",
    "MeshRegisteredError",
    "NdLayout",
    "check_signature",
    "chunk_ranges",
    "collect_batches",
    "nd_layout",
    "plan_part_fetch",
    "split_call_args",
]


# -- whole calls ---------------------------------------------------------------------------


def check_signature(cls: type, method: str, args: Sequence[Any], kwargs: dict[str, Any], where: str) -> None:
    """Check that ``cls.method(*args, **kwargs)`` binds, before anything runs remotely.

    A method that carries ``_rlcomm_user_signature`` (set by ``@register``, whose
    wrapper accepts hidden keywords) is checked against that signature.

    Raises:
        AttributeError: ``cls`` has no method ``method``.
        TypeError: the arguments do not fit its signature (the message names ``where``).
    """
    static = None
    for klass in cls.__mro__:
        if method in klass.__dict__:
            static = klass.__dict__[method]
            break
    if static is None or not callable(getattr(cls, method, None)):
        raise AttributeError(f"{where}: {cls.__name__} has no method {method!r}")
    fn = getattr(cls, method)
    try:
        # A method wrapped by ``@register`` keeps the user's own signature here.
        sig = getattr(fn, "_rlcomm_user_signature", None) or inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        if isinstance(static, (staticmethod, classmethod)):
            sig.bind(*args, **kwargs)
        else:
            sig.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{where}: wrong arguments: {exc}") from None



def split_call_args(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    parts: int,
    pad: bool = False,
    where: str = "dispatch",
) -> tuple[list[tuple], list[dict[str, Any]], int]:
    """Split every batch argument of a call into ``parts`` chunks; copy the others.

    Args:
        args: the call's positional arguments.
        kwargs: the call's keyword arguments.
        parts: the number of chunks (ranks or data-parallel groups).
        pad: pad the batches to a multiple of ``parts``.
        where: names the method and dispatch mode in error messages.

    Returns:
        ``(args_per_chunk, kwargs_per_chunk, pad)``.

    Raises:
        ValueError: batch arguments with different lengths.
    """
    named = [(f"argument {i}", v) for i, v in enumerate(args)] + list(kwargs.items())
    lengths = {}
    for name, value in named:
        if is_batch(value):
            try:
                lengths[name] = batch_len(value)
            except ValueError as exc:
                raise ValueError(f"{where}: {name}: {exc}") from None
    known = {n for n in lengths.values() if n is not None}
    if len(known) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in lengths.items())
        raise ValueError(
            f"{where}: the batch arguments have different lengths ({shown}); every argument "
            "that is split across ranks must have the same batch size"
        )
    used_pad = 0
    split: dict[str, list[Any]] = {}
    for name, value in named:
        if name in lengths:
            split[name], added = split_batch(value, parts, pad=pad)
            used_pad = max(used_pad, added)
    args_out = [
        tuple(split[f"argument {i}"][c] if f"argument {i}" in split else v for i, v in enumerate(args))
        for c in range(parts)
    ]
    kwargs_out = [
        {k: split[k][c] if k in split else v for k, v in kwargs.items()} for c in range(parts)
    ]
    return args_out, kwargs_out, used_pad


def collect_batches(outputs: Sequence[Any], pad: int = 0) -> Any:
    """Join per-rank outputs into one batch and strip ``pad`` items from its end.

    Outputs that are not batches of one kind (numbers, ``None``, dicts of scalars) come
    back as the list of outputs, unchanged.
    """
    outputs = list(outputs)
    if not outputs or not all(is_batch(o) for o in outputs):
        return outputs
    if len({batch_kind(o) for o in outputs}) > 1:
        return outputs
    return strip_padding(concat_batches(outputs), pad)


# -- chunks of data that lives elsewhere (driver-free chaining) ----------------------------


def chunk_ranges(total: int, parts: int, index: int, pad: bool = False) -> list[tuple[int, int]]:
    """Which items of a ``total``-item batch make up chunk ``index`` of ``parts``.

    With ``pad`` the batch is first extended by copies of its first items (see
    :func:`pad_batch`), so ranges past the end wrap to the start.

    Returns:
        Half-open ``(start, stop)`` ranges over the original items, in order.
    """
    if not 0 <= index < parts:
        raise ValueError(f"chunk_ranges: index {index} not in 0..{parts - 1}")
    padded = total + (pad_amount(total, parts) if pad else 0)
    sizes = split_sizes(padded, parts)
    start = sum(sizes[:index])
    stop = start + sizes[index]
    ranges: list[tuple[int, int]] = []
    pos = start
    while pos < stop:
        if pos < total:
            end = min(stop, total)
            ranges.append((pos, end))
        else:
            off = (pos - total) % total
            end = pos + min(stop - pos, total - off)
            ranges.append((off, off + end - pos))
        pos = end
    return ranges


def plan_part_fetch(
    part_lengths: Sequence[int], ranges: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """Map ranges over a concatenation of parts onto the parts themselves.

    Args:
        part_lengths: the length of each part, in order.
        ranges: half-open ranges over the concatenated parts.

    Returns:
        ``(part_index, start, stop)`` triples in order; only parts that overlap a range
        appear, so a reader fetches just those.
    """
    offsets = np.cumsum([0, *part_lengths]).tolist()
    total = offsets[-1]
    plan = []
    for start, stop in ranges:
        if not 0 <= start <= stop <= total:
            raise ValueError(f"plan_part_fetch: range {start}:{stop} outside 0:{total}")
        for i, length in enumerate(part_lengths):
            lo, hi = max(start, offsets[i]), min(stop, offsets[i] + length)
            if lo < hi:
                plan.append((i, lo - offsets[i], hi - offsets[i]))
    return plan


# -- n-d meshes: which data-parallel chunk each rank gets, who returns it ------------------


@dataclass(frozen=True)
class NdLayout:
    """How a mesh dispatches: per rank its data-parallel index, and the collecting ranks.

    Attributes:
        dp_size: the number of data-parallel chunks.
        dp_rank_of: the data-parallel index of every rank, by rank.
        collect_ranks: the ranks whose outputs are returned, ordered by (dp index, rank).
    """

    dp_size: int
    dp_rank_of: tuple[int, ...]
    collect_ranks: tuple[int, ...]

    def ranks_of_dp(self, dp_rank: int) -> list[int]:
        return [r for r, d in enumerate(self.dp_rank_of) if d == dp_rank]


def nd_layout(infos: Sequence[tuple[int, bool]], mesh_name: str = "mesh") -> NdLayout:
    """Build a :class:`NdLayout` from every rank's ``(dp_rank, is_collect)``.

    Raises:
        ValueError: a negative dp rank, a dp index between 0 and the largest one that no
            rank holds, or no collecting rank.
    """
    if not infos:
        raise ValueError(f"mesh {mesh_name!r}: no ranks")
    dp = [int(d) for d, _ in infos]
    if min(dp) < 0:
        raise ValueError(f"mesh {mesh_name!r}: negative dp rank in {dp}")
    dp_size = max(dp) + 1
    missing = sorted(set(range(dp_size)) - set(dp))
    if missing:
        raise ValueError(
            f"mesh {mesh_name!r}: no rank registered dp ranks {missing} (dp ranks by rank: {dp})"
        )
    collect = sorted((d, r) for r, (d, c) in enumerate(infos) if c)
    if not collect:
        raise ValueError(f"mesh {mesh_name!r}: no rank registered is_collect=True")
    return NdLayout(dp_size, tuple(dp), tuple(r for _, r in collect))


class MeshRegisteredError(ValueError, AssertionError):
    """A mesh name registered twice on one worker.

    A ``ValueError`` (what verl's ``_register_dispatch_collect_info`` raises) and an
    ``AssertionError`` (what verl's ``set_dispatch_collect`` raises), so code that
    catches either keeps working.
    """


class MeshTable:
    """The per-mesh dispatch and collect information a worker registers about itself:
    ``mesh name -> (dp_rank, is_collect)``. A :class:`~rlcomm.Worker` holds one (made on
    first use) and answers verl's calls from it."""

    __slots__ = ("_meshes",)

    def __init__(self) -> None:
        self._meshes: dict[str, tuple[int, bool]] = {}

    def __repr__(self) -> str:
        return f"MeshTable({self._meshes!r})"

    def register(self, mesh_name: str, dp_rank: int, is_collect: bool, where: str = "") -> None:
        """Record ``(dp_rank, is_collect)`` for ``mesh_name``.

        Raises:
            MeshRegisteredError: ``mesh_name`` was registered already.
        """
        if mesh_name in self._meshes:
            what = f"mesh {mesh_name!r} is registered already on this worker"
            if where:
                what = f"{where}: {what} (registered: {sorted(self._meshes)})"
            raise MeshRegisteredError(what)
        self._meshes[mesh_name] = (int(dp_rank), bool(is_collect))

    def get(self, mesh_name: str) -> tuple[int, bool] | None:
        """``(dp_rank, is_collect)`` registered for ``mesh_name``, or ``None``."""
        return self._meshes.get(mesh_name)

    def dispatch_collect(self) -> dict[str, dict[str, Any]]:
        """verl's form of every registered mesh (a copy)."""
        return {
            "dispatch_dp_rank": {m: info[0] for m, info in self._meshes.items()},
            "collect_dp_rank": {m: info[1] for m, info in self._meshes.items()},
        }
