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
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rlcomm.channel import lifecycle, local
from rlcomm.channel import protocol as P
from rlcomm.channel.client import settle_all
from rlcomm.channel.itemtype import check_put, validate_type
from rlcomm.channel.lifecycle import ChannelInfo
from rlcomm.channel.local import LocalLink
from rlcomm.channel.prefetch import PREFETCH
from rlcomm.channel.requests import get_batch as _get_batch
from rlcomm.channel.requests import put as _put
from rlcomm.channel.requests import request as _request
from rlcomm.channel.requests import timeout_of as _timeout
from rlcomm.channel.routing import REPLY_GRACE, KeyRouter
from rlcomm.cluster import Cluster
from rlcomm.comm.options import default_timeout
from rlcomm.comm.work import AsyncWork
from rlcomm.errors import ChannelClosedError, ChannelError

__all__ = ["REPLY_GRACE", "Channel"]


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
    - Prefetch: on a channel with a worker and ``maxsize=0``, a ``get`` may bring up to
      32 more items of its key (CPU items, 16 MiB of them at most) to its process, when
      that process is the key's one consumer and no other get waits; the next gets
      there take them without a round trip (``qsize`` counts them). Items not taken
      within 50 ms go back to the head of the key. If another consumer got later items
      of the key meanwhile, it may then get those after them, and so see a producer's
      items out of order. Items on their way to a cancelled ``aget`` or to a dead
      consumer go back to the head the same way.
    - Write-behind puts: on an unbounded channel (``maxsize=0``) whose worker (the
      key's, for a distributed channel) shares this node and is reached over shared
      memory, a blocking ``put`` returns without waiting for the worker's answer (see
      :meth:`put`); :meth:`flush` waits until the worker holds them all.
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

    Every blocking call has an asyncio twin (:meth:`aput`, :meth:`aget`,
    :meth:`aget_batch`, :meth:`aclose`, :meth:`stream`, ``async with``) that never blocks
    the event loop (default loop or uvloop): requests are sent from the flush pool,
    replies are read by the connection's receiver thread, and a call awaits its
    :class:`~rlcomm.AsyncWork`. Cancelling the awaiting task withdraws the request.

    Items may be any picklable object; tensors in them (a tensor, lists, tuples and
    ``str``-keyed dicts of them, dataclasses holding them) travel as raw memory. A
    dataclass item must be defined at module level of an importable module. The producer
    encodes an item once (in ``put``, so an item that cannot be encoded raises there) and
    the consumer decodes it once; the channel worker stores and forwards it undecoded.
    Items of a ``local=True`` channel are handed over as they are (no copy).

    The channel workers live as long as the process that created the channel (Ray
    ownership); :meth:`shutdown` ends them earlier.
    """

    def __init__(self, info: ChannelInfo, local_link: LocalLink | None = None):
        self._info = info
        self._local = local_link
        self._router = KeyRouter(info, local_link)

    # -- the layout -----------------------------------------------------------------------------

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
        info = ChannelInfo(name, maxsize, item_type, False, "", (), uuid.uuid4().hex[:12], True)
        return local.register(name, lambda: cls(info, LocalLink(name, maxsize)))

    @classmethod
    def connect(cls, channel_name: str, timeout: float = 60.0) -> Channel:
        """A handle on the existing channel ``channel_name``, waiting for it to appear.

        A local channel can be connected from its own process only.

        Raises:
            ChannelError: no such channel after ``timeout`` seconds.
        """
        found = local.find(channel_name)
        if found is not None:
            return found
        return cls(lifecycle.lookup(channel_name, timeout))

    # -- puts -------------------------------------------------------------------------------

    def put(
        self,
        item: Any,
        weight: float = 0,
        key: P.Key = "default",
        async_op: bool = False,
        timeout: float | None = None,
    ) -> AsyncWork | None:
        """Put ``item`` on ``key``.

        On a channel with a bound (``maxsize`` > 0) this returns once the channel worker
        accepted the item, or raises. On an unbounded channel a channel worker never
        refuses an item for room, so ``put`` is *write-behind* where this process
        reaches the channel worker that holds ``key`` over shared memory (a worker on
        this node, an x86-64 Linux one): it returns once the item is on its way to the
        worker, applied in order after this process's earlier requests, with no round
        trip to wait for. Elsewhere (the key's worker is on another node, as a
        distributed channel's may be) a put waits for the worker's answer, as on a
        bounded channel; so does every put when ``RLCOMM_CHANNEL_WRITE_BEHIND=0`` was set
        before rlcomm was imported. ``client_stats(key)["writes_behind"]`` says which
        applies. After a write-behind put:

        - this process's later requests (``get``, ``qsize``, ``close``, ...) see it;
        - a worker method that put it returns only once the worker holds it, and a
          worker group's call starts only once this process's puts are held, so the
          caller, and every worker it calls next, see it;
        - another process told by other means (a raw Ray actor call, a file) may not
          see it yet: call :meth:`flush` first;
        - if the channel was closed before the item reached the worker, the item was
          not enqueued, and this process's next ``put`` (or ``flush``, or the end of
          the worker method) raises :class:`~rlcomm.ChannelClosedError` saying so.

        Args:
            item: the item; checked against ``item_type`` first.
            weight: counts toward a consumer's ``get_batch`` target.
            key: the queue within the channel.
            async_op: return an :class:`~rlcomm.AsyncWork` (``wait()`` returns ``None``
                once the item is accepted) instead of blocking. Puts posted in a row
                travel together; do not modify the item's tensors until it is done.
                Where puts are written behind (as above), an item without tensors is
                written behind too and its work is done at once; such puts wait a
                moment (at most about 0.2 ms) for later requests to share their
                message.
            timeout: seconds to wait for room on a full key (default: rlcomm's op timeout).

        Raises:
            ChannelTypeError: the item does not match ``item_type`` (nothing enqueued).
            ChannelClosedError: the channel is or gets closed (nothing enqueued).
            CommTimeoutError: no room within ``timeout`` (nothing enqueued).
            ChannelLostError: the channel worker is gone.
            CodecError: the item cannot be encoded.
        """
        self._check_item(item, key, "put")
        t = _timeout(timeout)
        requester = self._router.requester(key)
        return _put(requester, P.Put(P.NO_REPLY, key, weight, t, item), t, async_op)

    def put_nowait(self, item: Any, weight: float = 0, key: P.Key = "default") -> None:
        """Put ``item`` on ``key`` if there is room now.

        Raises:
            ChannelFull: the key holds ``maxsize`` items (or puts are waiting for room).
            ChannelTypeError, ChannelClosedError, ChannelLostError: as for :meth:`put`.
        """
        self._check_item(item, key, "put_nowait")
        requester = self._router.requester(key)
        req = P.Put(P.NO_REPLY, key, weight, None, item, nowait=True)
        return _put(requester, req, default_timeout(), False)

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
        t = _timeout(timeout)
        requester = self._router.requester(key)
        found, item = requester.take_prefetched(key)
        if found:
            return AsyncWork.completed(item, "get") if async_op else item
        return _request(requester, P.Get(P.NO_REPLY, key, t, prefetch=PREFETCH), t, async_op)

    def get_nowait(self, key: P.Key = "default") -> Any:
        """Take the next item of ``key`` if it holds one now.

        Raises:
            ChannelEmpty: the key holds no item.
            ChannelClosedError: the channel is closed and the key drained.
        """
        requester = self._router.requester(key)
        found, item = requester.take_prefetched(key)
        if found:
            return item
        req = P.Get(P.NO_REPLY, key, None, nowait=True)
        return _request(requester, req, default_timeout(), False)

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
        t = _timeout(timeout)
        return _get_batch(self._router.requester(key), key, target_weight, t, async_op)

    # -- asyncio ----------------------------------------------------------------------------

    async def aput(
        self, item: Any, weight: float = 0, key: P.Key = "default", timeout: float | None = None
    ) -> None:
        """:meth:`put` for asyncio: never blocks the event loop (default loop or uvloop)."""
        self._check_item(item, key, "put")
        t = _timeout(timeout)
        requester = await self._router.arequester(key)
        await _put(requester, P.Put(P.NO_REPLY, key, weight, t, item), t, True, False)

    async def aget(self, key: P.Key = "default", timeout: float | None = None) -> Any:
        """:meth:`get` for asyncio. Cancelling the awaiting task withdraws the request;
        an item already on its way goes back to the head of the key."""
        t = _timeout(timeout)
        requester = await self._router.arequester(key)
        found, item = requester.take_prefetched(key)
        if found:
            return item
        req = P.Get(P.NO_REPLY, key, t, prefetch=PREFETCH)
        return await _request(requester, req, t, True)

    async def aget_batch(
        self, target_weight: float, key: P.Key = "default", timeout: float | None = None
    ) -> list[Any]:
        """:meth:`get_batch` for asyncio (cancellation as for :meth:`aget`)."""
        if not target_weight > 0:
            raise ValueError(f"get_batch: target_weight must be > 0, got {target_weight!r}")
        t = _timeout(timeout)
        requester = await self._router.arequester(key)
        return await _get_batch(requester, key, target_weight, t, True)

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
        works = [_request(r, P.Close(P.NO_REPLY), default_timeout(), True)
                 for r in requesters]
        for work in works:
            await work

    async def __aenter__(self) -> Channel:
        """``async with``: closes the channel (:meth:`aclose`) on exit."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- state ------------------------------------------------------------------------------

    def qsize(self, key: P.Key = "default") -> int:
        """The number of items queued on ``key`` now."""
        requester = self._router.requester(key, assign=False)
        if requester is None:
            return 0
        queued = _request(requester, P.QSize(P.NO_REPLY, key), default_timeout(), False)
        return queued + requester.prefetched(key)

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
        self.flush()
        if not self._info.distributed:
            return lifecycle.worker_peek(self._info, 0, key)
        rank = self._router.home(key, assign=False)
        return [] if rank < 0 else lifecycle.worker_peek(self._info, rank, key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the channel worker holds every item this process put without
        waiting (write-behind, see :meth:`put`), so that every other process sees them.
        Costs nothing when there are none.

        Raises:
            ChannelClosedError: one of them was not enqueued (the channel was closed
                before it arrived).
            ChannelLostError: the channel worker is gone.
            CommTimeoutError: no answer within ``timeout`` (default: rlcomm's op timeout).
        """
        if self._local is None:
            settle_all(_timeout(timeout), self.name)

    def close(self) -> None:
        """Close the channel, for every key and every handle (see the class docstring).

        Idempotent. Requests this process posted before ``close`` are applied first.
        """
        works = [_request(r, P.Close(P.NO_REPLY), default_timeout(), True)
                 for r in self._router.all()]
        for work in works:
            work.wait()

    def shutdown(self) -> None:
        """End the channel workers now (their queued items are lost) and free the name.

        Later calls on any handle raise :class:`~rlcomm.ChannelLostError`.
        """
        if self._local is not None:
            local.unregister(self.name, self)
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

    def stats(self) -> list[dict[str, Any]]:
        """Per channel worker: its node id and counters (items put and got per key).

        A Ray control call; for monitoring and tests, not for the data path.
        """
        if self._local is not None:
            return [self._local.core.stats()]
        self.flush()
        return lifecycle.worker_stats(self._info)

    def client_stats(self, key: P.Key = "default") -> dict[str, Any]:
        """What this process sees of its link to the worker that serves ``key``, without
        a Ray call or a request: ``worker`` (its address), ``lost`` (the link failed;
        requests raise ``ChannelLostError``), ``worker_gone`` (the link's connection sees
        the worker's process gone now), ``writes_behind`` (puts go without waiting for
        the worker), ``gone_checks`` (how often write-behind puts looked for a dead
        worker), ``sent_inline`` and ``sent_off`` (request messages sent from the
        caller's thread and from another), ``held`` (requests held for the next message),
        ``prefetched`` (items of ``key`` taken ahead for this process's gets). A
        distributed channel asks its coordinator for an unrouted key's home first."""
        return self._router.requester(key).stats(key)  # type: ignore[union-attr]

    def _check_item(self, item: Any, key: P.Key, op: str) -> None:
        check_put(self._info.name, self._info.item_type, item, key, op)

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
