"""``ChannelService``: the data plane of one channel worker.

The :class:`~rlcomm.channel.actor.ChannelActor` (a Ray actor) holds one and hands it the
control calls; everything per message happens here, in a plain object: Ray wraps every
method of an actor class for tracing, a cost no per-message call should pay.

Threads, all owned here:

- one *selector* thread (:class:`~rlcomm.comm.endpoint.PeerSelector`) reads the request
  messages of every client process on this node (shared memory) and applies them to the
  :class:`~rlcomm.channel.core.ChannelCore`; it never waits on a queue's state (a get on
  an empty key is parked, not waited for). One thread waiting on all clients at once
  spins once, not once per client. A client on another node (Gloo) is read by its
  connection's receiver thread, which applies its requests the same way;
- the core's *timer* thread, which answers parked requests at their deadlines;
- replies: each client has its own queue of replies
  (:class:`~rlcomm.channel.outbox.Outbox`) and its own *reply* thread (made at the first
  reply that needs it, ended when the client is gone). The thread that produces a reply
  (a put from client A read on the selector thread completes client B's get) sends it
  itself only when the write cannot wait on B (:mod:`~rlcomm.channel.replies`: B has
  read nearly all it was sent, and the transport is shared memory); otherwise it queues
  it, and B's reply thread sends it. A client that stops reading (a stopped or stalled
  process) then holds up only its own reply thread, for up to the ``channel_reply_timeout`` setting:
  the selector, the timer and every other client go on, and once it reads again it
  gets every reply, in order.

Items are never decoded here: a put's item is stored as the payload its producer encoded
and its tensors, and a reply forwards them as they are (:mod:`~rlcomm.channel.payload`);
the worker need not import the items' classes. An item is kept and forwarded from the
memory it arrived in: a large one is a zero-copy view of its producer's shared-memory
segment. The shared-memory transport bounds what that pins: once this side holds half
the segments a producer may have in flight, later large payloads arrive copied into
pooled buffers instead, so a producer never runs out of segments.

What a client's queue may hold is bounded by the client itself: every reply answers
one request of that client (exactly one per request), so the queue holds at most as
many replies as the client has requests outstanding, and their items are ones the
client asked for, moved out of their keys (not copied). ``stats()["replies"]`` counts
them.

A reply that cannot be delivered (its client died) puts the items it carried back at
the head of their key, and the client's parked requests are dropped. A reply that
timed out may have left part of a message in the client's stream, so the connection
with that client is then closed: the client gets ``ChannelLostError`` rather than a
broken stream, and its items go back to their keys.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Hashable
from typing import Any

import msgspec
import torch

from rlcomm.channel import protocol as P
from rlcomm.channel.core import ChannelCore
from rlcomm.channel.outbox import Outbox
from rlcomm.channel.payload import StoredItem, TensorCursor
from rlcomm.channel.replies import ReadWindow, message_bytes
from rlcomm.channel.routing import HomeTable
from rlcomm.channel.state import Delivery
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.endpoint import (
    Endpoint,
    Peer,
    PeerSelector,
    WorkerAddress,
    add_status_section,
    encode_message,
    forward_without_copies,
    forwarded_without_copies,
    parse_address,
)
from rlcomm.errors import CodecError, CommError, CommTimeoutError, PeerLostError
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)


_on_reply_thread = threading.local()


def _mark_reply_thread() -> None:
    _on_reply_thread.yes = True


class _ClientReplies:
    """The replies due to one client: its outbox, its reply thread (started at its first
    flush off a posting thread) and what it has not read yet.

    ``encoded`` keeps the batch that ``_may_inline`` encoded for the ``_send`` that comes
    right after it on the same (flushing) thread: ``(batch, header, tensors, nbytes)``.
    """

    __slots__ = ("outbox", "thread", "window", "encoded")

    def __init__(self) -> None:
        self.outbox: Outbox
        self.thread: concurrent.futures.ThreadPoolExecutor
        self.window = ReadWindow()
        self.encoded: tuple[list[Delivery], MessageHeader, list[torch.Tensor], int] | None = None

    def close(self, exc: BaseException) -> None:
        self.outbox.close(exc)
        self.thread.shutdown(wait=False)


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
        # Items are forwarded as they arrived and never written to: a large one goes on
        # to its consumer as its producer's segment, not as a copy.
        forward_without_copies()
        self._endpoint = Endpoint.current()
        self.core = ChannelCore(channel_name, maxsize, self._deliver, StoredItem.decode,
                                StoredItem.lend_cost)
        self._lock = threading.Lock()
        self._selector = PeerSelector(f"rlcomm-channel-{channel_name}")
        self._listening: dict[WorkerAddress, Peer | None] = {}
        self._registrations: dict[WorkerAddress, int] = {}
        self._replies: dict[Hashable, _ClientReplies] = {}
        self.homes = HomeTable() if coordinator else None
        add_status_section(f"channel:{channel_name}", self._status)

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

    def reply_stats(self) -> dict[str, Any]:
        """Replies queued (or being sent) per client, and in all (what stalled clients
        hold), and how many reply messages went inline and by reply threads."""
        with self._lock:
            replies = list(self._replies.items())
        per_client = {str(client): n for client, r in replies if (n := r.outbox.pending)}
        return {
            "queued": sum(per_client.values()),
            "clients": per_client,
            "sent_inline": sum(r.outbox.sent_inline for _, r in replies),
            "sent_by_reply_threads": sum(r.outbox.sent_off for _, r in replies),
            "relayed_payloads": forwarded_without_copies(),
        }

    def _status(self) -> dict[str, Any]:
        """This worker's part of ``rlcomm status``: the channel's keys, clients and the
        replies queued for them (on a status thread: the locks are waited for briefly)."""
        out: dict[str, Any] = {"name": self._channel_name, "worker": self._where}
        out.update(self.core.describe(0.5))
        if not self._lock.acquire(timeout=0.5):
            out["clients"] = []
            return out
        try:
            clients = [str(c) for c in self._listening]
            replies = list(self._replies.items())
        finally:
            self._lock.release()
        out["clients"] = clients
        out["replies_queued"] = {str(c): n for c, r in replies if (n := r.outbox.pending)}
        return out

    def _listen(self, address: WorkerAddress) -> None:
        with self._lock:
            seen = self._registrations.get(address, 0)
        peer = self._endpoint.listen(
            address,
            lambda data, tensors: self._on_message(address, data, tensors),
            lambda exc: self._lost(address, seen, exc),
        )
        with self._lock:
            if address in self._listening:
                self._listening[address] = peer
        self._selector.add(peer)

    def _on_message(self, client: WorkerAddress, data: bytes, tensors: list[torch.Tensor]) -> None:
        """Apply the requests of one message of ``client`` (on the thread that read it).

        Items are not decoded: each is stored as its payload and its tensors, as they
        arrived (large ones are views of the producer's shared memory)."""
        try:
            frame = P.decode_client_frame(data)
            cursor = TensorCursor(tensors)
            requests = frame.requests
            routes = False
            for req in requests:
                tp = type(req)
                if tp is P.Put:
                    req.item = cursor.item(req.item)
                elif tp is P.Requeue:
                    req.items = [cursor.item(p) for p in req.items]
                elif tp is P.Route:
                    routes = True
            cursor.check_done()
        except (msgspec.DecodeError, ValueError) as exc:
            logger.error("channel %r: a malformed request message from %s (%s); dropped",
                         self._channel_name, client, exc)
            return
        if frame.read >= 0 and (replies := self._replies.get(client)) is not None:
            replies.window.read(frame.read)
        if routes:
            requests = self._route(client, requests)
        if requests:
            self.core.handle(client, requests)
        # Items stay as they arrived: a large one is a view of the producer's shared-memory
        # segment, and the transport itself copies later payloads out once this side holds
        # many of that producer's segments, so a producer never runs out of them.

    def _lost(self, client: WorkerAddress, seen: int, exc: CommError) -> None:
        """The connection with ``client`` (listened at registration ``seen``) failed."""
        self.core.drop_client(client)
        with self._lock:
            gone = self._registrations.get(client, 0) == seen
            if gone:
                self._listening.pop(client, None)
            # Replies queued for the process of that connection: their items go back to
            # their keys (a new process at the address starts with a queue of its own).
            replies = self._replies.pop(client, None)
        if replies is not None:
            replies.close(exc)
        if gone:
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

    def _route(self, client: WorkerAddress, requests: list[P.Request]) -> list[P.Request]:
        """Answer the ``Route`` requests of a message; return the other requests."""
        replies: list[Delivery] = []
        rest = []
        for req in requests:
            if type(req) is not P.Route:
                rest.append(req)
            elif self.homes is None:
                text = (f"channel {self._channel_name!r}: route of key {req.key!r} asked of "
                        f"{self._where}, which is not the coordinator")
                replies.append(Delivery(client, req.rid, P.ERROR, text))
            else:
                rank = self.homes.home(req.key, req.proposed)
                replies.append(Delivery(client, req.rid, P.OK, rank))
        self._deliver(client, replies)
        return rest

    def _client_replies(self, client: Hashable) -> _ClientReplies | None:
        """The reply queue of ``client`` (made at its first reply); ``None`` once it is gone."""
        replies = self._replies.get(client)
        if replies is None:
            with self._lock:
                replies = self._replies.get(client)
                if replies is None and client in self._listening:
                    address: WorkerAddress = client  # type: ignore[assignment]
                    replies = r = _ClientReplies()
                    r.thread = concurrent.futures.ThreadPoolExecutor(
                        1, f"rlcomm-channel-reply-{address}", initializer=_mark_reply_thread
                    )
                    r.outbox = Outbox(
                        lambda batch: self._send(address, r, batch),
                        lambda batch, exc: self._undeliverable(address, batch, exc),
                        r.thread,
                        lambda batch: self._may_inline(address, r, batch),
                    )
                    self._replies[client] = r
        return replies

    def _deliver(self, client: Hashable, deliveries: list[Delivery]) -> None:
        """Send or queue replies for ``client``; never waits on it (see the module docstring)."""
        replies = self._client_replies(client)
        if replies is None:  # gone since the replies were made: their items go back
            self._undeliverable(client, deliveries, PeerLostError(  # type: ignore[arg-type]
                f"channel {self._channel_name!r}: client {client} is gone"))
            return
        replies.outbox.post(deliveries)

    def _may_inline(self, client: WorkerAddress, r: _ClientReplies, batch: list[Delivery]) -> bool:
        """Whether the posting thread that flushes ``batch`` may send it itself: the write
        cannot wait (see :mod:`~rlcomm.channel.replies`). Encodes it for ``_send``."""
        peer = self._listening.get(client)
        if peer is None or not peer.usable or not peer.shared_memory:
            return False
        try:
            header, tensors = _reply_message(batch)
        except CodecError:
            return True  # _send raises it again; the outbox then sends entry by entry
        if tensors and tensors[0].is_cuda:
            return False
        nbytes = message_bytes(header, tensors)
        if not r.window.admits(nbytes):
            return False
        r.encoded = (batch, header, tensors, nbytes)
        return True

    def _send(self, client: WorkerAddress, r: _ClientReplies, batch: list[Delivery]) -> None:
        encoded, r.encoded = r.encoded, None
        if encoded is not None and encoded[0] is batch:  # inline: encoded by _may_inline
            _, header, tensors, nbytes = encoded
        else:
            header, tensors = _reply_message(batch)
            nbytes = message_bytes(header, tensors)
        peer = self._listening.get(client)
        timeout = None  # rlcomm's op timeout
        if peer is None or not peer.usable:  # not listened yet, or reconnecting
            peer = self._endpoint.connect(client)
        elif getattr(_on_reply_thread, "yes", False):
            timeout = get_settings().channel_reply_timeout
        # else inline: the write cannot wait; if it did all the same, no longer than a send
        r.window.sent(nbytes)  # before the write: the client's report may come first
        peer.send_encoded(header, tensors, timeout)

    def _undeliverable(self, client: WorkerAddress, batch: list[Delivery], exc: BaseException) -> None:
        if isinstance(exc, CodecError):  # items of CPU and CUDA tensors in one reply
            logger.error("channel %r: a reply to %s cannot be encoded: %s",
                         self._channel_name, client, exc)
            d = batch[0]
            if d.key is not None:
                self.core.requeue(d.key, d.value, d.weights)
            self._deliver(client, [Delivery(client, d.rid, P.ERROR, f"channel "
                                            f"{self._channel_name!r}: the reply cannot be "
                                            f"encoded: {exc}")])
            return
        logger.warning("channel %r: replies to %s could not be sent (%s); their items go "
                       "back to their keys", self._channel_name, client, exc)
        self.core.drop_client(client)  # first: the items must not come back to it
        for d in batch:
            if d.key is not None:
                self.core.requeue(d.key, d.value, d.weights)
        peer = self._listening.get(client)
        if isinstance(exc, CommTimeoutError) and peer is not None:
            # Part of the message may be in the client's stream: end the connection (the
            # client sees it lost) rather than write behind half a message.
            peer.close()


def _reply_message(batch: list[Delivery]) -> tuple[MessageHeader, list[torch.Tensor]]:
    """The message of a batch of replies: a :class:`~rlcomm.channel.protocol.WorkerFrame`
    and the tensors of the items it hands out (forwarded as they were stored)."""
    replies: list[P.Reply] = []
    tensors: list[torch.Tensor] = []
    for d in batch:
        if d.status != P.OK:
            if d.rid == P.NO_REPLY:  # a write-behind put that was not enqueued
                replies.append(P.Unaccepted(d.value, d.status))
            else:
                replies.append(P.Refused(d.rid, d.status, d.value if d.status == P.ERROR else ""))
        elif d.key is not None:
            items: list[StoredItem] = d.value
            replies.append(P.Got(d.rid, [i.payload for i in items], d.weights))
            for i in items:
                i.taken = True
                tensors.extend(i.tensors)
        elif d.value is None:
            replies.append(P.Done(d.rid))
        else:
            replies.append(P.Count(d.rid, d.value))
    return encode_message(P.encode(P.WorkerFrame(replies)), tensors)
