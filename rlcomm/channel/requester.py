"""``Requester``: request ids, futures and results of one channel worker (or local channel).

A request gets an id; its reply resolves it, with the request's result or the error its
status means. The handle callers get is a :class:`RequestWork` (an
:class:`~rlcomm.comm.work.AsyncWork`): its ``wait`` lets a blocking caller read its own
reply (the requester's ``wait_reply``), and abandoning a wait (a timeout, an asyncio task
cancelled, ``KeyboardInterrupt``) cancels it and withdraws the request at the worker
(``Cancel``). If its items were on their way already, they are put back at the head of
their key (``Requeue``), so none is lost. An async request gets a future only when
someone has to wait for it; replies to many puts are resolved at once
(:meth:`Requester.complete_done`).

How requests travel and items are carried is not the requester's business: the link
that holds it gives it the callables that post requests and give items back
(:class:`~rlcomm.channel.client.Link`: a channel worker, items as encoded payloads;
:class:`~rlcomm.channel.local.LocalLink`: in-process, items as they are). What a
:class:`~rlcomm.Channel` handle asks of either link is :class:`ChannelLink`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rlcomm.channel import protocol as P
from rlcomm.comm.work import AsyncWork
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

#: A request to send and the tensors of its items (in the order its payloads own them).
Entry = tuple[P.Request, list[torch.Tensor]]
#: Posts requests: ``post(entries, inline, hold)``.
Post = Callable[[list[Entry], bool, bool], None]
#: Gives items back to the head of a key: ``give_back(key, items, weights)``.
GiveBack = Callable[[P.Key, list[Any], list[float]], None]


class ChannelLink(Protocol):
    """What a :class:`~rlcomm.Channel` handle asks of the link that serves a key."""

    channel: str

    @property
    def writes_behind(self) -> bool:
        """Whether a blocking put may return before the worker accepted its item."""

    def request(self, req: P.Request, timeout: float, tensors: list[torch.Tensor] | None = None,
                inline: bool = True) -> RequestWork:
        """Send ``req``; its handle (see :meth:`Requester.request`)."""

    def stats(self, key: P.Key) -> dict[str, Any]:
        """What this process sees of the link, for ``key`` (see ``Channel.client_stats``)."""

    def prepare_item(self, item: Any) -> tuple[Any, list[torch.Tensor]]:
        """What a ``Put`` carries for ``item`` and the tensors beside it.

        Raises:
            CodecError: the item cannot be encoded.
        """

    def put_behind(self, req: P.Put, tensors: list[torch.Tensor], hold: bool = False,
                   inline: bool = True) -> None:
        """Send a put without waiting for the worker (only where :attr:`writes_behind`)."""

    def take_prefetched(self, key: P.Key) -> tuple[bool, Any]:
        """``(True, item)``: the next item of ``key`` taken ahead by an earlier get of
        this process; ``(False, None)`` when there is none."""

    def prefetched(self, key: P.Key) -> int:
        """How many items of ``key`` this process holds taken ahead."""

    def prefetched_upto(self, key: P.Key, weight: float) -> list[tuple[Any, float]]:
        """Items of ``key`` taken ahead, from the head until their weights reach
        ``weight``, with their weights (for a ``get_batch``)."""

    def unget(self, key: P.Key, entries: list[tuple[Any, float]]) -> None:
        """Put back items :meth:`prefetched_upto` took, ahead of the key."""


def _same(item: Any) -> Any:
    return item


def _wait_future(fut: concurrent.futures.Future, timeout: float | None) -> bool:
    done, _ = concurrent.futures.wait([fut], timeout)
    return bool(done)


NO_RESULT, ONE_ITEM, ITEMS, VALUE = range(4)  # what a request's OK reply resolves to
RESULTS = {P.Put: NO_RESULT, P.Close: NO_RESULT, P.Sync: NO_RESULT, P.Get: ONE_ITEM, P.GetBatch: ITEMS,
           P.QSize: VALUE, P.Route: VALUE}


class Description:
    """Names a request of a channel in messages (formatted only when one is written)."""

    __slots__ = ("channel", "req")

    def __init__(self, channel: str, req: P.Request):
        self.channel = channel
        self.req = req

    def __str__(self) -> str:
        key = getattr(self.req, "key", "")
        return f"channel {self.channel!r}: {P.op_name(self.req)} on key {key!r}"


class Pending:
    """A request waiting for its reply, and then its outcome.

    ``future`` is made only when someone needs one (see :class:`RequestWork`); until then
    a reply just records ``value`` or ``error`` and sets ``settled``.
    """

    __slots__ = ("req", "result", "future", "settled", "value", "error")

    def __init__(self, req: P.Request, future: concurrent.futures.Future | None):
        self.req = req
        self.result = RESULTS[type(req)]
        self.future = future
        self.settled = False
        self.value: Any = None
        self.error: BaseException | None = None

    @property
    def key(self) -> P.Key:
        return getattr(self.req, "key", "")

    @property
    def timeout(self) -> float | None:
        return getattr(self.req, "timeout", None)

    @property
    def op(self) -> str:
        return P.op_name(self.req)


class RequestWork(AsyncWork):
    """The :class:`~rlcomm.AsyncWork` of one channel request.

    Its future is made on first need: a ``wait`` that has to block, ``async_wait``,
    ``future``. A request whose reply came before anyone waited (the usual case for a
    stream of ``put(async_op=True)``) costs no future and no condition variable: ``wait``
    and ``done`` read its outcome directly. Abandoning a wait that had to block (a
    timeout, an interrupt, a cancelled task) withdraws the request, as for any
    cancellable work.
    """

    def __init__(self, requester: Requester, pending: Pending, timeout: float, inline: bool):
        # AsyncWork's fields, set directly: this runs once per request.
        self._requester = requester
        self._pending = pending
        self._future = pending.future
        self._timeout = timeout
        self._waiter = requester.wait_reply if inline else None
        self._cancellable = True
        self._on_cancel = None

    @property
    def _description(self) -> Description:  # type: ignore[override]
        return Description(self._requester.channel, self._pending.req)

    def _result_future(self) -> concurrent.futures.Future:
        fut = self._future
        if fut is None:
            fut = self._future = self._requester.future_of(self._pending)
        return fut

    def wait(self, timeout: float | None = None) -> Any:
        p = self._pending
        if p.settled:
            if p.error is not None:
                raise p.error
            return p.value
        return super().wait(timeout)

    def done(self) -> bool:
        if self._pending.settled:
            return True
        fut = self._future
        return fut is not None and fut.done()

    def _abandon(self) -> None:
        fut = self._future
        if fut is not None and fut.cancel():
            self._requester.withdraw_request(self._pending)

    def withdraw(self) -> None:
        """Cancel the request, as an abandoned wait does (no-op once it completed)."""
        self._result_future()
        self._abandon()


class Requester:
    """Request ids and futures of one channel worker (see the module docstring).

    Args:
        channel: the channel's name, for messages.
        maxsize: the channel's maxsize, for messages.
        where: names the channel worker in messages.
        post: sends requests (never called under the requester's lock).
        give_back: puts items that reached a request no one waits for back at the head
            of their key.
        decode: the item a caller gets from what a reply carried (default: as it is).
        stash: keeps items a get took ahead (prefetch) for this process's next gets of
            their key (default: they are given back).
        wait_reply: blocks a caller until a future is done (True) or ``timeout``
            seconds passed (False); a link may read its own replies meanwhile.
    """

    def __init__(
        self, channel: str, maxsize: int, where: str, post: Post, give_back: GiveBack,
        decode: Callable[[Any], Any] = _same, stash: GiveBack | None = None,
        wait_reply: Callable[[concurrent.futures.Future, float | None], bool] = _wait_future,
    ):
        self.channel = channel
        self.maxsize = maxsize
        self.where = where
        self._post = post
        self._give_back = give_back
        self._decode = decode
        self._stash = stash or give_back
        self.wait_reply = wait_reply
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._rids = itertools.count()
        self._lost: BaseException | None = None
        #: A reply said the channel is closed (it stays so); written under the lock.
        self.closed_seen = False

    # -- requests -------------------------------------------------------------------------------

    def request(
        self, req: P.Request, timeout: float, tensors: list[torch.Tensor] | None = None,
        inline: bool = True,
    ) -> RequestWork:
        """Send ``req`` (its ``rid`` is set here) and return its handle: the work completes
        with the request's result or error; abandoning a wait withdraws the request (see
        the module docstring).

        Args:
            timeout: seconds ``wait`` waits by default.
            tensors: the tensors of the request's item.
            inline: send from this thread, which is about to wait for the reply
                (``False``: an async op; sent from the flush pool).
        """
        rid = req.rid = next(self._rids)  # type: ignore[union-attr]
        # A blocking caller waits at once (and reads its own reply: wait_reply), so its
        # future is made now; an async op's only when someone waits for it unanswered.
        pending = Pending(req, concurrent.futures.Future() if inline else None)
        with self._lock:
            if self._lost is not None:
                raise self.lost_error(pending.op, pending.key)
            self._pending[rid] = pending
        self._post([(req, tensors or [])], inline, False)
        return RequestWork(self, pending, timeout, inline)

    def post_oneway(self, req: P.Request, tensors: list[torch.Tensor] | None = None) -> None:
        """Send a request that gets no reply (``Cancel``, ``Requeue``), never inline."""
        if self._lost is None:
            self._post([(req, tensors or [])], False, False)

    def future_of(self, p: Pending) -> concurrent.futures.Future:
        """The future of ``p``, made now if it has none (completed at once if settled)."""
        with self._lock:
            fut = p.future
            if fut is not None:
                return fut
            fut = p.future = concurrent.futures.Future()
            settled = p.settled
        if settled:  # the reply came first: the future only reports it
            if p.error is not None:
                fut.set_exception(p.error)
            else:
                fut.set_result(p.value)
        return fut

    def withdraw_request(self, p: Pending) -> None:
        rid = P.rid_of(p.req)
        with self._lock:
            still_pending = rid in self._pending
        if still_pending:
            self.post_oneway(P.Cancel(p.key, rid))

    # -- replies ----------------------------------------------------------------------------------

    def complete(
        self, rid: int, status: P.Status, value: Any = None,
        weights: list[float] | None = None, text: str = "",
    ) -> None:
        """Resolve request ``rid`` with a reply (``value``: the items a get took, as the
        requester's ``decode`` takes them, or a count)."""
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None:
            logger.warning("channel %r: a reply for unknown request %s", self.channel, rid)
            return
        got_items = status == P.OK and p.result in (ONE_ITEM, ITEMS)
        fut = p.future
        if fut is not None and fut.cancelled():
            if got_items:
                self._give_back(p.key, value, weights or [])
            return
        result: Any = None
        error: BaseException | None = None
        if status != P.OK:
            error = self._error(p, status, text)
        else:
            try:
                if p.result == ONE_ITEM:
                    if len(value) > 1:  # items taken ahead: first in line for next gets
                        self._stash(p.key, value[1:], (weights or [])[1:])
                        value, weights = value[:1], (weights or [])[:1]
                    result = self._decode(value[0])
                elif p.result == ITEMS:
                    result = [self._decode(item) for item in value]
                elif p.result == VALUE:
                    result = value
            except Exception as exc:  # noqa: BLE001 - the consumer cannot decode: its error
                error = exc
        if not self._settle(p, result, error) and got_items:
            self._give_back(p.key, value, weights or [])  # cancelled meanwhile

    def complete_done(self, rids: list[int]) -> None:
        """Resolve requests with no result (puts, closes) that succeeded: many at once,
        under one acquisition of the lock."""
        futures: list[concurrent.futures.Future] = []
        unknown = 0
        with self._lock:
            pop = self._pending.pop
            for rid in rids:
                p = pop(rid, None)
                if p is None:
                    unknown += 1
                    continue
                if type(p.req) is P.Close:
                    self.closed_seen = True
                if p.future is None:
                    p.settled = True
                else:
                    futures.append(p.future)
        for fut in futures:
            try:
                fut.set_result(None)
            except concurrent.futures.InvalidStateError:  # cancelled: nothing to give back
                pass
        if unknown:
            logger.warning("channel %r: %d replies for unknown requests", self.channel, unknown)

    def _settle(self, p: Pending, result: Any, error: BaseException | None) -> bool:
        """Record the outcome of ``p``; False if its future was cancelled meanwhile."""
        with self._lock:
            fut = p.future
            if fut is None:
                p.value, p.error, p.settled = result, error, True
                return True
        try:
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
        except concurrent.futures.InvalidStateError:
            return False
        return True

    def _error(self, p: Pending, status: int, text: str) -> BaseException:
        where = f"channel {self.channel!r}: {p.op} on key {p.key!r}"
        is_get = p.result in (ONE_ITEM, ITEMS)
        if status == P.FULL:
            return ChannelFull(f"{where}: the key holds maxsize={self.maxsize} items")
        if status == P.EMPTY:
            return ChannelEmpty(f"{where}: the key holds no item")
        if status == P.CLOSED:
            with self._lock:
                self.closed_seen = True
            if is_get:
                return ChannelClosedError(f"{where}: the channel is closed and the key is drained")
            return ChannelClosedError(f"{where}: the channel is closed; the item was not enqueued")
        if status == P.TIMEOUT:
            what = "nothing was taken" if is_get else "the item was not enqueued"
            return CommTimeoutError(f"{where} timed out after {p.timeout}s; {what}")
        if status == P.CANCELLED:
            return concurrent.futures.CancelledError(f"{where} was withdrawn")
        return ChannelError(text or f"{where} failed ({status})")

    # -- loss -------------------------------------------------------------------------------------

    def lost_error(self, op: str, key: P.Key) -> ChannelLostError:
        return ChannelLostError(
            f"channel {self.channel!r}: {op} on key {key!r} failed: the channel "
            f"worker {self.where} is gone ({self._lost}); the channel's queued items are lost"
        )

    def lose(self, cause: BaseException) -> None:
        """Fail every waiting request, and every later one, with ChannelLostError."""
        with self._lock:
            if self._lost is None:
                self._lost = cause
            pending, self._pending = self._pending, {}
        for p in pending.values():
            self._settle(p, None, self.lost_error(p.op, p.key))

    def fail(self, entries: list[Entry], exc: BaseException) -> None:
        """Fail the requests of ``entries`` (a message that could not be sent)."""
        if isinstance(exc, PeerLostError | PeerNotFoundError):
            self.lose(exc)
            return
        for req, _tensors in entries:
            rid = P.rid_of(req)
            if rid == P.NO_REPLY:  # a write-behind put is its link's to report
                continue
            with self._lock:
                p = self._pending.pop(rid, None)
            if p is None:
                continue
            err = exc
            if isinstance(exc, CommError) and not isinstance(exc, CommTimeoutError):
                err = ChannelLostError(
                    f"channel {self.channel!r}: {p.op} on key {p.key!r}: sending to "
                    f"{self.where} failed: {exc}"
                )
            self._settle(p, None, err)

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def lost_cause(self) -> BaseException | None:
        """Why the channel worker is gone (``None`` while it is not)."""
        return self._lost

    @property
    def awaits_replies(self) -> bool:
        return bool(self._pending)
