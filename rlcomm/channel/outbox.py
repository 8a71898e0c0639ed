"""``Outbox``: entries bound for one peer, coalesced into as few messages as possible.

Any thread may :meth:`Outbox.post` entries. At most one thread *flushes* an outbox at a
time: it takes every entry posted so far and sends them as one message, and goes on
until the outbox is empty. A thread that posts while another flushes just leaves its
entries for that flusher. So entries keep their posting order, a lone caller sends its
own request from its own thread (no hand-off), and requests posted faster than the
transport takes them (``async_op`` puts in a loop, replies to many clients) travel in
batches, one message each.

A message that cannot be encoded (:class:`~rlcomm.CodecError`) is retried entry by entry,
so only the entry at fault fails.

Flushing off the posting thread: ``post(..., inline=False)`` never sends from the
calling thread, for callers that must not block (an asyncio event loop). Nor does a
post when ``may_inline(batch)`` says no to a batch: the flush then moves, from that
batch on, to the outbox's own *executor* when it was given one, else to a small
process-wide pool. A channel worker gives each client's outbox a thread of its own and
sends inline only what cannot wait on the client, so a client that stops reading holds
up its own replies and no one else's.

Held entries (``post(..., hold=True)``): entries that need not leave at once (async
puts that get no reply) wait for company. A holding post sends nothing while fewer than
:data:`HOLD_ENTRIES` entries are queued; the queued entries leave with the next post that
sends, or with the holding post that makes them :data:`HOLD_ENTRIES` (sent as that post
asks: inline or not), or, at the latest, :data:`HOLD_SECONDS` after the first of them was
held (a flush the pool runs then). A flusher sends what is queued when it starts; after
that, held entries fewer than :data:`HOLD_ENTRIES` stay for company. So a loop of such
posts sends about one message per :data:`HOLD_ENTRIES` entries, and a lone one leaves
within about :data:`HOLD_SECONDS`.

:meth:`Outbox.close` fails the entries still queued and every later one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcomm.errors import CodecError

logger = logging.getLogger(__name__)

#: Held entries leave once this many are queued ...
HOLD_ENTRIES = 64
#: ... or this many seconds after the first was held.
HOLD_SECONDS = 200e-6

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _flush_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(4, "rlcomm-channel-flush")
        return _pool


class Outbox:
    """Entries bound for one peer (see the module docstring).

    Args:
        send: sends a list of entries as one message; raises on failure.
        failed: called with the entries of a message that could not be sent and the error.
        executor: runs the flushes that leave the posting thread; the process-wide flush
            pool when ``None``.
        may_inline: asked, before a posting thread sends a batch, whether it may (the
            batch cannot make it wait); ``None``: always.
    """

    def __init__(
        self,
        send: Callable[[list[Any]], None],
        failed: Callable[[list[Any], BaseException], None],
        executor: concurrent.futures.Executor | None = None,
        may_inline: Callable[[list[Any]], bool] | None = None,
    ):
        self._send = send
        self._failed = failed
        self._executor = executor
        self._may_inline = may_inline
        self._lock = threading.Lock()
        self._entries: list[Any] = []
        self._flushing = False
        self._sending = 0  # entries the flusher took and has not sent (or failed) yet
        self._closed: BaseException | None = None
        self._timer_armed = False  # a delayed flush of held entries is on its way
        self._unheld = 0  # queued entries posted without hold (they go at once)
        #: Messages sent by posting threads, and by the executor.
        self.sent_inline = 0
        self.sent_off = 0

    @property
    def pending(self) -> int:
        """Entries posted and not sent yet: queued, or in the message being sent."""
        with self._lock:
            return len(self._entries) + self._sending

    def post(self, entries: list[Any], inline: bool = True, hold: bool = False) -> None:
        """Queue ``entries``; send them now from this thread unless another is sending.

        Args:
            inline: ``False`` to hand the sending to the executor (or flush pool).
            hold: the entries may wait for company (see the module docstring).
        """
        arm = False
        with self._lock:
            closed = self._closed
            if closed is None:
                self._entries.extend(entries)
                if not hold:
                    self._unheld += len(entries)
                if self._flushing:
                    return
                if hold and len(self._entries) < HOLD_ENTRIES:
                    if self._timer_armed:
                        return
                    self._timer_armed = arm = True
                else:
                    self._flushing = True
        if closed is not None:
            self._fail(entries, closed)
        elif arm:
            self._arm_timer()
        elif inline:
            self._flush(False)
        else:
            self._hand_off()

    def _arm_timer(self) -> None:
        try:
            _flush_pool().submit(self._flush_held)
        except RuntimeError:  # the pool is shut down (interpreter exit): send them now
            self._flush_held(0)

    def _flush_held(self, delay: float = HOLD_SECONDS) -> None:
        """Send the held entries ``delay`` seconds on, unless a post sent them first."""
        if delay:
            time.sleep(delay)
        with self._lock:
            self._timer_armed = False
            if self._flushing or not self._entries:
                return
            self._flushing = True
        self._flush(True)

    def close(self, exc: BaseException) -> None:
        """Fail the entries still queued, and every later post, with ``exc``.

        A message being sent meanwhile ends on its own (an outbox is closed when its peer
        is gone, so that send fails too).
        """
        with self._lock:
            if self._closed is not None:
                return
            self._closed = exc
            queued, self._entries, self._unheld = self._entries, [], 0
        if queued:
            self._fail(queued, exc)

    def _hand_off(self) -> None:
        """Let the executor go on flushing (this thread holds the flushing turn)."""
        try:
            (self._executor or _flush_pool()).submit(self._flush, True)
        except RuntimeError as exc:  # the executor was shut down: the outbox is done
            with self._lock:
                queued, self._entries, self._unheld = self._entries, [], 0
                self._flushing = False
            if queued:
                self._fail(queued, exc)

    def _flush(self, off_poster: bool) -> None:
        first = True
        while True:
            arm = False
            with self._lock:
                batch = self._entries
                # After the first message, held entries too few to go wait for company.
                wait = not first and not self._unheld and len(batch) < HOLD_ENTRIES
                if not batch or wait:
                    self._flushing = False
                    self._sending = 0
                    if batch and not self._timer_armed:
                        self._timer_armed = arm = True
                else:
                    self._entries, self._unheld = [], 0
                    self._sending = len(batch)
            if not batch or wait:
                if arm:
                    self._arm_timer()
                return
            first = False
            if not off_poster and self._may_inline is not None and not self._may_inline(batch):
                with self._lock:  # back to the head, and the rest goes off this thread
                    self._entries[:0] = batch
                    self._unheld += len(batch)
                    self._sending = 0
                self._hand_off()
                return
            if off_poster:
                self.sent_off += 1
            else:
                self.sent_inline += 1
            self._send_or_fail(batch)

    def _send_or_fail(self, batch: list[Any]) -> None:
        try:
            self._send(batch)
        except CodecError as exc:
            if len(batch) == 1:
                self._fail(batch, exc)
                return
            # One bad entry must not fail the others it was batched with.
            for entry in batch:
                self._send_or_fail([entry])
        except Exception as exc:  # noqa: BLE001 - handed to the entries' owners
            self._fail(batch, exc)

    def _fail(self, batch: list[Any], exc: BaseException) -> None:
        try:
            self._failed(batch, exc)
        except Exception:  # noqa: BLE001 - a failing handler must not wedge the outbox
            logger.exception("handling a failed channel send raised")
