"""The queues of one channel worker: items per key, parked requests, deadlines.

Pure and single-threaded: :class:`ChannelState` takes requests and returns the replies
they cause, to whichever client they are due. A request that cannot be answered now (a
get on an empty key, a put on a full one) is *parked* in that key's waiter queue and
answered later by whichever request changes the key's state (a put wakes a parked get,
a get admits a parked put, ``close`` answers everyone), or by :meth:`ChannelState.expire`
at its deadline. Nothing here blocks, so the thread that feeds it never waits on a
queue. :class:`~rlcomm.channel.core.ChannelCore` adds the lock and the deadline thread.

Rules (the channel's documented semantics live here):

- ``maxsize`` bounds the items queued *per key*; 0 means unbounded. A put on a full key
  parks until a get makes room; puts parked on one key are admitted in arrival order,
  and a new put queues behind parked ones, so one producer's items keep their order.
- Parked gets and get_batches of one key are served in arrival order: a request that
  arrives while others wait queues behind them, so a large ``get_batch`` is not starved
  by later small gets. ``get_nowait`` never waits: it takes an item whenever the key
  holds one.
- ``get_batch(target)`` takes items from the head until their weights sum to at least
  ``target``, all in one reply. When the key holds ``maxsize`` items whose weights are
  still below the target, those items are the batch (the key could never hold more).
- ``close()``: parked and later puts are answered ``CLOSED``; gets drain what is queued
  (a waiting ``get_batch`` gets the remaining items as a *partial batch*), then are
  answered ``CLOSED``.
- A request that reaches its deadline while parked is answered ``TIMEOUT``; a timed-out
  put was not enqueued and a timed-out get took nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable
from typing import Any

from rlcomm.channel import protocol as P

#: A reply due to a client: ``(client, (rid, status, weights), item, requeue)``.
#: ``requeue`` is ``(key, items, weights)`` for replies that hand out items (so a reply
#: that cannot be delivered can put them back), else ``None``.
Delivery = tuple[Hashable, tuple, Any, Any]


class _Waiter:
    """A parked request."""

    __slots__ = ("client", "rid", "op", "key", "arg", "item", "deadline", "done")

    def __init__(
        self, client: Hashable, rid: int, op: int, key: P.Key, arg: Any, item: Any, deadline: float
    ):
        self.client = client
        self.rid = rid
        self.op = op
        self.key = key
        self.arg = arg
        self.item = item
        self.deadline = deadline
        self.done = False


class _KeyQueue:
    """The items of one key and the requests parked on it."""

    __slots__ = ("items", "weights", "weight", "getters", "putters", "puts", "gets")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.weights: deque[float] = deque()
        self.weight: float = 0
        self.getters: deque[_Waiter] = deque()
        self.putters: deque[_Waiter] = deque()
        self.puts = 0  # items accepted, ever
        self.gets = 0  # items handed out, ever

    def push(self, item: Any, weight: float) -> None:
        self.items.append(item)
        self.weights.append(weight)
        self.weight += weight
        self.puts += 1

    def pop(self, n: int) -> tuple[list[Any], list[float]]:
        items = [self.items.popleft() for _ in range(n)]
        weights = [self.weights.popleft() for _ in range(n)]
        self.weight = self.weight - sum(weights) if self.items else 0
        self.gets += n
        return items, weights


class ChannelState:
    """The queues of one channel worker (see the module docstring). Not thread-safe.

    Args:
        name: the channel's name, for messages.
        maxsize: items per key; 0 for unbounded.
    """

    def __init__(self, name: str, maxsize: int):
        self.name = name
        self.maxsize = maxsize
        self.closed = False
        self._keys: dict[P.Key, _KeyQueue] = {}
        self._parked: dict[tuple[Hashable, int], _Waiter] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()

    # -- queries ------------------------------------------------------------------------

    def qsize(self, key: P.Key) -> int:
        kq = self._keys.get(key)
        return len(kq.items) if kq is not None else 0

    def peek(self, key: P.Key) -> list[Any]:
        """The items queued on ``key``, head first, without taking them."""
        kq = self._keys.get(key)
        return list(kq.items) if kq is not None else []

    def stats(self) -> dict[str, Any]:
        """Counters: items accepted and handed out per key, queued now, parked requests."""
        return {
            "closed": self.closed,
            "keys": {
                key: {"puts": kq.puts, "gets": kq.gets, "queued": len(kq.items)}
                for key, kq in self._keys.items()
            },
            "puts": sum(kq.puts for kq in self._keys.values()),
            "gets": sum(kq.gets for kq in self._keys.values()),
            "parked": len(self._parked),
        }

    def next_deadline(self) -> float | None:
        """The earliest deadline of a parked request (monotonic seconds), if any."""
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    # -- requests -----------------------------------------------------------------------

    def handle(
        self,
        client: Hashable,
        head: tuple,
        item: Any,
        now: float,
        out: list[Delivery],
    ) -> None:
        """Apply one request ``(op, rid, key, arg, timeout)``; append replies to ``out``."""
        op, rid, key, arg, timeout = head
        if op == P.PUT or op == P.PUT_NOWAIT:
            self._put(client, op, rid, key, arg, timeout, item, now, out)
        elif op == P.GET or op == P.GET_NOWAIT or op == P.GET_BATCH:
            self._get(client, op, rid, key, arg, timeout, now, out)
        elif op == P.QSIZE:
            out.append((client, (rid, P.OK, None), self.qsize(key), None))
        elif op == P.CLOSE:
            self.close(out)
            out.append((client, (rid, P.OK, None), None, None))
        elif op == P.CANCEL:
            self.cancel(client, arg, out)
        elif op == P.REQUEUE:
            self.requeue(key, item, arg, out)
        else:
            text = f"channel {self.name!r}: unknown request op {op!r}"
            if rid != P.NO_REPLY:
                out.append((client, (rid, P.ERROR, None), text, None))

    def _put(
        self, client: Hashable, op: int, rid: int, key: P.Key, weight: float,
        timeout: float | None, item: Any, now: float, out: list[Delivery],
    ) -> None:
        if self.closed:
            out.append((client, (rid, P.CLOSED, None), None, None))
            return
        kq = self._key(key)
        if kq.putters or self._full(kq):
            if op == P.PUT_NOWAIT:
                out.append((client, (rid, P.FULL, None), None, None))
            else:
                self._park(kq.putters, _Waiter(client, rid, op, key, weight, item,
                                               self._deadline(now, timeout)))
            return
        kq.push(item, weight)
        out.append((client, (rid, P.OK, None), None, None))
        self._serve(key, kq, out)

    def _get(
        self, client: Hashable, op: int, rid: int, key: P.Key, target: Any,
        timeout: float | None, now: float, out: list[Delivery],
    ) -> None:
        kq = self._key(key)
        if op == P.GET_NOWAIT:
            if kq.items:
                self._reply_items(client, rid, op, key, kq, 1, out)
                self._serve(key, kq, out)
            else:
                status = P.CLOSED if self.closed else P.EMPTY
                out.append((client, (rid, status, None), None, None))
            return
        if not kq.getters:
            n = self._take(kq, op, target)
            if n is not None:
                self._answer(client, rid, op, key, kq, n, out)
                self._serve(key, kq, out)
                return
        self._park(kq.getters, _Waiter(client, rid, op, key, target, None,
                                       self._deadline(now, timeout)))

    def close(self, out: list[Delivery]) -> None:
        """Close the channel: answer parked puts ``CLOSED``, parked gets as they drain."""
        if self.closed:
            return
        self.closed = True
        for key, kq in self._keys.items():
            while kq.putters:
                w = kq.putters.popleft()
                self._finish(w)
                out.append((w.client, (w.rid, P.CLOSED, None), None, None))
            self._serve(key, kq, out)

    def cancel(self, client: Hashable, rid: int, out: list[Delivery]) -> None:
        """Withdraw a parked request of ``client``; it is answered ``CANCELLED``.

        A request that was answered already is left alone (its reply is on its way).
        """
        w = self._parked.get((client, rid))
        if w is None:
            return
        kq = self._keys[w.key]
        (kq.putters if w.op in P.PUT_OPS else kq.getters).remove(w)
        self._finish(w)
        out.append((client, (rid, P.CANCELLED, None), None, None))
        self._serve(w.key, kq, out)

    def requeue(self, key: P.Key, items: list[Any], weights: list[float], out: list[Delivery]) -> None:
        """Put items that were handed out but not delivered back at the head of ``key``."""
        if not items:
            return
        kq = self._key(key)
        for item, weight in zip(reversed(items), reversed(weights), strict=True):
            kq.items.appendleft(item)
            kq.weights.appendleft(weight)
            kq.weight += weight
        kq.gets -= len(items)
        self._serve(key, kq, out)

    def drop_client(self, client: Hashable, out: list[Delivery]) -> None:
        """Forget the parked requests of a client that is gone (no replies)."""
        for (c, _), w in list(self._parked.items()):
            if c != client:
                continue
            kq = self._keys[w.key]
            (kq.putters if w.op in P.PUT_OPS else kq.getters).remove(w)
            self._finish(w)
            self._serve(w.key, kq, out)

    def expire(self, now: float, out: list[Delivery]) -> None:
        """Answer ``TIMEOUT`` to every parked request whose deadline is past."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done:
                continue
            kq = self._keys[w.key]
            (kq.putters if w.op in P.PUT_OPS else kq.getters).remove(w)
            self._finish(w)
            out.append((w.client, (w.rid, P.TIMEOUT, None), None, None))
            self._serve(w.key, kq, out)

    # -- internals -----------------------------------------------------------------------

    def _key(self, key: P.Key) -> _KeyQueue:
        kq = self._keys.get(key)
        if kq is None:
            kq = self._keys[key] = _KeyQueue()
        return kq

    def _full(self, kq: _KeyQueue) -> bool:
        return 0 < self.maxsize <= len(kq.items)

    def _deadline(self, now: float, timeout: float | None) -> float:
        return float("inf") if timeout is None else now + timeout

    def _park(self, queue: deque[_Waiter], w: _Waiter) -> None:
        queue.append(w)
        self._parked[(w.client, w.rid)] = w
        if w.deadline != float("inf"):
            heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))

    def _finish(self, w: _Waiter) -> None:
        w.done = True
        self._parked.pop((w.client, w.rid), None)

    def _take(self, kq: _KeyQueue, op: int, target: Any) -> int | None:
        """How many items a get may take now (0: answer CLOSED), or None to wait."""
        if op != P.GET_BATCH:
            return 1 if kq.items else (0 if self.closed else None)
        if kq.items and kq.weight >= target:
            acc, n = 0, 0
            for w in kq.weights:
                acc += w
                n += 1
                if acc >= target:
                    return n
        if kq.items and (self.closed or self._full(kq)):
            return len(kq.items)  # a partial batch: the key cannot grow past this
        return 0 if self.closed else None

    def _answer(
        self, client: Hashable, rid: int, op: int, key: P.Key, kq: _KeyQueue, n: int,
        out: list[Delivery],
    ) -> None:
        if n == 0:
            out.append((client, (rid, P.CLOSED, None), None, None))
        else:
            self._reply_items(client, rid, op, key, kq, n, out)

    def _reply_items(
        self, client: Hashable, rid: int, op: int, key: P.Key, kq: _KeyQueue, n: int,
        out: list[Delivery],
    ) -> None:
        items, weights = kq.pop(n)
        if op == P.GET_BATCH:
            out.append((client, (rid, P.OK, weights), items, (key, items, weights)))
        else:
            out.append((client, (rid, P.OK, weights[0]), items[0], (key, items, weights)))

    def _serve(self, key: P.Key, kq: _KeyQueue, out: list[Delivery]) -> None:
        """Answer parked requests of ``key`` in order for as long as its state allows."""
        progress = True
        while progress:
            progress = False
            while kq.getters:
                w = kq.getters[0]
                n = self._take(kq, w.op, w.arg)
                if n is None:
                    break
                kq.getters.popleft()
                self._finish(w)
                self._answer(w.client, w.rid, w.op, key, kq, n, out)
                progress = True
            while kq.putters and not self._full(kq):
                w = kq.putters.popleft()
                self._finish(w)
                kq.push(w.item, w.arg)
                out.append((w.client, (w.rid, P.OK, None), None, None))
                progress = True
