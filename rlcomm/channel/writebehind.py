"""Write-behind puts: how a :class:`~rlcomm.channel.client.Link` sends a blocking
``put`` without waiting for the worker (see :mod:`~rlcomm.channel.client`), and settles
what it sent so.

A write-behind ``Put`` has no request id: the worker answers it only if it does not
enqueue it (``Unaccepted``). A :class:`WriteBehind` counts what it sent and what a
``Sync`` round trip covered (:meth:`WriteBehind.settle`), keeps the first refusal until
a call can raise it, and, once a reply said the channel is closed, refuses later puts
at once. It owns those counts, under its own lock; the link's
:class:`~rlcomm.channel.requester.Requester` sends its messages and knows whether the
worker is gone.
"""

from __future__ import annotations

import logging
import threading

import torch

from rlcomm.channel import protocol as P
from rlcomm.channel.requester import Post, Requester
from rlcomm.errors import ChannelClosedError, ChannelError, ChannelLostError

logger = logging.getLogger(__name__)


class WriteBehind:
    """The write-behind puts of one link (see the module docstring).

    Args:
        requests: the link's requests: how messages are sent, whether the worker is gone.
        post: sends requests (the link's outbox).
    """

    def __init__(self, requests: Requester, post: Post):
        self._requests = requests
        self._post = post
        self._lock = threading.Lock()
        self._behind_sent = 0  # write-behind puts sent
        self._behind_settled = 0  # of them, how many a Sync covered
        self._unaccepted: BaseException | None = None  # the first refused, until raised
        self._unaccepted_count = 0
        self._closed_seen = False  # an Unaccepted said the channel is closed

    def __repr__(self) -> str:
        return (f"WriteBehind({self._requests.channel!r}, sent={self._behind_sent}, "
                f"settled={self._behind_settled}, unaccepted={self._unaccepted_count})")

    def put_behind(self, req: P.Put, tensors: list[torch.Tensor], hold: bool = False,
                   inline: bool = True) -> None:
        """Send a put without waiting for the worker: it is applied in order after this
        process's earlier requests, and answered only if it is not enqueued (raised by
        a later :meth:`put_behind` or :meth:`settle`). With ``hold`` (an async put whose
        item has no tensors), it may wait a moment for later requests to travel with
        (:mod:`~rlcomm.channel.outbox`); ``inline`` False: it is never sent from this
        thread (an asyncio event loop's).

        Raises:
            ChannelLostError: the worker is gone.
            ChannelClosedError: an earlier write-behind put was not enqueued.
        """
        req.rid = P.NO_REPLY
        requests = self._requests
        if requests.lost:
            raise requests.lost_error("put", req.key)
        with self._lock:
            if (self._closed_seen or requests.closed_seen) and self._unaccepted is None:
                raise ChannelClosedError(f"channel {requests.channel!r}: put on key {req.key!r}: "
                                         "the channel is closed; the item was not enqueued")
            unaccepted = self._take_unaccepted()
            if unaccepted is None:
                self._behind_sent += 1
        if unaccepted is not None:
            raise unaccepted
        self._post([(req, tensors)], inline, hold)

    @property
    def unsettled(self) -> bool:
        """Whether write-behind puts were sent since the last :meth:`settle` covered them,
        or one was not enqueued and no call has raised it yet."""
        return self._behind_sent != self._behind_settled or self._unaccepted is not None

    def settle(self, timeout: float, report: bool = True) -> None:
        """Wait until the worker applied every write-behind put sent so far (one
        ``Sync`` round trip; none when there is nothing to wait for). With ``report``
        False, a refusal or a lost worker is left for this link's next put or settle
        to raise, and only a timeout raises here.

        Raises:
            ChannelClosedError: one of them was not enqueued (the channel was closed).
            ChannelLostError: the worker is gone (they may be lost with it).
            CommTimeoutError: no answer within ``timeout``.
        """
        requests = self._requests
        with self._lock:
            sent = self._behind_sent
            waits = sent != self._behind_settled
        if waits:
            if not requests.lost:
                try:
                    requests.request(P.Sync(P.NO_REPLY), timeout, None, True).wait()
                except ChannelLostError:
                    pass
            if requests.lost:
                if not report:
                    return
                with self._lock:
                    self._behind_settled = self._behind_sent
                raise ChannelLostError(
                    f"channel {requests.channel!r}: the channel worker {requests.where} is "
                    f"gone ({requests.lost_cause}); puts this process sent without waiting "
                    "for it may not have reached it")
            with self._lock:
                self._behind_settled = max(self._behind_settled, sent)
        if not report:
            return
        with self._lock:
            unaccepted = self._take_unaccepted()
        if unaccepted is not None:
            raise unaccepted

    def note_unaccepted(self, key: P.Key, status: int, cause: str = "") -> None:
        """A write-behind put on ``key`` was not enqueued (``status`` says why)."""
        worker = self._requests.where
        where = f"channel {self._requests.channel!r}: put on key {key!r} (sent without waiting)"
        if status == P.CLOSED:
            exc: BaseException = ChannelClosedError(
                f"{where} was not enqueued: the channel was closed before it reached {worker}")
        else:
            exc = ChannelError(f"{where} was not enqueued by {worker} "
                               f"({cause or P.Status(status).name}; see that worker's log)")
        logger.warning("%s", exc)
        with self._lock:
            self._closed_seen |= status == P.CLOSED
            self._unaccepted_count += 1
            if self._unaccepted is None:
                self._unaccepted = exc

    def _take_unaccepted(self) -> BaseException | None:
        """The first unaccepted write-behind put's error, then forgotten (under the lock)."""
        exc, n = self._unaccepted, self._unaccepted_count
        if exc is None:
            return None
        self._unaccepted, self._unaccepted_count = None, 0
        if n > 1:
            exc.args = (f"{exc.args[0]} (and {n - 1} more such puts)",)
        return exc

