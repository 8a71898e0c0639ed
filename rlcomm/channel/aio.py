"""The asyncio face of a :class:`~rlcomm.Channel`: ``aput``, ``aget``, ``aget_batch``,
``stream``, ``aclose`` and ``async with``.

None of them blocks the event loop (default loop or uvloop): requests are sent from the
flush pool, replies are read by the connection's receiver thread, and a call awaits its
:class:`~rlcomm.AsyncWork`. Cancelling the awaiting task withdraws the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from rlcomm.channel import protocol as P
from rlcomm.channel.prefetch import PREFETCH
from rlcomm.channel.requests import ChannelRequests
from rlcomm.comm.options import default_timeout
from rlcomm.errors import ChannelClosedError

if TYPE_CHECKING:
    from rlcomm.channel.channel import Channel


class AsyncChannelOps(ChannelRequests):
    """The asyncio methods of :class:`~rlcomm.Channel` (a mixin: they use its internals)."""

    async def aput(
        self, item: Any, weight: float = 0, key: P.Key = "default", timeout: float | None = None
    ) -> None:
        """:meth:`put` for asyncio: never blocks the event loop (default loop or uvloop)."""
        self._check_item(item, key, "put")
        t = self._timeout(timeout)
        requester = await self._router.arequester(key)
        await self._put(requester, P.Put(P.NO_REPLY, key, weight, t, item), t, True, False)

    async def aget(self, key: P.Key = "default", timeout: float | None = None) -> Any:
        """:meth:`get` for asyncio. Cancelling the awaiting task withdraws the request;
        an item already on its way goes back to the head of the key."""
        t = self._timeout(timeout)
        requester = await self._router.arequester(key)
        found, item = requester.take_prefetched(key)
        if found:
            return item
        req = P.Get(P.NO_REPLY, key, t, prefetch=PREFETCH)
        return await self._request(requester, req, t, True)

    async def aget_batch(
        self, target_weight: float, key: P.Key = "default", timeout: float | None = None
    ) -> list[Any]:
        """:meth:`get_batch` for asyncio (cancellation as for :meth:`aget`)."""
        if not target_weight > 0:
            raise ValueError(f"get_batch: target_weight must be > 0, got {target_weight!r}")
        t = self._timeout(timeout)
        requester = await self._router.arequester(key)
        return await self._get_batch(requester, key, target_weight, t, True)

    async def stream(self, key: P.Key = "default", timeout: float | None = None) -> AsyncIterator[Any]:
        """``async for item in channel.stream(key)``: the items of ``key`` until the
        channel is closed and drained.

        Args:
            timeout: seconds to wait for each item (default: rlcomm's op timeout);
                :class:`~rlcomm.CommTimeoutError` ends the iteration with an error.
        """
        while True:
            try:
                item = await self.aget(key, timeout)
            except ChannelClosedError:
                return
            yield item

    async def aclose(self) -> None:
        """:meth:`close` for asyncio."""
        loop = asyncio.get_running_loop()
        requesters = await loop.run_in_executor(None, self._router.all)
        works = [self._request(r, P.Close(P.NO_REPLY), default_timeout(), True)
                 for r in requesters]
        for work in works:
            await work

    async def __aenter__(self) -> Channel:
        """``async with``: closes the channel (:meth:`aclose`) on exit."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
