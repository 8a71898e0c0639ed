"""``Requester``: request ids, futures and results of one channel worker (or local channel).

A request gets an id and a future; its reply resolves the future, with the request's
result or the error its status means. The handle callers get is an
:class:`~rlcomm.comm.work.AsyncWork` over that future (:meth:`Requester.request`): its
``wait`` lets the waiting thread read its own reply (:meth:`Requester.wait_reply`), and
abandoning a wait (a timeout, an asyncio task cancelled, ``KeyboardInterrupt``) cancels
the future and withdraws the request at the worker (``Cancel``). If its items were on
their way already, they are put back at the head of their key (``Requeue``), so none is
lost.

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

_NONE, _ONE, _MANY, _VALUE = range(4)  # what a request's OK reply resolves to
_RESULTS = {P.Put: _NONE, P.Close: _NONE, P.Get: _ONE, P.GetBatch: _MANY, P.QSize: _VALUE,
            P.Route: _VALUE}


class Description:
    """Names a request of a channel in messages (formatted only when one is written)."""

    __slots__ = ("channel", "req")

    def __init__(self, channel: str, req: P.Request):
        self.channel = channel
        self.req = req

    def __str__(self) -> str:
        key = getattr(self.req, "key", "")
        return f"channel {self.channel!r}: {P.op_name(self.req)} on key {key!r}"


class _Pending:
    __slots__ = ("future", "req", "key", "timeout", "result")

    def __init__(self, future: concurrent.futures.Future, req: P.Request):
        self.future = future
        self.req = req
        self.key = getattr(req, "key", "")
        self.timeout = getattr(req, "timeout", None)
        self.result = _RESULTS[type(req)]

    @property
    def op(self) -> str:
        return P.op_name(self.req)


class Requester:
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
        self._pending: dict[int, _Pending] = {}
        self._rids = itertools.count()
        self._lost: BaseException | None = None

    # -- to be provided by a subclass -------------------------------------------------------

    def _post(self, entries: list[Entry], inline: bool) -> None:
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

    # -- requests -------------------------------------------------------------------------------

    def request(
        self, req: P.Request, description: object, timeout: float,
        tensors: list[torch.Tensor] | None = None, inline: bool = True,
    ) -> AsyncWork:
        """Send ``req`` (its ``rid`` is set here) and return its handle: the work completes
        with the request's result or error; abandoning a wait withdraws the request (see
        the module docstring).

        Args:
            description: names the request in timeout messages.
            timeout: seconds ``wait`` waits by default.
            tensors: the tensors of the request's item.
            inline: send from this thread (``False``: from the flush pool).
        """
        rid = req.rid = next(self._rids)  # type: ignore[union-attr]
        fut: concurrent.futures.Future = concurrent.futures.Future()
        pending = _Pending(fut, req)
        with self._lock:
            if self._lost is not None:
                raise self._lost_error(pending.op, pending.key)
            self._pending[rid] = pending
        self._post([(req, tensors or [])], inline)
        # A blocking caller reads its own reply (wait_reply); an async op's reply is read
        # by the connection's reader, and its waiter just blocks on the future.
        return AsyncWork(fut, description, timeout,
                         waiter=self.wait_reply if inline else None, cancellable=True,
                         on_cancel=lambda: self._withdraw(rid, pending.key))

    def post_oneway(self, req: P.Request, tensors: list[torch.Tensor] | None = None) -> None:
        """Send a request that gets no reply (``Cancel``, ``Requeue``), never inline."""
        if self._lost is None:
            self._post([(req, tensors or [])], False)

    def wait_reply(self, fut: concurrent.futures.Future, timeout: float | None) -> bool:
        """Block until ``fut`` is done (True) or ``timeout`` seconds passed (False)."""
        done, _ = concurrent.futures.wait([fut], timeout)
        return bool(done)

    def _withdraw(self, rid: int, key: P.Key) -> None:
        with self._lock:
            still_pending = rid in self._pending
        if still_pending:
            self.post_oneway(P.Cancel(key, rid))

    # -- replies ----------------------------------------------------------------------------------

    def complete(
        self, rid: int, status: P.Status, value: Any = None,
        weights: list[float] | None = None, text: str = "",
    ) -> None:
        """Resolve the future of request ``rid`` with a reply (``value``: the items a get
        took, as :meth:`_decode` takes them, or a count)."""
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None:
            logger.warning("channel %r: a reply for unknown request %s", self.channel, rid)
            return
        got_items = status == P.OK and p.result in (_ONE, _MANY)
        if p.future.cancelled():
            if got_items:
                self._give_back(p.key, value, weights or [])
            return
        if status != P.OK:
            result: Any = None
            error: BaseException | None = self._error(p, status, text)
        else:
            error = None
            try:
                if p.result == _ONE:
                    result = self._decode(value[0])
                elif p.result == _MANY:
                    result = [self._decode(item) for item in value]
                else:
                    result = value if p.result == _VALUE else None
            except Exception as exc:  # noqa: BLE001 - the consumer cannot decode: its error
                error = exc
        try:
            if error is None:
                p.future.set_result(result)
            else:
                p.future.set_exception(error)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            if got_items:
                self._give_back(p.key, value, weights or [])

    def _error(self, p: _Pending, status: int, text: str) -> BaseException:
        where = f"channel {self.channel!r}: {p.op} on key {p.key!r}"
        is_get = p.result in (_ONE, _MANY)
        if status == P.FULL:
            return ChannelFull(f"{where}: the key holds maxsize={self.maxsize} items")
        if status == P.EMPTY:
            return ChannelEmpty(f"{where}: the key holds no item")
        if status == P.CLOSED:
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
            if not p.future.done():
                try:
                    p.future.set_exception(self._lost_error(p.op, p.key))
                except concurrent.futures.InvalidStateError:
                    pass

    def fail(self, entries: list[Entry], exc: BaseException) -> None:
        """Fail the requests of ``entries`` (a message that could not be sent)."""
        if isinstance(exc, PeerLostError | PeerNotFoundError):
            self.lose(exc)
            return
        for req, _tensors in entries:
            rid = P.rid_of(req)
            with self._lock:
                p = self._pending.pop(rid, None) if rid != P.NO_REPLY else None
            if p is None or p.future.done():
                continue
            err = exc
            if isinstance(exc, CommError) and not isinstance(exc, CommTimeoutError):
                err = ChannelLostError(
                    f"channel {self.channel!r}: {p.op} on key {p.key!r}: sending to "
                    f"{self.where} failed: {exc}"
                )
            try:
                p.future.set_exception(err)
            except concurrent.futures.InvalidStateError:
                pass

    @property
    def lost(self) -> bool:
        return self._lost is not None

    @property
    def awaits_replies(self) -> bool:
        return bool(self._pending)
