"""Where the keys of a distributed channel live.

A distributed channel runs one channel worker per node (rank ``r`` on node ``r``). The
routing rule:

- Every key lives on exactly one channel worker, its *home*, for the channel's
  lifetime, so all items of a key are in one queue and stay FIFO.
- The home of a key is the channel worker on the node of the first client process that
  puts or gets that key (node 0's worker when no channel worker runs on that node).
- The node-0 channel worker (the *coordinator*) records the homes. A client process asks
  it once per key (one rlcomm request) and caches the answer; later calls go straight
  to the home. ``qsize`` / ``empty`` / ``full`` of a key no one has put or got yet
  report an empty key without choosing a home.

So a producer and a consumer of a key that run on one node only ever talk to that
node's channel worker, and the items never leave the node. Keys used from several nodes
cost a cross-node hop for every client not on the key's home node; when keys are spread
at random over nodes, a non-distributed channel is simpler and no slower.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import ray

from rlcomm.channel.client import cached_link, link_to
from rlcomm.channel.protocol import NO_REPLY, Key, Route
from rlcomm.channel.requester import ChannelLink
from rlcomm.comm.options import default_timeout

#: Seconds a client waits for a reply beyond the request's own timeout (the channel
#: worker answers a timed-out request itself; this only catches a worker that hangs).
REPLY_GRACE = 30.0


class HomeTable:
    """The coordinator's record of key homes. Thread-safe."""

    def __init__(self) -> None:
        self._homes: dict[Key, int] = {}
        self._lock = threading.Lock()

    def home(self, key: Key, proposed: int) -> int:
        """The home rank of ``key``; ``proposed`` becomes it if there is none and
        ``proposed >= 0``; ``-1`` if the key has none and ``proposed`` is negative."""
        with self._lock:
            rank = self._homes.get(key)
            if rank is None and proposed >= 0:
                rank = self._homes[key] = proposed
            return -1 if rank is None else rank

    def snapshot(self) -> dict[Key, int]:
        with self._lock:
            return dict(self._homes)


class RouteCache:
    """A client process's cached key homes for one distributed channel.

    Args:
        node_ids: the Ray node id of each channel worker, by rank.
        my_node_id: this process's Ray node id.
    """

    def __init__(self, node_ids: Sequence[str], my_node_id: str):
        ids = list(node_ids)
        #: The rank this process proposes as a new key's home: its own node's worker.
        self.local_rank = ids.index(my_node_id) if my_node_id in ids else 0
        self._homes: dict[Key, int] = {}

    def get(self, key: Key) -> int | None:
        return self._homes.get(key)

    def remember(self, key: Key, rank: int) -> None:
        self._homes[key] = rank


class KeyRouter:
    """Which requester serves a key of one channel, for one handle.

    A non-distributed channel has one worker; a distributed one asks the coordinator for
    a key's home once (a ``Route`` request) and caches it (:class:`RouteCache`). A local
    channel's own link serves every key.

    Args:
        info: the channel's :class:`~rlcomm.channel.lifecycle.ChannelInfo`.
        local: the link of a local channel, else ``None``.
    """

    def __init__(self, info: Any, local: ChannelLink | None):
        self._info = info
        self._local = local
        self._routes: RouteCache | None = None

    def link(self, rank: int) -> ChannelLink:
        info = self._info
        return link_to(info.name, info.maxsize, info.group_name, rank, info.incarnation)

    def home(self, key: Key, assign: bool) -> int:
        """The home rank of ``key`` (asked of the coordinator once); -1 when it has none
        and ``assign`` is False."""
        routes = self._route_cache()
        rank = routes.get(key)
        if rank is not None:
            return rank
        coordinator = self.link(0)
        req = Route(NO_REPLY, key, routes.local_rank if assign else -1)
        rank = coordinator.request(req, default_timeout() + REPLY_GRACE).wait()
        if rank >= 0:
            routes.remember(key, rank)
        return rank

    def requester(self, key: Key, assign: bool = True) -> ChannelLink | None:
        """The requester that serves ``key`` (``None`` only for an unrouted key with
        ``assign=False``)."""
        if self._local is not None:
            return self._local
        if not self._info.distributed:
            return self.link(0)
        rank = self.home(key, assign)
        return None if rank < 0 else self.link(rank)

    async def arequester(self, key: Key) -> ChannelLink:
        """:meth:`requester`, off the event loop when it has to set something up."""
        if self._local is not None:
            return self._local
        info = self._info
        rank = 0 if not info.distributed else (self._routes.get(key) if self._routes else None)
        if rank is not None:
            link = cached_link(info.group_name, rank, info.incarnation)
            if link is not None:
                return link
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.requester, key)

    def all(self) -> list[ChannelLink]:
        """Every requester of the channel (one per worker)."""
        if self._local is not None:
            return [self._local]
        return [self.link(r) for r in range(len(self._info.node_ids))]

    def _route_cache(self) -> RouteCache:
        if self._routes is None:
            self._routes = RouteCache(self._info.node_ids, ray.get_runtime_context().get_node_id())
        return self._routes
