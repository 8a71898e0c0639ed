"""The client end of a channel: request ids, futures, and one link per channel worker.

A process that uses a channel holds one :class:`Link` per channel worker it talks to,
shared by every :class:`~rlcomm.Channel` handle and every thread of the process. A link

- numbers requests and keeps a future per request;
- sends requests through an :class:`~rlcomm.channel.outbox.Outbox` as rlcomm messages
  (requests posted while another is being sent travel together in one message);
- listens to its rlcomm connection: every reply message is handed, on the thread that
  read it, to :meth:`Requester.on_replies`, which resolves the futures. A thread that
  blocks on a request reads the replies itself (``Connection.pump``), so its own reply
  costs no thread hop; otherwise (async ops, asyncio) the connection's receiver thread
  reads them. Many threads and coroutines can wait on one channel at once;
- turns a lost connection (the worker died: the comm layer raises ``PeerLostError``)
  into :class:`~rlcomm.ChannelLostError` for every waiting and every later request.

A request whose future is cancelled (an asyncio task cancelled in ``aget``, a client-side
timeout) is withdrawn at the worker with ``CANCEL``; if its items were already on the
way, they are put back at the head of their key (``REQUEUE``), so none is lost.

:class:`LocalLink` serves a ``local=True`` channel in-process with the same interface.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Hashable
from typing import Any

import ray

from rlcomm.channel import protocol as P
from rlcomm.channel.core import ChannelCore
from rlcomm.channel.outbox import Outbox
from rlcomm.channel.state import Delivery
from rlcomm.cluster import RLCOMM_NAMESPACE
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.manager import CommManager
from rlcomm.comm.options import CollectiveGroupOptions, op_timeout
from rlcomm.errors import (
    ChannelClosedError,
    ChannelEmpty,
    ChannelError,
    ChannelFull,
    ChannelLostError,
    CommError,
    CommTimeoutError,
    PeerLostError,
    PeerNotFoundError,
)

logger = logging.getLogger(__name__)

#: Options of the channel's rlcomm connections: sends use the process default timeout;
#: readers wait an hour per receive and simply receive again.
SEND_OPTIONS = CollectiveGroupOptions()
LISTEN_OPTIONS = CollectiveGroupOptions(timeout=3600.0)
#: Seconds Ray control calls (register, describe) may take.
CONTROL_TIMEOUT = 60.0


class RequestFuture(concurrent.futures.Future):
    """The future of one request; cancelling it withdraws the request at the worker."""

    def __init__(self, requester: Requester, rid: int, key: P.Key):
        super().__init__()
        self.requester = requester
        self.rid = rid
        self.key = key

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self.requester._withdraw(self.rid, self.key)
        return True


class _Pending:
    __slots__ = ("future", "op", "key", "timeout")

    def __init__(self, future: concurrent.futures.Future, op: int, key: P.Key, timeout: float | None):
        self.future = future
        self.op = op
        self.key = key
        self.timeout = timeout


class Requester:
    """Request ids and futures of one channel worker (or a local channel).

    Args:
        channel: the channel's name, for messages.
        maxsize: the channel's maxsize, for messages.
        where: names the channel worker in messages.
    """

    def __init__(self, channel: str, maxsize: int, where: str):
        self.channel = channel
        self.maxsize = maxsize
        self.where = where
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._rids = itertools.count()
        self._lost: BaseException | None = None

    # -- to be provided by a subclass -------------------------------------------------------

    def _post(self, entries: list[tuple[tuple, Any]], inline: bool) -> None:
        raise NotImplementedError

    # -- requests -------------------------------------------------------------------------------

    def submit(
        self,
        op: int,
        key: P.Key,
        arg: Any = None,
        timeout: float | None = None,
        item: Any = None,
        inline: bool = True,
    ) -> RequestFuture:
        """Send one request; the future completes with its result or error (cancelling
        it withdraws the request).

        Args:
            timeout: seconds the request may wait parked at the worker (``None``: it
                never parks, or waits without limit).
            inline: send from this thread (``False``: from the flush pool).
        """
        rid = next(self._rids)
        fut = RequestFuture(self, rid, key)
        with self._lock:
            if self._lost is not None:
                raise self._lost_error(op, key)
            self._pending[rid] = _Pending(fut, op, key, timeout)
        self._post([((op, rid, key, arg, timeout), item)], inline)
        return fut

    def post_oneway(self, op: int, key: P.Key, arg: Any = None, item: Any = None) -> None:
        """Send a request that gets no reply (``CANCEL``, ``REQUEUE``), never inline."""
        if self._lost is None:
            self._post([((op, P.NO_REPLY, key, arg, None), item)], False)

    def wait_reply(self, fut: concurrent.futures.Future, timeout: float) -> bool:
        """Block until ``fut`` is done (True) or ``timeout`` seconds passed (False)."""
        done, _ = concurrent.futures.wait([fut], timeout)
        return bool(done)

    def _withdraw(self, rid: int, key: P.Key) -> None:
        with self._lock:
            still_pending = rid in self._pending
        if still_pending:
            self.post_oneway(P.CANCEL, key, rid)

    # -- replies ----------------------------------------------------------------------------------

    def on_replies(self, heads: list[tuple], items: list[Any]) -> None:
        """Resolve the futures of the replies of one message."""
        for head, item in zip(heads, items, strict=True):
            rid, status, weights = head
            with self._lock:
                p = self._pending.pop(rid, None)
            if p is None:
                logger.warning("channel %r: a reply for unknown request %s", self.channel, rid)
                continue
            if p.future.cancelled():
                self._give_back(p, status, item, weights)
                continue
            try:
                if status == P.OK:
                    p.future.set_result(item if p.op in _RESULT_OPS else None)
                else:
                    p.future.set_exception(self._error(p, status, item))
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                self._give_back(p, status, item, weights)

    def _give_back(self, p: _Pending, status: int, item: Any, weights: Any) -> None:
        """Items that reached a request no one waits for go back to the head of the key."""
        if status != P.OK or p.op not in P.GET_OPS:
            return
        if p.op == P.GET_BATCH:
            self.post_oneway(P.REQUEUE, p.key, list(weights), list(item))
        else:
            self.post_oneway(P.REQUEUE, p.key, [weights], [item])

    def _error(self, p: _Pending, status: int, item: Any) -> BaseException:
        op, key = P.op_name(p.op), p.key
        where = f"channel {self.channel!r}: {op} on key {key!r}"
        if status == P.FULL:
            return ChannelFull(f"{where}: the key holds maxsize={self.maxsize} items")
        if status == P.EMPTY:
            return ChannelEmpty(f"{where}: the key holds no item")
        if status == P.CLOSED:
            if p.op in P.GET_OPS:
                return ChannelClosedError(f"{where}: the channel is closed and the key is drained")
            return ChannelClosedError(f"{where}: the channel is closed; the item was not enqueued")
        if status == P.TIMEOUT:
            what = "the item was not enqueued" if p.op in P.PUT_OPS else "nothing was taken"
            return CommTimeoutError(f"{where} timed out after {p.timeout}s; {what}")
        if status == P.CANCELLED:
            return concurrent.futures.CancelledError(f"{where} was withdrawn")
        return ChannelError(item if isinstance(item, str) else f"{where} failed ({status})")

    # -- loss -------------------------------------------------------------------------------------

    def _lost_error(self, op: int, key: P.Key) -> ChannelLostError:
        return ChannelLostError(
            f"channel {self.channel!r}: {P.op_name(op)} on key {key!r} failed: the channel "
            f"worker {self.where} is gone ({self._lost}); the channel's queued items are lost"
        )

    def lose(self, cause: BaseException) -> None:
        """Fail every waiting request, and every later one, with ChannelLostError."""
        with self._lock:
            if self._lost is None:
                self._lost = cause
            pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.future.done():
                try:
                    p.future.set_exception(self._lost_error(p.op, p.key))
                except concurrent.futures.InvalidStateError:
                    pass

    def fail(self, entries: list[Any], exc: BaseException) -> None:
        """Fail the requests of ``entries`` (a message that could not be sent)."""
        if isinstance(exc, PeerLostError | PeerNotFoundError):
            self.lose(exc)
            return
        for (op, rid, key, _arg, _timeout), _item in entries:
            with self._lock:
                p = self._pending.pop(rid, None)
            if p is None or p.future.done():
                continue
            err = exc
            if isinstance(exc, CommError) and not isinstance(exc, CommTimeoutError):
                err = ChannelLostError(
                    f"channel {self.channel!r}: {P.op_name(op)} on key {key!r}: sending to "
                    f"{self.where} failed: {exc}"
                )
            try:
                p.future.set_exception(err)
            except concurrent.futures.InvalidStateError:
                pass

    @property
    def lost(self) -> bool:
        return self._lost is not None


_RESULT_OPS = frozenset((*P.GET_OPS, P.QSIZE, P.ROUTE))


class Link(Requester):
    """This process's connection to one channel worker (see the module docstring).

    Listens to the rlcomm connection with the worker, then registers this process with
    the worker (one Ray control call).

    Raises:
        ChannelLostError: the worker's actor is gone.
    """

    def __init__(self, channel: str, maxsize: int, group_name: str, rank: int):
        self.address = WorkerAddress(group_name, (rank,))
        super().__init__(channel, maxsize, str(self.address))
        self._replies_read = 0  # reply messages read: each request message reports it
        self._comm = CommManager.for_process()
        from rlcomm.comm.identity import actor_name

        try:
            actor = ray.get_actor(actor_name(group_name, rank), namespace=RLCOMM_NAMESPACE)
            self._conn = self._comm.listen(
                self.address, self._on_message, self._on_error, LISTEN_OPTIONS
            )
            ray.get(
                actor.channel_register_client.remote(str(self._comm.address)),
                timeout=CONTROL_TIMEOUT,
            )
        except (ValueError, ray.exceptions.RayError, PeerNotFoundError) as exc:
            raise ChannelLostError(
                f"channel {channel!r}: cannot reach its channel worker {self.address}: {exc}"
            ) from exc
        self._outbox = Outbox(self._send, self.fail)

    def _post(self, entries: list[tuple[tuple, Any]], inline: bool) -> None:
        self._outbox.post(entries, inline)

    def _send(self, entries: list[tuple[tuple, Any]]) -> None:
        message = P.pack([h for h, _ in entries], [i for _, i in entries], self._replies_read)
        self._conn.send_message(message, op_timeout(SEND_OPTIONS))

    def wait_reply(self, fut: concurrent.futures.Future, timeout: float) -> bool:
        return self._conn.pump(fut, timeout, self._awaits_replies)

    def _awaits_replies(self) -> bool:
        return bool(self._pending)

    def _on_message(self, env: Any) -> None:
        # Runs on the one thread that holds the connection's reading role, in order.
        self._replies_read += 1
        message = P.unpack(env)
        if message is None:
            logger.error("channel %r: unexpected message %r from %s", self.channel,
                         type(env).__name__, self.where)
            return
        self.on_replies(message[0], message[1])

    def _on_error(self, exc: CommError) -> None:
        self.lose(exc)


class LocalLink(Requester):
    """A ``local=True`` channel: the queues live in this process; items are not copied."""

    def __init__(self, channel: str, maxsize: int):
        super().__init__(channel, maxsize, "(local)")
        self.core = ChannelCore(channel, maxsize, self._deliver)

    def _post(self, entries: list[tuple[tuple, Any]], inline: bool) -> None:
        self.core.handle(self, [h for h, _ in entries], [i for _, i in entries])

    def _deliver(self, client: Hashable, deliveries: list[Delivery]) -> None:
        self.on_replies([d[1] for d in deliveries], [d[2] for d in deliveries])


_links: dict[tuple[str, int, str], Link] = {}
_links_lock = threading.Lock()


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
