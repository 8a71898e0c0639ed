"""``ChannelCore``: a :class:`ChannelState` behind a lock, with a deadline thread.

Used by the channel worker (replies go out as rlcomm messages) and by a local channel
(replies resolve futures in the same process). Threads: the callers of :meth:`handle`
(one reader thread per client in a channel worker) apply requests under the lock and
deliver the replies after releasing it; the core's own *timer* thread answers parked
requests whose deadline passed. No thread ever waits on a queue's state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from rlcomm.channel import protocol as P
from rlcomm.channel.state import ChannelState, Delivery

logger = logging.getLogger(__name__)

#: Receives the replies due to one client: ``deliver(client, deliveries)``.
Deliver = Callable[[Hashable, list[Delivery]], None]


class ChannelCore:
    """Thread-safe channel queues (see the module docstring).

    Args:
        name: the channel's name, for messages.
        maxsize: items per key; 0 for unbounded.
        deliver: called outside the lock with the replies due to each client, in order.
        view: turns a stored item into what :meth:`peek` shows (a channel worker stores
            encoded items); ``None``: the item itself.
        lend_cost: what a stored item costs a get that takes it ahead for its process,
            ``None`` for one it may not (:class:`~rlcomm.channel.state.ChannelState`);
            ``None``: no prefetch.
    """

    def __init__(self, name: str, maxsize: int, deliver: Deliver,
                 view: Callable[[Any], Any] | None = None,
                 lend_cost: Callable[[Any], int | None] | None = None):
        self.name = name
        self._view = view
        self._state = ChannelState(name, maxsize, lend_cost)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._deliver = deliver
        self._stopped = False
        self._timer = threading.Thread(
            target=self._run_timer, name=f"rlcomm-channel-timer-{name}", daemon=True
        )
        self._timer.start()

    @property
    def maxsize(self) -> int:
        return self._state.maxsize

    def handle(self, client: Hashable, requests: list[P.Request]) -> None:
        """Apply the requests of one message from ``client`` and deliver the replies."""
        out: list[Delivery] = []
        now = time.monotonic()
        with self._lock:
            before = self._state.next_deadline()
            for req in requests:
                try:
                    self._state.handle(client, req, now, out)
                except Exception as exc:  # noqa: BLE001 - answered to the requester
                    logger.exception("channel %r: request %s failed", self.name, P.op_name(req))
                    rid = P.rid_of(req)
                    if rid == P.NO_REPLY and type(req) is P.Put:  # write-behind: say so
                        out.append(Delivery(client, rid, P.ERROR, req.key))
                    elif rid != P.NO_REPLY:
                        text = (
                            f"channel {self.name!r}: {P.op_name(req)} on key "
                            f"{getattr(req, 'key', '')!r} failed in the channel worker: {exc!r}"
                        )
                        out.append(Delivery(client, rid, P.ERROR, text))
            after = self._state.next_deadline()
            if after is not None and (before is None or after < before):
                self._wake.notify()
        self._dispatch(out)

    def requeue(self, key: P.Key, items: list[Any], weights: list[float]) -> None:
        """Put undelivered items back at the head of ``key``."""
        out: list[Delivery] = []
        with self._lock:
            self._state.requeue(key, items, weights, out)
        self._dispatch(out)

    def drop_client(self, client: Hashable) -> None:
        """Forget the parked requests of a client that is gone."""
        out: list[Delivery] = []
        with self._lock:
            self._state.drop_client(client, out)
        self._dispatch(out)

    def peek(self, key: P.Key) -> list[Any]:
        """The items queued on ``key`` now, head first (not taken)."""
        with self._lock:
            items = self._state.peek(key)
        return items if self._view is None else [self._view(item) for item in items]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return self._state.stats()

    def describe(self, timeout: float) -> dict[str, Any]:
        """Whether the channel is closed, and its keys (:meth:`ChannelState.describe`);
        waits at most ``timeout`` seconds for the lock (a report must not hang on it)."""
        if not self._lock.acquire(timeout=timeout):
            return {"error": f"the channel's lock was held for over {timeout}s"}
        try:
            return {"closed": self._state.closed, "maxsize": self._state.maxsize,
                    "keys": self._state.describe()}
        finally:
            self._lock.release()

    def stop(self) -> None:
        """End the timer thread (parked requests are no longer timed out)."""
        with self._lock:
            self._stopped = True
            self._wake.notify()

    def _dispatch(self, out: list[Delivery]) -> None:
        if not out:
            return
        by_client: dict[Hashable, list[Delivery]] = {}
        for d in out:
            by_client.setdefault(d.client, []).append(d)
        for client, deliveries in by_client.items():
            try:
                self._deliver(client, deliveries)
            except Exception:  # noqa: BLE001 - one client's failure must not stop the others
                logger.exception("channel %r: delivering replies to %s failed", self.name, client)

    def _run_timer(self) -> None:
        with self._lock:
            while not self._stopped:
                deadline = self._state.next_deadline()
                now = time.monotonic()
                if deadline is None or deadline > now:
                    self._wake.wait(None if deadline is None else deadline - now)
                    continue
                out: list[Delivery] = []
                self._state.expire(now, out)
                self._lock.release()
                try:
                    self._dispatch(out)
                finally:
                    self._lock.acquire()
