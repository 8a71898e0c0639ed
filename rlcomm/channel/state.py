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
from typing import Any, NamedTuple

from rlcomm.channel import protocol as P
from rlcomm.channel.protocol import Status

_GET, _GET_NOWAIT, _GET_BATCH, _PUT, _PUT_NOWAIT = range(5)
_PUT_OPS = (_PUT, _PUT_NOWAIT)


class Delivery(NamedTuple):
    """A reply due to a client.

    Attributes:
        value: of an ``OK`` get, the list of items it took (one for ``get``); of a
            qsize, the count; of an ``ERROR``, the text; else ``None``.
        weights: the weights of the items a get took.
        key: the key a get took its items from (so a reply that cannot be delivered can
            put them back); ``None`` for replies that hand out no item.
    """

    client: Hashable
    rid: int
    status: Status
    value: Any = None
    weights: list[float] | None = None
    key: P.Key | None = None


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

    def handle(self, client: Hashable, req: P.Request, now: float, out: list[Delivery]) -> None:
        """Apply one request (a :data:`~rlcomm.channel.protocol.Request` whose items are
        whatever this state's owner stores); append the replies it causes to ``out``."""
        tp = type(req)
        if tp is P.Put:
            op = _PUT_NOWAIT if req.nowait else _PUT
            self._put(client, op, req.rid, req.key, req.weight, req.timeout, req.item, now, out)
        elif tp is P.Get:
            op = _GET_NOWAIT if req.nowait else _GET
            self._get(client, op, req.rid, req.key, None, req.timeout, now, out)
        elif tp is P.GetBatch:
            self._get(client, _GET_BATCH, req.rid, req.key, req.target, req.timeout, now, out)
        elif tp is P.QSize:
            out.append(Delivery(client, req.rid, P.OK, self.qsize(req.key)))
        elif tp is P.Close:
            self.close(out)
            out.append(Delivery(client, req.rid, P.OK))
        elif tp is P.Cancel:
            self.cancel(client, req.target, out)
        elif tp is P.Requeue:
            self.requeue(req.key, req.items, req.weights, out)
        else:
            rid = P.rid_of(req)
            if rid != P.NO_REPLY:
                text = f"channel {self.name!r}: unknown request {tp.__name__}"
                out.append(Delivery(client, rid, P.ERROR, text))

    def _put(
        self, client: Hashable, op: int, rid: int, key: P.Key, weight: float,
        timeout: float | None, item: Any, now: float, out: list[Delivery],
    ) -> None:
        if self.closed:
            out.append(Delivery(client, rid, P.CLOSED))
            return
        kq = self._key(key)
        if kq.putters or self._full(kq):
            if op == _PUT_NOWAIT:
                out.append(Delivery(client, rid, P.FULL))
            else:
                self._park(kq.putters, _Waiter(client, rid, op, key, weight, item,
                                               self._deadline(now, timeout)))
            return
        kq.push(item, weight)
        out.append(Delivery(client, rid, P.OK))
        self._serve(key, kq, out)

    def _get(
        self, client: Hashable, op: int, rid: int, key: P.Key, target: Any,
        timeout: float | None, now: float, out: list[Delivery],
    ) -> None:
        kq = self._key(key)
        if op == _GET_NOWAIT:
            if kq.items:
                self._reply_items(client, rid, op, key, kq, 1, out)
                self._serve(key, kq, out)
            else:
                status = P.CLOSED if self.closed else P.EMPTY
                out.append(Delivery(client, rid, status))
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
                out.append(Delivery(w.client, w.rid, P.CLOSED))
            self._serve(key, kq, out)

    def cancel(self, client: Hashable, rid: int, out: list[Delivery]) -> None:
        """Withdraw a parked request of ``client``; it is answered ``CANCELLED``.

        A request that was answered already is left alone (its reply is on its way).
        """
        w = self._parked.get((client, rid))
        if w is None:
            return
        kq = self._keys[w.key]
        (kq.putters if w.op in _PUT_OPS else kq.getters).remove(w)
        self._finish(w)
        out.append(Delivery(client, rid, P.CANCELLED))
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
            (kq.putters if w.op in _PUT_OPS else kq.getters).remove(w)
            self._finish(w)
            self._serve(w.key, kq, out)

    def expire(self, now: float, out: list[Delivery]) -> None:
        """Answer ``TIMEOUT`` to every parked request whose deadline is past."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, w = heapq.heappop(self._deadlines)
            if w.done:
                continue
            kq = self._keys[w.key]
            (kq.putters if w.op in _PUT_OPS else kq.getters).remove(w)
            self._finish(w)
            out.append(Delivery(w.client, w.rid, P.TIMEOUT))
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
        if op != _GET_BATCH:
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
            out.append(Delivery(client, rid, P.CLOSED))
        else:
            self._reply_items(client, rid, op, key, kq, n, out)

    def _reply_items(
        self, client: Hashable, rid: int, op: int, key: P.Key, kq: _KeyQueue, n: int,
        out: list[Delivery],
    ) -> None:
        items, weights = kq.pop(n)
        out.append(Delivery(client, rid, P.OK, items, weights, key))

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
                out.append(Delivery(w.client, w.rid, P.OK))
                progress = True
