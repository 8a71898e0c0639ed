"""One call of a ``@register`` method on a worker group: dispatch, run, collect.

:class:`DispatchedMethod` is what ``group.method`` is for a registered method of a
:class:`~rlcomm.single_controller.RayWorkerGroup`; it checks the arguments on the driver,
dispatches them by the method's mode and returns the collected result, or a
:class:`DispatchFuture` for ``blocking=False`` methods.
"""

from __future__ import annotations

from typing import Any

import ray

from rlcomm.single_controller.decorator import (
    DEPENDENCY_KW_PREFIX,
    RETURN_LEN_KW,
    DispatchSpec,
    Execute,
)
from rlcomm.single_controller.lazy_chunk import LazyChunk
from rlcomm.worker.batch import batch_len, is_batch, pad_amount
from rlcomm.worker.dispatch import NdLayout, check_signature, collect_batches, split_call_args
from rlcomm.worker.result import GroupResult, default_call_timeout
from rlcomm.worker.sharded_calls import share_value

__all__ = ["DispatchFuture", "DispatchedMethod"]


class DispatchFuture(list):
    """The pending result of a non-blocking ``@register`` call: an adapter over the
    :class:`~rlcomm.AsyncWork` of the call (``get()``/``wait()``, ``done()``, ``await``).

    It is what verl returns too: a list of Ray ``ObjectRef`` objects, one per rank that
    returns output (every called rank; for mesh modes the collecting ranks), so
    ``ray.get(future)`` gives the per-rank outputs as verl's does. ``get()`` waits,
    collects (concatenates DP batches, runs a custom ``collect_fn`` on the values)
    and strips padding. Passed as an argument to another group's DP or mesh call, it
    is not fetched by the driver: each receiving worker fetches only the parts of it
    that overlap its own chunk.
    """

    def __init__(
        self,
        group: Any,
        method: str,
        where: str,
        kind: str,
        spec: DispatchSpec,
        collect_fn: Any,
        ranks: list[int],
        data_refs: list[Any],
        len_refs: list[Any] | None,
        pad: int,
        layout: NdLayout | None,
    ):
        self._group = group
        self.method = method
        self.where = where
        self._kind = kind
        self._spec = spec
        self._collect_fn = collect_fn
        self.ranks = ranks
        self.refs = data_refs
        self._len_refs = len_refs
        self.pad = pad
        self._layout = layout
        self._done = False
        self._result: Any = None
        #: The waiting: one AsyncWork over every called rank's result.
        self._work = GroupResult(group._name, method, ranks, data_refs)
        super().__init__(
            data_refs if layout is None else [data_refs[i] for i in self._collect_positions()]
        )

    # A future is one pending call, not a value: compare and hash by identity.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # type: ignore[assignment]

    def _collect_positions(self) -> list[int]:
        if self._layout is not None:
            return list(self._layout.collect_ranks)
        return list(range(len(self.ranks)))

    def chainable(self) -> bool:
        """True when this result can be passed on, chunk by chunk, to a DP call."""
        return self._kind in ("dp", "nd") and self._len_refs is not None

    def _parts(self) -> tuple[list[Any], list[Any]]:
        pos = self._collect_positions()
        return [self.refs[i] for i in pos], [self._len_refs[i] for i in pos]  # type: ignore[index]

    def total_length(self) -> int:
        """The batch size of the collected result; waits for the lengths, not the data."""
        lengths = ray.get(self._parts()[1], timeout=default_call_timeout())
        if any(n is None for n in lengths):
            raise TypeError(f"{self.where}: its outputs are not batches")
        return sum(lengths) - self.pad

    def lazy_chunk(self, index: int, num_chunks: int, pad: bool) -> LazyChunk:
        parts, lengths = self._parts()
        return LazyChunk(parts, lengths, self.pad, index, num_chunks, pad, self.where)

    def done(self) -> bool:
        """True once every called rank has finished (fetches nothing)."""
        return self._work.done()

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank, then collect (and strip padding).

        Raises:
            WorkerCallError: a rank raised or died.
            RlcommTimeoutError: not done in time.
        """
        if self._done:
            return self._result
        return self._collect(self._work.wait(timeout))

    wait = get

    async def async_wait(self, timeout: float | None = None) -> Any:
        """Like :meth:`get`, awaitable from asyncio (``await future`` works too)."""
        if self._done:
            return self._result
        return self._collect(await self._work.async_wait(timeout))

    def __await__(self):
        return self.async_wait().__await__()

    def _collect(self, outputs: list[Any]) -> Any:
        if self._spec.execute_mode is Execute.RANK_ZERO:
            out = outputs[0]
            result = self._collect_fn(self._group, out) if self._kind == "custom" else out
        elif self._kind in ("dp", "nd"):
            result = collect_batches([outputs[i] for i in self._collect_positions()], self.pad)
        else:
            result = self._collect_fn(self._group, outputs)
        self._result, self._done = result, True
        return result

    def __repr__(self) -> str:
        return f"DispatchFuture({self.where})"


class DispatchedMethod:
    """A ``@register`` method bound on a :class:`RayWorkerGroup`."""

    def __init__(self, group: Any, name: str, spec: DispatchSpec):
        self._group = group
        self._name = name
        self._spec = spec

    def __repr__(self) -> str:
        return f"<{self._group.worker_cls_name}.{self._name} [{self._spec.mode_name}]>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        g, spec = self._group, self._spec
        g._check_live()
        kind, dispatch_fn, collect_fn, mesh = spec.resolve()
        where = (
            f"{g.worker_cls_name}.{self._name}() [dispatch {spec.mode_name}, "
            f"execute {spec.execute_mode.name}]"
        )
        check_signature(g._worker_cls, self._name, args, kwargs, where)
        rank_zero = spec.execute_mode is Execute.RANK_ZERO
        ranks = [0] if rank_zero else list(range(g.world_size))
        pad, want_len, layout = 0, False, None
        if kind == "one_to_all" or (rank_zero and kind == "all_to_all"):
            args, kwargs = _whole(args, kwargs, where)
            if len(ranks) > 1:
                args = tuple(_share(a) for a in args)
                kwargs = {k: _share(v) for k, v in kwargs.items()}
            per_args, per_kwargs = [args] * len(ranks), [kwargs] * len(ranks)
        elif kind == "all_to_all":
            per_args, per_kwargs = _per_rank_lists(args, kwargs, len(ranks), f"{where}:")
        elif kind in ("dp", "dp_metric"):
            per_args, per_kwargs, pad = _split(args, kwargs, len(ranks), spec.pad, where)
            want_len = True
        elif kind == "nd":
            layout = g._mesh_layout(mesh)  # type: ignore[arg-type]
            chunk_args, chunk_kwargs, pad = _split(args, kwargs, layout.dp_size, spec.pad, where)
            if pad and any(
                sum(1 for r in layout.collect_ranks if layout.dp_rank_of[r] == d) != 1
                for d in range(layout.dp_size)
            ):
                raise ValueError(
                    f"{where}: pad=True needs exactly one collecting rank per dp index to strip "
                    "the padding"
                )
            for d in range(layout.dp_size):
                if len(layout.ranks_of_dp(d)) > 1:  # one object per chunk, shared by its ranks
                    chunk_args[d] = tuple(_share(a) for a in chunk_args[d])
                    chunk_kwargs[d] = {k: _share(v) for k, v in chunk_kwargs[d].items()}
            per_args = [chunk_args[layout.dp_rank_of[r]] for r in ranks]
            per_kwargs = [chunk_kwargs[layout.dp_rank_of[r]] for r in ranks]
            want_len = True
        else:
            d_args, d_kwargs = dispatch_fn(g, *args, **kwargs)
            name = getattr(dispatch_fn, "__name__", type(dispatch_fn).__name__)
            per_args, per_kwargs = _per_rank_lists(
                tuple(d_args), dict(d_kwargs), g.world_size, f"{where}: the output of {name}:"
            )
            if rank_zero:
                per_args, per_kwargs = per_args[:1], per_kwargs[:1]
        per_kwargs = [_with_dependencies(a, k) for a, k in zip(per_args, per_kwargs, strict=True)]
        if want_len:
            per_kwargs = [{**k, RETURN_LEN_KW: True} for k in per_kwargs]
            pairs = g._call_each(self._name, ranks, per_args, per_kwargs, num_returns=2)
            data_refs, len_refs = [p[0] for p in pairs], [p[1] for p in pairs]
        else:
            data_refs, len_refs = g._call_each(self._name, ranks, per_args, per_kwargs), None
        future = DispatchFuture(
            g, self._name, where, kind, spec, collect_fn, ranks, data_refs, len_refs, pad, layout
        )
        if spec.blocking:
            return future.get()
        if rank_zero and kind != "custom":
            return data_refs[0]  # verl's execute_rank_zero: rank 0's ObjectRef
        return future


def _share(value: Any) -> Any:
    """Put a value into the object store once for several ranks (lazy chunks stay small
    and must reach the worker as themselves)."""
    return value if isinstance(value, LazyChunk) else share_value(value)


def _with_dependencies(args: tuple, kwargs: dict) -> dict:
    """``kwargs`` plus, as top-level hidden keywords, the length refs of every lazy chunk.

    Ray starts a call only once its top-level refs exist, and a source output's length
    is created together with the output; so a worker never blocks inside a call waiting
    for another call to run (which would deadlock an async actor that runs calls out of
    order), it only fetches data that is there.
    """
    refs: dict[Any, None] = {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, LazyChunk):
            refs.update(dict.fromkeys(value.lengths))
    if not refs:
        return kwargs
    return {**kwargs, **{f"{DEPENDENCY_KW_PREFIX}{i}": ref for i, ref in enumerate(refs)}}


def _whole(args: tuple, kwargs: dict, where: str) -> tuple[tuple, dict]:
    """Futures of DP calls become whole-batch lazy chunks; other values stay."""

    def one(v: Any) -> Any:
        if isinstance(v, DispatchFuture):
            if not v.chainable():
                raise TypeError(f"{where}: the result of {v.where} cannot be passed on; pass its .get()")
            return v.lazy_chunk(0, 1, False)
        return v

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _per_rank_lists(args: tuple, kwargs: dict, world: int, where: str) -> tuple[list[tuple], list[dict]]:
    """Element ``r`` of every argument for rank ``r``; each must be a list of ``world``."""
    for name, value in [(f"argument {i}", a) for i, a in enumerate(args)] + list(kwargs.items()):
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(
                f"{where} {name} must be a list with one entry per rank ({world}), got {got}"
            )
    return (
        [tuple(a[r] for a in args) for r in range(world)],
        [{k: v[r] for k, v in kwargs.items()} for r in range(world)],
    )


def _split(
    args: tuple, kwargs: dict, parts: int, pad: bool, where: str
) -> tuple[list[tuple], list[dict], int]:
    """Split batches into ``parts`` chunks; futures of other calls become lazy chunks."""
    lazy = {
        key: v
        for key, v in [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
        if isinstance(v, DispatchFuture)
    }
    for key, fut in lazy.items():
        if not fut.chainable():
            raise TypeError(
                f"{where}: argument {key!r} is the non-blocking result of {fut.where}, which "
                "cannot be split; pass its .get()"
            )
    eager_args = tuple(None if i in lazy else a for i, a in enumerate(args))
    eager_kwargs = {k: None if k in lazy else v for k, v in kwargs.items()}
    per_args, per_kwargs, used_pad = split_call_args(eager_args, eager_kwargs, parts, pad, where)
    if not lazy:
        return per_args, per_kwargs, used_pad
    eager_lengths = {
        n for v in (*eager_args, *eager_kwargs.values()) if is_batch(v) and (n := batch_len(v)) is not None
    }
    if pad or eager_lengths:
        # The sizes must be known on the driver: wait for the lengths (not the data).
        totals = {key: fut.total_length() for key, fut in lazy.items()}
        sizes = set(totals.values()) | eager_lengths
        if len(sizes) > 1:
            raise ValueError(
                f"{where}: the batch arguments have different lengths ({totals}, others "
                f"{sorted(eager_lengths)}); every split argument must have the same batch size"
            )
        if pad and not eager_lengths:
            used_pad = pad_amount(sizes.pop(), parts)
    for c in range(parts):
        chunk_args = list(per_args[c])
        for key, fut in lazy.items():
            chunk = fut.lazy_chunk(c, parts, pad)
            if isinstance(key, int):
                chunk_args[key] = chunk
            else:
                per_kwargs[c][key] = chunk
        per_args[c] = tuple(chunk_args)
    return per_args, per_kwargs, used_pad
