"""``Outbox``: entries bound for one peer, coalesced into as few messages as possible.

Any thread may :meth:`Outbox.post` entries. At most one thread *flushes* an outbox at a
time: it takes every entry posted so far and sends them as one message, and goes on
until the outbox is empty. A thread that posts while another flushes just leaves its
entries for that flusher. So entries keep their posting order, a lone caller sends its
own request from its own thread (no hand-off), and requests posted faster than the
transport takes them (``async_op`` puts in a loop, replies to many clients) travel in
batches, one message each.

A message that cannot be encoded (:class:`~rlcomm.CodecError`) is retried entry by entry,
so only the entry at fault fails. ``post(..., inline=False)`` never sends from the calling thread: the flush runs on a
small process-wide pool, for callers that must not block (an asyncio event loop).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from rlcomm.errors import CodecError

logger = logging.getLogger(__name__)

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
    """

    def __init__(
        self,
        send: Callable[[list[Any]], None],
        failed: Callable[[list[Any], BaseException], None],
    ):
        self._send = send
        self._failed = failed
        self._lock = threading.Lock()
        self._entries: list[Any] = []
        self._flushing = False

    def post(self, entries: list[Any], inline: bool = True) -> None:
        """Queue ``entries``; send them now from this thread unless another is sending.

        Args:
            inline: ``False`` to hand the sending to the flush pool.
        """
        with self._lock:
            if self._flushing:
                self._entries.extend(entries)
                return
            self._flushing = True
            if not inline or self._entries:
                self._entries.extend(entries)
                entries = []
        if not inline:
            _flush_pool().submit(self._flush)
            return
        if entries:  # a lone poster: send its own entries without queueing them
            self._send_or_fail(entries)
        self._flush()

    def _flush(self) -> None:
        while True:
            with self._lock:
                batch, self._entries = self._entries, []
                if not batch:
                    self._flushing = False
                    return
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
