"""The client end of a channel: one :class:`Link` per channel worker, shared by the process.

A process that uses a channel holds one link per channel worker it talks to, shared by
every :class:`~rlcomm.Channel` handle and every thread of the process. A link

- numbers requests and keeps a future per request (its
  :class:`~rlcomm.channel.requester.Requester`);
- sends requests through an :class:`~rlcomm.channel.outbox.Outbox` as
  :class:`~rlcomm.channel.protocol.ClientFrame` messages (requests posted while another is
  being sent travel together in one message), the tensors of their items beside the frame;
- listens to its connection with the worker (:mod:`rlcomm.comm.endpoint`): every reply
  message is handed, on the thread that read it, to :meth:`Link._on_message`, which
  decodes the items (the only decode an item gets after its producer encoded it) and
  resolves the futures. A thread that blocks on a request reads the replies itself
  (:meth:`~rlcomm.comm.endpoint.Peer.pump`), so its own reply costs no thread hop;
  otherwise (async ops, asyncio) the connection's receiver thread reads them;
- turns a lost connection (the worker died: the comm layer raises ``PeerLostError``)
  into :class:`~rlcomm.ChannelLostError` for every waiting and every later request;
- keeps the items its gets took ahead (:mod:`~rlcomm.channel.prefetch`), first
  in line for this process's next gets of their key;
- sends a blocking ``put`` on an unbounded channel *write-behind*: the put returns once
  its message is posted, in order behind this process's earlier requests, and the worker
  answers only a put it did not enqueue (the channel was closed first). The next put
  raises that refusal, and so does :func:`settle_all`, which waits until the worker
  applied them all: a worker method runs it before it returns (so its caller sees the
  items queued), a worker group runs it before it calls its workers, ``Channel.flush``
  runs it for one channel, and the process runs it when it exits. An async ``put`` of
  an item without tensors is written behind too, and held in the outbox for company
  (:mod:`~rlcomm.channel.outbox`). Its :class:`~rlcomm.channel.writebehind.WriteBehind`
  counts and settles those puts.

A link holds these parts; it owns none of their state, only the connection they share.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
from typing import Any

import msgspec
import ray
import torch

from rlcomm.channel import protocol as P
from rlcomm.channel.outbox import Outbox
from rlcomm.channel.payload import StoredItem, TensorCursor, encode_item
from rlcomm.channel.prefetch import Ahead
from rlcomm.channel.requester import Entry, Requester
from rlcomm.channel.writebehind import WriteBehind
from rlcomm.cluster import RLCOMM_NAMESPACE
from rlcomm.comm.endpoint import Endpoint
from rlcomm.comm.identity import WorkerAddress, actor_name
from rlcomm.comm.options import default_timeout
from rlcomm.errors import ChannelLostError, CommError, PeerLostError, PeerNotFoundError
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Seconds Ray control calls (register, describe) may take.
CONTROL_TIMEOUT = 60.0
#: How often held (async) write-behind puts look whether the worker is gone (seconds).
HELD_PEEK_SECONDS = 0.001
#: How long a pump may wait when a caller gives no timeout (it then simply waits again).
_LONG_WAIT = 3600.0


class Link:
    """This process's connection to one channel worker (see the module docstring).

    Listens to the connection with the worker, then registers this process with the
    worker (one Ray control call).

    Raises:
        ChannelLostError: the worker's actor is gone.
    """

    def __init__(self, channel: str, maxsize: int, group_name: str, rank: int):
        self.channel = channel
        self.address = WorkerAddress(group_name, (rank,))
        self.where = str(self.address)
        self._replies_read = 0  # reply messages read: each request message reports it
        self.ahead = Ahead(self._give_back, lambda: self.requests.lost)
        self.requests = Requester(
            channel, maxsize, self.where, self._post, self._give_back,
            decode=StoredItem.decode, stash=self.ahead.stash, wait_reply=self._wait_reply,
        )
        # Bound once: every request of the channel's handles goes through them.
        self.request = self.requests.request
        self.lose = self.requests.lose
        endpoint = Endpoint.for_process()
        try:
            actor = ray.get_actor(actor_name(group_name, rank), namespace=RLCOMM_NAMESPACE)
            self._peer = endpoint.listen(self.address, self._on_message, self._on_error)
            ray.get(
                actor.channel_register_client.remote(str(endpoint.address)),
                timeout=CONTROL_TIMEOUT,
            )
        except (ValueError, ray.exceptions.RayError, PeerNotFoundError) as exc:
            raise ChannelLostError(
                f"channel {channel!r}: cannot reach its channel worker {self.address}: {exc}"
            ) from exc
        self._outbox = Outbox(self._send, self._fail)
        self.behind = WriteBehind(self.requests, self._post)
        self._behind_ok = maxsize == 0 and get_settings().channel_write_behind
        self._next_peek = 0.0  # when a held put next looks whether the worker is gone
        self._gone_checks = 0  # how often write-behind puts looked (see stats())

    def __repr__(self) -> str:
        return f"Link({self.channel!r}, {self.where}, lost={self.requests.lost})"

    @property
    def lost(self) -> bool:
        return self.requests.lost

    def stats(self, key: P.Key) -> dict[str, Any]:
        """What this process sees of its link to the worker, without asking it (see
        ``Channel.client_stats``)."""
        outbox = self._outbox
        return {"worker": self.where, "lost": self.lost, "worker_gone": self._peer.gone(),
                "writes_behind": self.writes_behind, "gone_checks": self._gone_checks,
                "sent_inline": outbox.sent_inline, "sent_off": outbox.sent_off,
                "held": outbox.pending, "prefetched": self.prefetched(key)}

    @property
    def writes_behind(self) -> bool:
        """Unbounded channel, and a shared-memory connection: there a dead worker is
        seen before each write (:meth:`put_behind`); over a network a put waits."""
        return self._behind_ok and self._peer.shared_memory

    def put_behind(self, req: P.Put, tensors: list[torch.Tensor], hold: bool = False,
                   inline: bool = True) -> None:
        """Send a put without waiting for the worker (:meth:`WriteBehind.put_behind`),
        once it is sure the worker's process still runs.

        Raises:
            ChannelLostError: the worker is gone.
            ChannelClosedError: an earlier write-behind put was not enqueued.
        """
        # A blocking put looks each time; held puts (async) at most every HELD_PEEK_SECONDS.
        look = True
        if hold:
            now = time.monotonic()
            look = now >= self._next_peek
            if look:
                self._next_peek = now + HELD_PEEK_SECONDS
        if look:
            self._gone_checks += 1
        if look and self._peer.gone():  # the connection fails: the link is lost (_on_error)
            self.lose(PeerLostError(f"channel worker {self.where} is gone"))
        self.behind.put_behind(req, tensors, hold, inline)
        _behind.add(self)

    @property
    def unsettled(self) -> bool:
        """Whether write-behind puts wait to be settled (:attr:`WriteBehind.unsettled`)."""
        return self.behind.unsettled

    def settle(self, timeout: float, report: bool = True) -> None:
        """:meth:`WriteBehind.settle`: wait until the worker applied the write-behind puts."""
        self.behind.settle(timeout, report)

    def _post(self, entries: list[Entry], inline: bool, hold: bool = False) -> None:
        self._outbox.post(entries, inline, hold)

    def _send(self, entries: list[Entry]) -> None:
        frame = P.encode(P.ClientFrame([req for req, _ in entries], self._replies_read))
        tensors = [t for _, ts in entries for t in ts]
        self._peer.send(frame, tensors)

    def _fail(self, entries: list[Entry], exc: BaseException) -> None:
        """A message that could not be sent: its requests fail, and its write-behind puts
        are reported as not enqueued (their producer hears of it later)."""
        if not isinstance(exc, PeerLostError | PeerNotFoundError):
            for req, _tensors in entries:
                if type(req) is P.Put and P.rid_of(req) == P.NO_REPLY:
                    self.behind.note_unaccepted(req.key, P.ERROR, f"sending it failed: {exc}")
        self.requests.fail(entries, exc)

    def _wait_reply(self, fut: concurrent.futures.Future, timeout: float | None) -> bool:
        return self._peer.pump(fut, _LONG_WAIT if timeout is None else timeout,
                               lambda: self.requests.awaits_replies)

    def prepare_item(self, item: Any) -> tuple[P.Payload, list[torch.Tensor]]:
        return encode_item(item)

    def _give_back(self, key: P.Key, items: list[StoredItem], weights: list[float]) -> None:
        self.requests.post_oneway(P.Requeue(key, [i.payload for i in items], list(weights)),
                                  [t for i in items for t in i.tensors])

    # -- items taken ahead (prefetch, :mod:`~rlcomm.channel.prefetch`) -------------------------

    def take_prefetched(self, key: P.Key) -> tuple[bool, Any]:
        item = self.ahead.take(key)
        return (False, None) if item is None else (True, item.decode())

    def prefetched(self, key: P.Key) -> int:
        return self.ahead.count(key)

    def prefetched_upto(self, key: P.Key, weight: float) -> list[tuple[StoredItem, float]]:
        return self.ahead.take_upto(key, weight)

    def unget(self, key: P.Key, entries: list[tuple[StoredItem, float]]) -> None:
        self.ahead.unget(key, entries)

    def _on_message(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        # Runs on the one thread that reads the connection, in order.
        self._replies_read += 1
        try:
            frame = P.decode_worker_frame(data)
            cursor = TensorCursor(tensors)
            got = {reply.rid: [cursor.item(p) for p in reply.items]
                   for reply in frame.replies if type(reply) is P.Got}
            cursor.check_done()
        except (msgspec.DecodeError, ValueError) as exc:
            logger.error("channel %r: a malformed reply message from %s (%s); dropped",
                         self.channel, self.where, exc)
            return
        requests = self.requests
        done: list[int] = []  # put and close replies: resolved together, in one go
        for reply in frame.replies:
            tp = type(reply)
            if tp is P.Done:
                done.append(reply.rid)
                continue
            if done:
                requests.complete_done(done)
                done = []
            if tp is P.Got:
                requests.complete(reply.rid, P.OK, got[reply.rid], reply.weights)
            elif tp is P.Unaccepted:
                self.behind.note_unaccepted(reply.key, reply.status)
            elif tp is P.Count:
                requests.complete(reply.rid, P.OK, reply.value)
            else:
                requests.complete(reply.rid, reply.status, text=reply.text)
        if done:
            requests.complete_done(done)

    def _on_error(self, exc: CommError) -> None:
        self.lose(exc)


_links: dict[tuple[str, int, str], Link] = {}
_links_lock = threading.Lock()
#: Links that sent write-behind puts since they were last settled (see settle_all).
_behind: set[Link] = set()


def settle_all(timeout: float | None = None, channel: str | None = None,
               report: bool = True) -> None:
    """Wait until every channel worker applied the write-behind puts this process sent
    (those of ``channel`` only, if given): a blocking ``put`` on an unbounded channel
    returns before its worker has the item, and this makes the items visible to every
    other process. Nothing to do costs nothing. With ``report`` False (before a worker
    group's call, which is about other things), nothing raises: a refused put or a lost
    worker is left for that channel's next put or flush to raise, and a worker that does
    not answer within ``timeout`` is logged and passed over.

    Raises:
        ChannelClosedError: a put was not enqueued (its channel was closed first).
        ChannelLostError: a channel worker with such puts is gone.
        CommTimeoutError: a worker did not answer within ``timeout`` (default: rlcomm's
            op timeout).
    """
    if not _behind:
        return
    t = default_timeout() if timeout is None else timeout
    first: BaseException | None = None
    for link in list(_behind):
        if channel is not None and link.channel != channel:
            continue
        try:
            link.settle(t, report)
        except Exception as exc:  # noqa: BLE001 - the others are settled first
            if report:
                first = first or exc
            else:
                logger.warning("channel %r: puts sent without waiting are not confirmed "
                               "yet (%s); going on", link.channel, exc)
        if link.lost and not report:
            continue
        if not link.unsettled:
            _behind.discard(link)
            if link.unsettled:  # a put since: keep it listed
                _behind.add(link)
    if first is not None:
        raise first


def _settle_at_exit() -> None:
    for link in list(_behind):
        if link.lost:  # its worker is gone: nothing to wait for (said when it was lost)
            _behind.discard(link)
    try:
        settle_all(EXIT_SETTLE_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the process ends either way
        logger.warning("channel puts sent without waiting may be lost at exit: %s", exc)


#: Seconds a process that ends waits for its write-behind puts to be applied.
EXIT_SETTLE_TIMEOUT = 10.0
#: Seconds a worker group's call waits for this process's write-behind puts to be
#: applied before it calls its workers (a frozen channel worker must not hold it up).
CALL_SETTLE_TIMEOUT = 10.0
atexit.register(_settle_at_exit)


def link_to(channel: str, maxsize: int, group_name: str, rank: int, incarnation: str) -> Link:
    """This process's link to channel worker ``rank`` (made on first use, then shared)."""
    key = (group_name, rank, incarnation)
    link = _links.get(key)
    if link is not None:
        return link
    with _links_lock:
        link = _links.get(key)
        if link is None:
            link = _links[key] = Link(channel, maxsize, group_name, rank)
        return link


def cached_link(group_name: str, rank: int, incarnation: str) -> Link | None:
    return _links.get((group_name, rank, incarnation))


def drop_links(group_name: str, incarnation: str, cause: BaseException) -> None:
    """Forget this process's links to a channel that was shut down; fail their requests."""
    with _links_lock:
        keys = [k for k in _links if k[0] == group_name and k[2] == incarnation]
        links = [_links.pop(k) for k in keys]
    for link in links:
        link.lose(cause)
        _behind.discard(link)  # shut down: its items are gone, said or not
