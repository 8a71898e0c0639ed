"""``Channel``: a named, typed, bounded queue of items per key, shared by workers.

A channel is held by a channel worker (:class:`~rlcomm.channel.actor.ChannelActor`, one
per node when ``distributed=True``); every process that uses it talks to that worker
with rlcomm messages, so items, and the tensors inside them, travel over the same
transports as ``Worker.send`` (raw tensor memory, never Ray's pickling). See
:mod:`rlcomm.channel.state` for the queue rules and :mod:`rlcomm.channel.routing` for
where a distributed channel's keys live.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray

from rlcomm.channel import lifecycle
from rlcomm.channel import protocol as P
from rlcomm.channel.client import LocalLink, Requester, RequestFuture, cached_link, link_to
from rlcomm.channel.itemtype import check_item, describe_type, validate_type
from rlcomm.channel.lifecycle import ChannelInfo
from rlcomm.channel.routing import RouteCache
from rlcomm.cluster import Cluster
from rlcomm.comm.options import default_timeout
from rlcomm.comm.work import AsyncWork
from rlcomm.errors import (
    ChannelClosedError,
    ChannelError,
    ChannelTypeError,
    CommTimeoutError,
)

#: Seconds a client waits for a reply beyond the request's own timeout (the channel
#: worker answers a timed-out request itself; this only catches a worker that hangs).
REPLY_GRACE = 30.0

# The local channels of this process, by name.
_local_channels: dict[str, Channel] = {}
_local_lock = threading.Lock()


class Channel:
    """A handle on a channel: a named queue of items per key.

    Create one with :meth:`create` (or ``Worker.create_channel``) and reach it from any
    process with :meth:`connect` (``Worker.connect_channel``), or pass the handle itself
    to a worker method: it pickles to the channel's name and layout and reconnects on
    first use in the receiving process. One handle may be used by many threads and
    asyncio tasks at once.

    Semantics, per key (a channel holds independent queues, one per key):

    - ``put`` returns once the channel worker accepted the item; with ``maxsize > 0`` a
      put on a key holding ``maxsize`` items waits until a get makes room
      (backpressure). Items of one producer keep their order; every item put is got
      exactly once, however many producers and consumers share the key.
    - ``get`` waits for an item; ``get_batch(target_weight)`` waits until the queued
      items' weights reach ``target_weight`` and returns them in one reply (one round
      trip for many items). Waiting gets are served in arrival order.
    - ``close()``: waiting and later puts raise :class:`~rlcomm.ChannelClosedError`;
      gets drain what is queued (a waiting ``get_batch`` gets the rest as a partial
      batch), then raise :class:`~rlcomm.ChannelClosedError`; ``stream()`` ends.
    - Every blocking call takes a ``timeout`` (default: rlcomm's default op timeout,
      see :func:`~rlcomm.set_default_timeout`) and raises
      :class:`~rlcomm.CommTimeoutError` (a ``TimeoutError``) when it runs out: a
      timed-out put was not enqueued, a timed-out get took nothing.
    - If a channel worker dies, every waiting and later call that needs it raises
      :class:`~rlcomm.ChannelLostError`; its queued items are lost. If a client process
      dies, its waiting requests are dropped once its connection breaks; a reply that
      cannot be delivered puts its items back at the head of their key, but an item the
      dead process had already received is gone with it.

    Items may be any picklable object; tensors in them (a tensor, lists, tuples and
    ``str``-keyed dicts of them, dataclasses holding them) travel as raw memory. A
    dataclass item must be defined at module level of an importable module. Items of a
    ``local=True`` channel are handed over as they are (no copy).

    The channel workers live as long as the process that created the channel (Ray
    ownership); :meth:`shutdown` ends them earlier.
    """

    def __init__(self, info: ChannelInfo, local_link: LocalLink | None = None):
        self._info = info
        self._local = local_link
        self._routes: RouteCache | None = None

    # -- creation and lookup ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        channel_name: str,
        maxsize: int = 0,
        distributed: bool = False,
        node_rank: int = 0,
        local: bool = False,
        item_type: Any = None,
        cluster: Cluster | None = None,
    ) -> Channel:
        """Create a channel and return a handle on it.

        Args:
            channel_name: a name unique among the live channels (no ``:``).
            maxsize: the most items queued *per key*; 0 (default) for unbounded.
            distributed: one channel worker per node; each key lives on the node of the
                first process that uses it (see :mod:`rlcomm.channel.routing`), so a
                producer and a consumer on one node stay on that node.
            node_rank: the node of the channel worker (not with ``distributed``).
            local: an in-process channel without a worker, for pipelines inside one
                process; it cannot be passed to or connected from another process.
            item_type: the type every item must have: a class (dataclass, msgspec
                Struct, ``torch.Tensor``, ...) or a typing form over classes
                (``list[Rollout]``, ``dict[str, torch.Tensor]``, ``X | None``). A put of
                another item raises :class:`~rlcomm.ChannelTypeError` in the producer.
            cluster: where to run the channel worker; default the Ray this process is
                attached to.

        Raises:
            ChannelError: a channel of that name exists already.
            ValueError, TypeError: bad arguments.
        """
        lifecycle.check_name(channel_name)
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 0:
            raise ValueError(f"create_channel: maxsize must be an int >= 0, got {maxsize!r}")
        if distributed and node_rank != 0:
            raise ValueError("create_channel: node_rank applies to non-distributed channels only")
        validate_type(item_type)
        if local:
            return cls._create_local(channel_name, maxsize, item_type, distributed)
        return cls(lifecycle.launch(channel_name, maxsize, distributed, node_rank, item_type,
                                    cluster))

    @classmethod
    def _create_local(cls, name: str, maxsize: int, item_type: Any, distributed: bool) -> Channel:
        if distributed:
            raise ValueError("create_channel: a local channel cannot be distributed")
        with _local_lock:
            if name in _local_channels:
                raise ChannelError(f"a local channel named {name!r} exists already in this process")
            info = ChannelInfo(name, maxsize, item_type, False, "", (), uuid.uuid4().hex[:12], True)
            channel = _local_channels[name] = cls(info, LocalLink(name, maxsize))
        return channel

    @classmethod
    def connect(cls, channel_name: str, timeout: float = 60.0) -> Channel:
        """A handle on the existing channel ``channel_name``, waiting for it to appear.

        A local channel can be connected from its own process only.

        Raises:
            ChannelError: no such channel after ``timeout`` seconds.
        """
        local = _local_channels.get(channel_name)
        if local is not None:
            return local
        return cls(lifecycle.lookup(channel_name, timeout))

    # -- properties -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._info.name

    @property
    def maxsize(self) -> int:
        """The most items queued per key (0: unbounded)."""
        return self._info.maxsize

    @property
    def item_type(self) -> Any:
        return self._info.item_type

    @property
    def distributed(self) -> bool:
        return self._info.distributed

    @property
    def local(self) -> bool:
        return self._info.local

    @property
    def worker_group_name(self) -> str:
        """The worker group of the channel workers (``channel.<name>``; "" if local)."""
        return self._info.group_name

    # -- puts -------------------------------------------------------------------------------

    def put(
        self,
        item: Any,
        weight: float = 0,
        key: P.Key = "default",
        async_op: bool = False,
        timeout: float | None = None,
    ) -> AsyncWork | None:
        """Put ``item`` on ``key``; return once the channel worker accepted it.

        Args:
            item: the item; checked against ``item_type`` first.
            weight: counts toward a consumer's ``get_batch`` target.
            key: the queue within the channel.
            async_op: return an :class:`~rlcomm.AsyncWork` (``wait()`` returns ``None``
                once the item is accepted) instead of blocking. Puts posted in a row
                travel together; do not modify the item's tensors until it is done.
            timeout: seconds to wait for room on a full key (default: rlcomm's op timeout).

        Raises:
            ChannelTypeError: the item does not match ``item_type`` (nothing enqueued).
            ChannelClosedError: the channel is or gets closed (nothing enqueued).
            CommTimeoutError: no room within ``timeout`` (nothing enqueued).
            ChannelLostError: the channel worker is gone.
            CodecError: the item cannot be encoded.
        """
        self._check_item(item, key, "put")
        t = self._timeout(timeout)
        fut = self._requester(key).submit(P.PUT, key, weight, t, item, inline=not async_op)
        return self._finish(fut, "put", key, t, async_op)

    def put_nowait(self, item: Any, weight: float = 0, key: P.Key = "default") -> None:
        """Put ``item`` on ``key`` if there is room now.

        Raises:
            ChannelFull: the key holds ``maxsize`` items (or puts are waiting for room).
            ChannelTypeError, ChannelClosedError, ChannelLostError: as for :meth:`put`.
        """
        self._check_item(item, key, "put_nowait")
        fut = self._requester(key).submit(P.PUT_NOWAIT, key, weight, None, item)
        return self._finish(fut, "put_nowait", key, default_timeout(), False)

    async def aput(
        self, item: Any, weight: float = 0, key: P.Key = "default", timeout: float | None = None
    ) -> None:
        """:meth:`put` for asyncio: never blocks the event loop (default loop or uvloop)."""
        self._check_item(item, key, "put")
        t = self._timeout(timeout)
        requester = await self._arequester(key)
        fut = requester.submit(P.PUT, key, weight, t, item, inline=False)
        await self._await(fut, "put", key, t)

    # -- gets -------------------------------------------------------------------------------

    def get(
        self, key: P.Key = "default", async_op: bool = False, timeout: float | None = None
    ) -> Any:
        """Take the next item of ``key``, waiting for one.

        Args:
            async_op: return an :class:`~rlcomm.AsyncWork` whose ``wait()`` returns the item.
            timeout: seconds to wait (default: rlcomm's op timeout).

        Raises:
            CommTimeoutError: no item within ``timeout`` (nothing taken).
            ChannelClosedError: the channel is closed and the key drained.
            ChannelLostError: the channel worker is gone.
        """
        t = self._timeout(timeout)
        fut = self._requester(key).submit(P.GET, key, None, t, None, inline=not async_op)
        return self._finish(fut, "get", key, t, async_op)

    def get_nowait(self, key: P.Key = "default") -> Any:
        """Take the next item of ``key`` if it holds one now.

        Raises:
            ChannelEmpty: the key holds no item.
            ChannelClosedError: the channel is closed and the key drained.
        """
        fut = self._requester(key).submit(P.GET_NOWAIT, key, None, None, None)
        return self._finish(fut, "get_nowait", key, default_timeout(), False)

    def get_batch(
        self,
        target_weight: float,
        key: P.Key = "default",
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Take items from the head of ``key`` until their weights sum to ``target_weight``.

        Returns them as a list, all in one reply. Waits until the key's queued weight
        reaches the target, with two exceptions: when the key holds ``maxsize`` items
        still below the target, those items are the batch; when the channel is closed,
        the remaining items are (a partial batch). Items of weight 0 count nothing.

        Args:
            target_weight: > 0.
            async_op: return an :class:`~rlcomm.AsyncWork` whose ``wait()`` returns the list.
            timeout: seconds to wait (default: rlcomm's op timeout).

        Raises:
            CommTimeoutError: not enough weight within ``timeout`` (nothing taken).
            ChannelClosedError: the channel is closed and the key drained.
            ChannelLostError: the channel worker is gone.
        """
        if not target_weight > 0:
            raise ValueError(f"get_batch: target_weight must be > 0, got {target_weight!r}")
        t = self._timeout(timeout)
        fut = self._requester(key).submit(P.GET_BATCH, key, target_weight, t, None,
                                          inline=not async_op)
        return self._finish(fut, "get_batch", key, t, async_op)

    async def aget(self, key: P.Key = "default", timeout: float | None = None) -> Any:
        """:meth:`get` for asyncio. Cancelling the awaiting task withdraws the request;
        an item already on its way goes back to the head of the key."""
        t = self._timeout(timeout)
        requester = await self._arequester(key)
        fut = requester.submit(P.GET, key, None, t, None, inline=False)
        return await self._await(fut, "get", key, t)

    async def aget_batch(
        self, target_weight: float, key: P.Key = "default", timeout: float | None = None
    ) -> list[Any]:
        """:meth:`get_batch` for asyncio (cancellation as for :meth:`aget`)."""
        if not target_weight > 0:
            raise ValueError(f"get_batch: target_weight must be > 0, got {target_weight!r}")
        t = self._timeout(timeout)
        requester = await self._arequester(key)
        fut = requester.submit(P.GET_BATCH, key, target_weight, t, None, inline=False)
        return await self._await(fut, "get_batch", key, t)

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

    # -- state ------------------------------------------------------------------------------

    def qsize(self, key: P.Key = "default") -> int:
        """The number of items queued on ``key`` now."""
        requester = self._requester(key, assign=False)
        if requester is None:
            return 0
        fut = requester.submit(P.QSIZE, key)
        return self._finish(fut, "qsize", key, default_timeout(), False)

    def empty(self, key: P.Key = "default") -> bool:
        """Whether ``key`` holds no item now."""
        return self.qsize(key) == 0

    def full(self, key: P.Key = "default") -> bool:
        """Whether ``key`` holds ``maxsize`` items now (never, for an unbounded channel)."""
        return self.maxsize > 0 and self.qsize(key) >= self.maxsize

    def peek_all(self, key: P.Key = "default") -> list[Any]:
        """The items queued on ``key`` now, head first, without taking them (RLinf's
        ``peek_all``).

        A Ray control call that copies the items out of the channel worker: for
        debugging and tests, not for the data path. ``str(channel)`` shows this list
        for the default key.
        """
        if self._local is not None:
            return self._local.core.peek(key)
        if not self._info.distributed:
            return lifecycle.worker_peek(self._info, 0, key)
        rank = self._route_cache().get(key)
        if rank is None:
            fut = self._link(0).submit(P.ROUTE, key, -1)
            rank = self._finish(fut, "route", key, default_timeout(), False)
            if rank < 0:
                return []
        return lifecycle.worker_peek(self._info, rank, key)

    def close(self) -> None:
        """Close the channel, for every key and every handle (see the class docstring).

        Idempotent. Requests this process posted before ``close`` are applied first.
        """
        futs = [(r, r.submit(P.CLOSE, "")) for r in self._all_requesters()]
        for _, fut in futs:
            self._finish(fut, "close", "", default_timeout(), False)

    async def aclose(self) -> None:
        """:meth:`close` for asyncio."""
        loop = asyncio.get_running_loop()
        requesters = await loop.run_in_executor(None, self._all_requesters)
        futs = [r.submit(P.CLOSE, "", inline=False) for r in requesters]
        for fut in futs:
            await self._await(fut, "close", "", default_timeout())

    def shutdown(self) -> None:
        """End the channel workers now (their queued items are lost) and free the name.

        Later calls on any handle raise :class:`~rlcomm.ChannelLostError`.
        """
        if self._local is not None:
            with _local_lock:
                if _local_channels.get(self.name) is self:
                    del _local_channels[self.name]
            self._local.core.stop()
            self._local.lose(ChannelClosedError(f"channel {self.name!r} was shut down"))
            return
        lifecycle.shut_down(self._info)

    def __enter__(self) -> Channel:
        """``with Channel.create(...) as ch:`` closes the channel (:meth:`close`) on exit;
        the channel worker lives on until :meth:`shutdown` or its creator's end."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Channel:
        """``async with``: closes the channel (:meth:`aclose`) on exit."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def stats(self) -> list[dict[str, Any]]:
        """Per channel worker: its node id and counters (items put and got per key).

        A Ray control call; for monitoring and tests, not for the data path.
        """
        if self._local is not None:
            return [self._local.core.stats()]
        return lifecycle.worker_stats(self._info)

    # -- pickling ---------------------------------------------------------------------------

    def __reduce__(self) -> tuple:
        if self._local is not None:
            raise ChannelError(
                f"channel {self.name!r} is local (local=True): it lives in one process and "
                "cannot be passed to another; create it without local=True to share it"
            )
        return (Channel, (self._info,))

    def __str__(self, key: P.Key = "default") -> str:
        """The items queued on ``key`` (default key), as RLinf's ``str(channel)`` shows
        them: ``str(channel.peek_all(key))``."""
        return str(self.peek_all(key))

    def __repr__(self) -> str:
        kind = "local" if self.local else "distributed" if self.distributed else "single"
        return f"Channel({self.name!r}, {kind}, maxsize={self.maxsize})"

    # -- internals --------------------------------------------------------------------------

    def _check_item(self, item: Any, key: P.Key, op: str) -> None:
        if not isinstance(key, str | int) or isinstance(key, bool):
            raise TypeError(f"channel {self.name!r}: a key must be a str or an int, got {key!r}")
        tp = self._info.item_type
        if tp is None:
            return
        problem = check_item(item, tp)
        if problem is not None:
            raise ChannelTypeError(
                f"channel {self.name!r}: {op} on key {key!r}: expected an item of type "
                f"{describe_type(tp)}, but {problem}; nothing was enqueued"
            )

    @staticmethod
    def _timeout(timeout: float | None) -> float:
        if timeout is None:
            return default_timeout()
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        return float(timeout)

    def _link(self, rank: int) -> Requester:
        info = self._info
        return link_to(info.name, info.maxsize, info.group_name, rank, info.incarnation)

    def _requester(self, key: P.Key, assign: bool = True) -> Requester:
        """The requester that serves ``key`` (``None`` only for an unrouted key with
        ``assign=False``)."""
        if self._local is not None:
            return self._local
        if not self._info.distributed:
            return self._link(0)
        routes = self._route_cache()
        rank = routes.get(key)
        if rank is None:
            fut = self._link(0).submit(P.ROUTE, key, routes.local_rank if assign else -1)
            rank = self._finish(fut, "route", key, default_timeout(), False)
            if rank < 0:
                return None  # type: ignore[return-value]
            routes.remember(key, rank)
        return self._link(rank)

    async def _arequester(self, key: P.Key) -> Requester:
        """:meth:`_requester`, off the event loop when it has to set something up."""
        if self._local is not None:
            return self._local
        info = self._info
        rank = 0 if not info.distributed else (self._routes.get(key) if self._routes else None)
        if rank is not None:
            link = cached_link(info.group_name, rank, info.incarnation)
            if link is not None:
                return link
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._requester, key)

    def _route_cache(self) -> RouteCache:
        if self._routes is None:
            self._routes = RouteCache(self._info.node_ids, ray.get_runtime_context().get_node_id())
        return self._routes

    def _all_requesters(self) -> list[Requester]:
        if self._local is not None:
            return [self._local]
        return [self._link(r) for r in range(len(self._info.node_ids))]

    def _finish(
        self, fut: RequestFuture, op: str, key: P.Key, timeout: float, async_op: bool
    ) -> Any:
        wait = timeout + REPLY_GRACE
        if async_op:
            return AsyncWork(fut, f"channel {self.name!r}: {op} on key {key!r}", wait)
        try:
            if not fut.requester.wait_reply(fut, wait):
                raise concurrent.futures.TimeoutError
            return fut.result(0)
        except CommTimeoutError:  # the op's own timeout (a TimeoutError too, since 3.11)
            raise
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise CommTimeoutError(
                f"channel {self.name!r}: {op} on key {key!r}: the channel worker did not "
                f"answer within {wait}s"
            ) from None
        except BaseException:
            # Interrupted (KeyboardInterrupt, ...): withdraw the request so that no item
            # goes to a caller that stopped waiting. A no-op when the op itself failed.
            fut.cancel()
            raise

    async def _await(
        self, fut: concurrent.futures.Future, op: str, key: P.Key, timeout: float
    ) -> Any:
        wait = timeout + REPLY_GRACE
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), wait)
        except CommTimeoutError:
            raise
        except asyncio.TimeoutError:
            raise CommTimeoutError(
                f"channel {self.name!r}: {op} on key {key!r}: the channel worker did not "
                f"answer within {wait}s"
            ) from None
