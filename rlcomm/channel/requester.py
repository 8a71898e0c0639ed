"""``Requester``: request ids, futures and results of one channel worker (or local channel).

A request gets an id; its reply resolves it, with the request's result or the error its
status means. The handle callers get is a :class:`RequestWork` (an
:class:`~rlcomm.comm.work.AsyncWork`): its ``wait`` lets a blocking caller read its own
reply (:meth:`Requester.wait_reply`), and abandoning a wait (a timeout, an asyncio task
cancelled, ``KeyboardInterrupt``) cancels it and withdraws the request at the worker
(``Cancel``). If its items were on their way already, they are put back at the head of
their key (``Requeue``), so none is lost. An async request gets a future only when
someone has to wait for it; replies to many puts are resolved at once
(:meth:`Requester.complete_done`).

How requests travel and items are carried is the subclass's business:
:class:`~rlcomm.channel.client.Link` (a channel worker, items as encoded payloads) and
:class:`~rlcomm.channel.local.LocalLink` (in-process, items as they are).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from typing import Any

import torch

from rlcomm.channel import protocol as P
from rlcomm.channel.handle import ITEMS, ONE_ITEM, VALUE, Pending, RequestWork
from rlcomm.channel.writebehind import WriteBehind
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



class Requester(WriteBehind):
    """Request ids and futures of one channel worker (see the module docstring).

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
        self._pending: dict[int, Pending] = {}
        self._rids = itertools.count()
        self._lost: BaseException | None = None
        self._init_write_behind()

    # -- to be provided by a subclass -------------------------------------------------------

    def _post(self, entries: list[Entry], inline: bool, hold: bool = False) -> None:
        raise NotImplementedError

    def prepare_item(self, item: Any) -> tuple[Any, list[torch.Tensor]]:
        """What a ``Put`` carries for ``item`` and the tensors beside it (default: the
        item itself, for an in-process channel).

        Raises:
            CodecError: the item cannot be encoded.
        """
        return item, []

    def _decode(self, item: Any) -> Any:
        """The item a caller gets from what a reply carried."""
        return item

    def _give_back(self, key: P.Key, items: list[Any], weights: list[float]) -> None:
        """Items that reached a request no one waits for go back to the head of ``key``."""
        raise NotImplementedError

    def _stash(self, key: P.Key, items: list[Any], weights: list[float]) -> None:
        """Keep items a get took ahead (prefetch) for this process's next gets of ``key``."""
        self._give_back(key, items, weights)

    def take_prefetched(self, key: P.Key) -> tuple[bool, Any]:
        """``(True, item)``: the next item of ``key`` taken ahead by an earlier get of
        this process; ``(False, None)`` when there is none."""
        return False, None

    def prefetched(self, key: P.Key) -> int:
        """How many items of ``key`` this process holds taken ahead."""
        return 0

    def prefetched_upto(self, key: P.Key, weight: float) -> list[tuple[Any, float]]:
        """Items of ``key`` taken ahead, from the head until their weights reach
        ``weight``, with their weights (for a ``get_batch``)."""
        return []

    def unget(self, key: P.Key, entries: list[tuple[Any, float]]) -> None:
        """Put back items :meth:`prefetched_upto` took, ahead of the key."""


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
                raise self._lost_error(pending.op, pending.key)
            self._pending[rid] = pending
        self._post([(req, tensors or [])], inline)
        return RequestWork(self, pending, timeout, inline)

    def post_oneway(self, req: P.Request, tensors: list[torch.Tensor] | None = None) -> None:
        """Send a request that gets no reply (``Cancel``, ``Requeue``), never inline."""
        if self._lost is None:
            self._post([(req, tensors or [])], False)

    def wait_reply(self, fut: concurrent.futures.Future, timeout: float | None) -> bool:
        """Block until ``fut`` is done (True) or ``timeout`` seconds passed (False)."""
        done, _ = concurrent.futures.wait([fut], timeout)
        return bool(done)

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
        """Resolve request ``rid`` with a reply (``value``: the items a get took, as
        :meth:`_decode` takes them, or a count)."""
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
                    self._closed_seen = True
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
            self._closed_seen = True
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

    def _lost_error(self, op: str, key: P.Key) -> ChannelLostError:
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
            self._settle(p, None, self._lost_error(p.op, p.key))

    def fail(self, entries: list[Entry], exc: BaseException) -> None:
        """Fail the requests of ``entries`` (a message that could not be sent)."""
        if isinstance(exc, PeerLostError | PeerNotFoundError):
            self.lose(exc)
            return
        for req, _tensors in entries:
            rid = P.rid_of(req)
            if rid == P.NO_REPLY:
                if type(req) is P.Put:  # write-behind: its producer hears of it later
                    self.note_unaccepted(req.key, P.ERROR, f"sending it failed: {exc}")
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
    def awaits_replies(self) -> bool:
        return bool(self._pending)
