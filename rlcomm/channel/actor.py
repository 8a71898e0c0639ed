"""``ChannelActor``: the worker that holds a channel's queues.

:meth:`Channel.create <rlcomm.Channel.create>` launches it as a :class:`~rlcomm.WorkerGroup`
named ``channel.<name>``: one rank on the chosen node, or one rank per node for a
distributed channel (rank ``r`` on node ``r``). Ray actor calls are its control plane
only (a client registers, ``connect`` reads the description, tests read counters); every
put, get and reply is an rlcomm message on the point-to-point layer.

Threads, all owned here:

- one *reader* thread per registered client process: receives that client's request
  messages and applies them to the :class:`~rlcomm.channel.core.ChannelCore`; it never
  waits on a queue's state (a get on an empty key is parked, not waited for);
- the core's *timer* thread, which answers parked requests at their deadlines;
- replies go out through one :class:`~rlcomm.channel.outbox.Outbox` per client, sent by
  whichever thread produced them (a put handled on client A's reader thread sends the
  item to the client B whose get it completes).

A reply that cannot be delivered (its client died) puts the items it carried back at
the head of their key, and the client's parked requests are dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any

import ray

from rlcomm.channel import protocol as P
from rlcomm.channel.client import LISTEN_OPTIONS, SEND_OPTIONS
from rlcomm.channel.core import ChannelCore
from rlcomm.channel.outbox import Outbox
from rlcomm.channel.routing import HomeTable
from rlcomm.channel.state import Delivery
from rlcomm.comm.manager import CommManager, parse_address
from rlcomm.errors import CodecError, CommError, CommTimeoutError
from rlcomm.worker.address import WorkerAddress
from rlcomm.worker.worker import Worker

logger = logging.getLogger(__name__)

#: Prefix of the worker group of a channel: the group of channel ``x`` is ``channel.x``.
GROUP_PREFIX = "channel."


def group_name_of(channel_name: str) -> str:
    return f"{GROUP_PREFIX}{channel_name}"


class ChannelActor(Worker):
    """One channel worker (see the module docstring).

    Args:
        channel_name: the channel's name.
        maxsize: items per key; 0 for unbounded.
        item_type_blob: the channel's ``item_type``, pickled by the creator (the worker
            never unpickles it; ``connect`` hands it to clients).
        distributed: whether this is one of several per-node workers.
        incarnation: a unique id of this channel's creation.
    """

    def __init__(
        self,
        channel_name: str,
        maxsize: int,
        item_type_blob: bytes,
        distributed: bool,
        incarnation: str,
    ):
        super().__init__()
        self._channel_name = channel_name
        self._maxsize = maxsize
        self._item_type_blob = item_type_blob
        self._distributed = distributed
        self._incarnation = incarnation
        self._manager = CommManager.current()
        self._core = ChannelCore(channel_name, maxsize, self._deliver)
        self._lock = threading.Lock()
        self._readers: dict[WorkerAddress, threading.Thread] = {}
        self._registrations: dict[WorkerAddress, int] = {}
        self._outboxes: dict[Hashable, Outbox] = {}
        self._homes = HomeTable() if distributed and self._rank == 0 else None

    # -- control plane (Ray actor calls) --------------------------------------------------

    def channel_describe(self) -> dict[str, Any]:
        """What a client needs to use the channel (``Channel.connect`` reads it)."""
        return {
            "name": self._channel_name,
            "maxsize": self._maxsize,
            "item_type_blob": self._item_type_blob,
            "distributed": self._distributed,
            "incarnation": self._incarnation,
        }

    def channel_register_client(self, client: str) -> None:
        """Start reading request messages from the process at address ``client``."""
        address = parse_address(client)
        with self._lock:
            self._registrations[address] = self._registrations.get(address, 0) + 1
            reader = self._readers.get(address)
            if reader is not None and reader.is_alive():
                return  # it reads on, also after a reconnect (see _read)
            reader = threading.Thread(
                target=self._read, args=(address,), name=f"rlcomm-channel-read-{client}",
                daemon=True,
            )
            self._readers[address] = reader
        reader.start()

    def channel_stats(self) -> dict[str, Any]:
        """Counters of this worker: items accepted and handed out per key, its node."""
        stats = self._core.stats()
        stats.update(
            rank=self._rank,
            node_id=ray.get_runtime_context().get_node_id(),
            clients=len(self._readers),
            homes=self._homes.snapshot() if self._homes is not None else None,
        )
        return stats

    # -- data plane -----------------------------------------------------------------------

    def _read(self, client: WorkerAddress) -> None:
        with self._lock:
            seen = self._registrations.get(client, 0)
        while True:
            try:
                env = self._manager.recv(client, False, LISTEN_OPTIONS)
            except CommTimeoutError:
                continue
            except CommError as exc:
                self._core.drop_client(client)
                with self._lock:
                    registered = self._registrations.get(client, 0)
                    if registered == seen:
                        if self._readers.get(client) is threading.current_thread():
                            del self._readers[client]
                        self._outboxes.pop(client, None)
                        logger.info("channel %r: client %s is gone (%s)",
                                    self._channel_name, client, exc)
                        return
                    seen = registered
                # A new process at the same address (a restarted worker) registered
                # while this one still read the old connection: read the new one.
                logger.info("channel %r: client %s reconnected", self._channel_name, client)
                continue
            except CodecError:
                logger.exception("channel %r: a message from %s cannot be decoded; dropped",
                                 self._channel_name, client)
                continue
            message = P.unpack(env)
            if message is None:
                logger.error("channel %r: unexpected %s message from %s; dropped",
                             self._channel_name, type(env).__name__, client)
                continue
            heads, items = message
            if any(h[0] == P.ROUTE for h in heads):
                heads, items = self._route(client, heads, items)
            if heads:
                self._core.handle(client, heads, items)

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
            elif self._homes is None:
                text = (f"channel {self._channel_name!r}: route of key {key!r} asked of "
                        f"{self.worker_address}, which is not the coordinator")
                replies.append((client, (rid, P.ERROR, None), text, None))
            else:
                replies.append((client, (rid, P.OK, None), self._homes.home(key, proposed), None))
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
                self._core.requeue(*requeue)
        self._core.drop_client(client)
