"""The handle of one channel request: :class:`RequestWork`, an
:class:`~rlcomm.AsyncWork` whose future is made only when someone must wait for it, and
the pending request (:class:`Pending`) it reads its outcome from. The
:class:`~rlcomm.channel.requester.Requester` that sent the request resolves it."""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

from rlcomm.channel import protocol as P
from rlcomm.comm.work import AsyncWork

if TYPE_CHECKING:
    from rlcomm.channel.requester import Requester

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
