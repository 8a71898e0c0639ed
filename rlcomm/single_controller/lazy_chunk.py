"""Chunks of another call's output, fetched by the worker that needs them.

When the non-blocking result of one group's DP call is passed to another group's DP
call, the driver sends each receiving worker a :class:`LazyChunk` instead of data: the
object refs of the source outputs and of their lengths, and which chunk it is. The
worker reads the lengths, fetches only the outputs that overlap its chunk, and cuts the
chunk out. ``@register`` methods resolve lazy chunks before the user's code runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from rlcomm.worker.batch import concat_batches, take_range
from rlcomm.worker.dispatch import chunk_ranges, plan_part_fetch
from rlcomm.worker.result import default_call_timeout

__all__ = ["LazyChunk", "resolve_lazy", "resolve_lazy_async"]


@dataclass
class LazyChunk:
    """Chunk ``index`` of ``num_chunks`` of another call's concatenated output.

    Sent in place of data when a non-blocking DP result is passed to a DP call: the
    receiving worker reads the parts' lengths, then fetches only the parts that overlap
    its chunk. The driver never fetches the data. Fetches wait at most
    ``RLCOMM_CALL_TIMEOUT`` seconds.
    """

    parts: list[Any]  # ObjectRefs of the source's collected outputs, in order
    lengths: list[Any]  # ObjectRefs of their batch lengths
    strip: int  # padding items at the end of the source's concatenation
    index: int
    num_chunks: int
    pad: bool
    source: str

    def _plan(self, lengths: list[int | None]) -> list[tuple[int, int, int]]:
        bad = [i for i, n in enumerate(lengths) if n is None]
        if bad:
            raise TypeError(f"{self.source}: the outputs of parts {bad} are not batches; cannot split them")
        total = sum(lengths) - self.strip  # type: ignore[arg-type]
        plan = plan_part_fetch(lengths, chunk_ranges(total, self.num_chunks, self.index, self.pad))  # type: ignore[arg-type]
        return plan or [(0, 0, 0)]  # an empty chunk still needs a part to take its kind from

    def _assemble(self, plan: list[tuple[int, int, int]], fetched: dict[int, Any]) -> Any:
        pieces = [take_range(fetched[i], a, b) for i, a, b in plan]
        return pieces[0] if len(pieces) == 1 else concat_batches(pieces)

    def resolve(self) -> Any:
        """Fetch the overlapping parts (blocking) and cut this chunk out of them."""
        timeout = default_call_timeout()
        plan = self._plan(ray.get(self.lengths, timeout=timeout))
        needed = sorted({i for i, _, _ in plan})
        values = ray.get([self.parts[i] for i in needed], timeout=timeout)
        return self._assemble(plan, dict(zip(needed, values, strict=True)))

    async def resolve_async(self) -> Any:
        """Like :meth:`resolve`, awaiting instead of blocking the event loop."""
        timeout = default_call_timeout()
        plan = self._plan(list(await asyncio.wait_for(asyncio.gather(*self.lengths), timeout)))
        needed = sorted({i for i, _, _ in plan})
        values = await asyncio.wait_for(asyncio.gather(*(self.parts[i] for i in needed)), timeout)
        return self._assemble(plan, dict(zip(needed, values, strict=True)))


def resolve_lazy(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every top-level :class:`LazyChunk` fetched (blocking)."""
    if not any(isinstance(a, LazyChunk) for a in (*args, *kwargs.values())):
        return args, kwargs
    return (
        tuple(a.resolve() if isinstance(a, LazyChunk) else a for a in args),
        {k: v.resolve() if isinstance(v, LazyChunk) else v for k, v in kwargs.items()},
    )


async def resolve_lazy_async(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Like :func:`resolve_lazy`, awaiting the fetches."""
    if not any(isinstance(a, LazyChunk) for a in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple([await a.resolve_async() if isinstance(a, LazyChunk) else a for a in args])
    kwargs = {k: await v.resolve_async() if isinstance(v, LazyChunk) else v for k, v in kwargs.items()}
    return args, kwargs
