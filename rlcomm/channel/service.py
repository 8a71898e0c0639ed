"""``ChannelService``: the data plane of one channel worker.

The :class:`~rlcomm.channel.actor.ChannelActor` (a Ray actor) holds one and hands it the
control calls; everything per message happens here, in a plain object: Ray wraps every
method of an actor class for tracing, a cost no per-message call should pay.

Threads, all owned here:

- one *selector* thread (:class:`~rlcomm.comm.selector.Selector`) reads the request
  messages of every client process on this node (shared memory) and applies them to the
  :class:`~rlcomm.channel.core.ChannelCore`; it never waits on a queue's state (a get on
  an empty key is parked, not waited for). One thread waiting on all clients at once
  spins once, not once per client. A client on another node (Gloo) is read by its
  connection's receiver thread, which applies its requests the same way;
- the core's *timer* thread, which answers parked requests at their deadlines;
- replies go out through one :class:`~rlcomm.channel.outbox.Outbox` per client, sent by
  whichever thread produced them (a put from client A read on the selector thread sends
  the item to the client B whose get it completes).

A reply that cannot be delivered (its client died) puts the items it carried back at
the head of their key, and the client's parked requests are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

from rlcomm.channel import protocol as P
from rlcomm.channel.client import LISTEN_OPTIONS, SEND_OPTIONS
from rlcomm.channel.core import ChannelCore
from rlcomm.channel.outbox import Outbox
from rlcomm.channel.routing import HomeTable
from rlcomm.channel.state import Delivery
from rlcomm.comm.connection import Connection
from rlcomm.comm.manager import CommManager, parse_address
from rlcomm.comm.options import op_timeout
from rlcomm.comm.selector import Selector
from rlcomm.errors import CodecError, CommError
from rlcomm.worker.address import WorkerAddress

logger = logging.getLogger(__name__)


class ChannelService:
    """The queues of one channel worker and their clients (see the module docstring).

    Args:
        channel_name: the channel's name.
        maxsize: items per key; 0 for unbounded.
        coordinator: whether this worker keeps the home table of a distributed channel.
        where: names this worker in messages.
    """

    def __init__(self, channel_name: str, maxsize: int, coordinator: bool, where: str):
        self._channel_name = channel_name
        self._where = where
        self._manager = CommManager.current()
        self.core = ChannelCore(channel_name, maxsize, self._deliver)
        self._lock = threading.Lock()
        self._selector = Selector(f"rlcomm-channel-{channel_name}")
        self._listening: dict[WorkerAddress, Connection | None] = {}
        self._registrations: dict[WorkerAddress, int] = {}
        self._outboxes: dict[Hashable, Outbox] = {}
        self.homes = HomeTable() if coordinator else None

    def register_client(self, client: str) -> None:
        """Start reading request messages from the process at address ``client``."""
        address = parse_address(client)
        with self._lock:
            self._registrations[address] = self._registrations.get(address, 0) + 1
            if address in self._listening:
                return  # it reads on, also after a reconnect (see _lost)
            self._listening[address] = None
        try:
            self._listen(address)
        except BaseException:
            with self._lock:
                self._listening.pop(address, None)
            raise

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._listening)

    def _listen(self, address: WorkerAddress) -> None:
        with self._lock:
            seen = self._registrations.get(address, 0)
        conn = self._manager.listen(
            address,
            lambda env: self._on_message(address, env),
            lambda exc: self._lost(address, seen, exc),
            LISTEN_OPTIONS,
        )
        with self._lock:
            if address in self._listening:
                self._listening[address] = conn
        self._selector.add(conn)

    def _on_message(self, client: WorkerAddress, env: Any) -> None:
        """Apply the requests of one message of ``client`` (on the thread that read it)."""
        message = P.unpack(env)
        if message is None:
            logger.error("channel %r: unexpected %s message from %s; dropped",
                         self._channel_name, type(env).__name__, client)
            return
        heads, items = message
        if any(h[0] == P.ROUTE for h in heads):
            heads, items = self._route(client, heads, items)
        if heads:
            self.core.handle(client, heads, items)

    def _lost(self, client: WorkerAddress, seen: int, exc: CommError) -> None:
        """The connection with ``client`` (listened at registration ``seen``) failed."""
        self.core.drop_client(client)
        with self._lock:
            if self._registrations.get(client, 0) == seen:
                self._listening.pop(client, None)
                self._outboxes.pop(client, None)
                # A client process that ended is part of every normal shutdown.
                logger.debug("channel %r: client %s is gone (%s)", self._channel_name, client, exc)
                return
        # A new process at the same address (a restarted worker) registered while this
        # one still read the old connection: listen to the new one (not on this thread,
        # which may hold the manager's lock).
        logger.info("channel %r: client %s reconnected", self._channel_name, client)
        threading.Thread(target=self._relisten, args=(client,), daemon=True,
                         name=f"rlcomm-channel-relisten-{client}").start()

    def _relisten(self, client: WorkerAddress) -> None:
        try:
            self._listen(client)
        except CommError as exc:
            with self._lock:
                self._listening.pop(client, None)
            logger.warning("channel %r: cannot listen to reconnected client %s: %s",
                           self._channel_name, client, exc)

    def _route(
        self, client: WorkerAddress, heads: list[tuple], items: list[Any]
    ) -> tuple[list[tuple], list[Any]]:
        """Answer the ``ROUTE`` requests of a message; return the other requests."""
        replies: list[Delivery] = []
        rest_heads, rest_items = [], []
        for head, item in zip(heads, items, strict=True):
            op, rid, key, proposed, _ = head
            if op != P.ROUTE:
                rest_heads.append(head)
                rest_items.append(item)
            elif self.homes is None:
                text = (f"channel {self._channel_name!r}: route of key {key!r} asked of "
                        f"{self._where}, which is not the coordinator")
                replies.append((client, (rid, P.ERROR, None), text, None))
            else:
                replies.append((client, (rid, P.OK, None), self.homes.home(key, proposed), None))
        self._deliver(client, replies)
        return rest_heads, rest_items

    def _outbox(self, client: Hashable) -> Outbox:
        outbox = self._outboxes.get(client)
        if outbox is None:
            with self._lock:
                outbox = self._outboxes.get(client)
                if outbox is None:
                    address: WorkerAddress = client  # type: ignore[assignment]
                    outbox = self._outboxes[client] = Outbox(
                        lambda batch: self._send(address, batch),
                        lambda batch, exc: self._undeliverable(address, batch, exc),
                    )
        return outbox

    def _deliver(self, client: Hashable, deliveries: list[Delivery]) -> None:
        self._outbox(client).post(deliveries, inline=True)

    def _send(self, client: WorkerAddress, batch: list[Delivery]) -> None:
        message = P.pack([d[1] for d in batch], [d[2] for d in batch])
        conn = self._listening.get(client)
        if conn is not None and conn.error is None:
            conn.send_message(message, op_timeout(SEND_OPTIONS))
        else:  # not listened yet, or reconnecting
            self._manager.send(message, client, False, SEND_OPTIONS)

    def _undeliverable(self, client: WorkerAddress, batch: list[Delivery], exc: BaseException) -> None:
        if isinstance(exc, CodecError):  # re-encoding a decoded item failed: answer, drop it
            logger.error("channel %r: a reply to %s cannot be encoded: %s",
                         self._channel_name, client, exc)
            rid = batch[0][1][0]
            self._deliver(client, [(client, (rid, P.ERROR, None), f"channel "
                                    f"{self._channel_name!r}: the reply cannot be encoded: {exc}",
                                    None)])
            return
        logger.warning("channel %r: replies to %s could not be sent (%s); their items go "
                       "back to their keys", self._channel_name, client, exc)
        for _, _, _, requeue in batch:
            if requeue is not None:
                self.core.requeue(*requeue)
        self.core.drop_client(client)
