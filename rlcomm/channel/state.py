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
- A *write-behind* put (``rid`` :data:`~rlcomm.channel.protocol.NO_REPLY`, sent by a
  producer that did not wait) is answered only when it is not enqueued: its
  :class:`Delivery` then has that ``rid`` and the key as its ``value``. It never parks
  (producers send them only to unbounded channels; on a full key it is refused ``FULL``).
- A request that reaches its deadline while parked is answered ``TIMEOUT``; a timed-out
  put was not enqueued and a timed-out get took nothing.
- *Prefetch*: a ``get`` may ask for up to ``prefetch`` more items in its reply, for its
  process's next gets. It gets them only from an unbounded channel (``maxsize`` 0: a
  bound is a promise about how far producers may run ahead, and lent items would break
  it), only items the owner may lend (``lend_cost``: CPU items, up to
  :data:`PREFETCH_BYTES` of them), only while no other get waits on the key behind it, and only while it is the key's one consumer (no other
  client took items of the key for :data:`SHARED_SECONDS`), so that every consumer
  still gets each producer's items in order. The client keeps them in order ahead of
  the key, and puts back what it did not take soon (``Requeue``), so items lent to a
  process that stopped getting go on to others.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from rlcomm.channel import protocol as P
from rlcomm.channel.keyqueue import KeyQueue, Waiter
from rlcomm.channel.protocol import Status

_GET, _GET_NOWAIT, _GET_BATCH, _PUT, _PUT_NOWAIT = range(5)
#: Seconds a key counts as shared by several consumers after two took items in a row.
SHARED_SECONDS = 1.0
#: Most bytes of items one get takes ahead (prefetch), beside the item it asked for.
PREFETCH_BYTES = 16 << 20
_PUT_OPS = (_PUT, _PUT_NOWAIT)


class Delivery(NamedTuple):
    """A reply due to a client.

    Attributes:
        value: of an ``OK`` get, the list of items it took (one for ``get``); of a
            qsize, the count; of an ``ERROR``, the text; of a refused write-behind put
            (``rid`` ``NO_REPLY``), its key; else ``None``.
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


class ChannelState:
    """The queues of one channel worker (see the module docstring). Not thread-safe.

    Args:
        name: the channel's name, for messages.
        maxsize: items per key; 0 for unbounded.
        lend_cost: the bytes a stored item costs a get that takes it ahead (prefetch),
            ``None`` for an item that may not be; ``None``: no prefetch.
    """

    def __init__(self, name: str, maxsize: int,
                 lend_cost: Callable[[Any], int | None] | None = None):
        self.name = name
        self.maxsize = maxsize
        #: The bytes a stored item costs a get that takes it ahead, None for one that may
        #: never be (None: no item may; see the module docstring).
        self._lend_cost = lend_cost if maxsize == 0 else None
        self._now = 0.0  # the time of the request being applied
        self.closed = False
        self._keys: dict[P.Key, KeyQueue] = {}
        self._parked: dict[tuple[Hashable, int], Waiter] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []
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

    def describe(self) -> list[dict[str, Any]]:
        """Per key: items queued, requests parked (gets and puts), items accepted and
        handed out ever (what ``rlcomm status`` shows)."""
        return [
            {"key": key if isinstance(key, str) else repr(key), "depth": len(kq.items),
             "getters": len(kq.getters), "putters": len(kq.putters), "puts": kq.puts,
             "gets": kq.gets}
            for key, kq in self._keys.items()
        ]

    def next_deadline(self) -> float | None:
        """The earliest deadline of a parked request (monotonic seconds), if any."""
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    # -- requests -----------------------------------------------------------------------

    def handle(self, client: Hashable, req: P.Request, now: float, out: list[Delivery]) -> None:
        """Apply one request (a :data:`~rlcomm.channel.protocol.Request` whose items are
        whatever this state's owner stores); append the replies it causes to ``out``."""
        self._now = now
        tp = type(req)
        if tp is P.Put:
            op = _PUT_NOWAIT if req.nowait else _PUT
            self._put(client, op, req.rid, req.key, req.weight, req.timeout, req.item, now, out)
        elif tp is P.Get:
            op = _GET_NOWAIT if req.nowait else _GET
            self._get(client, op, req.rid, req.key, req.prefetch, req.timeout, now, out)
        elif tp is P.GetBatch:
            self._get(client, _GET_BATCH, req.rid, req.key, req.target, req.timeout, now, out)
        elif tp is P.QSize:
            out.append(Delivery(client, req.rid, P.OK, self.qsize(req.key)))
        elif tp is P.Close:
            self.close(out)
            out.append(Delivery(client, req.rid, P.OK))
        elif tp is P.Sync:
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
            out.append(Delivery(client, rid, P.CLOSED, key if rid == P.NO_REPLY else None))
            return
        kq = self._key(key)
        if kq.putters or self._full(kq):
            if rid == P.NO_REPLY:  # write-behind puts are for unbounded channels only
                out.append(Delivery(client, rid, P.FULL, key))
            elif op == _PUT_NOWAIT:
                out.append(Delivery(client, rid, P.FULL))
            else:
                self._park(kq.putters, Waiter(client, rid, op, key, weight, item,
                                              self._deadline(now, timeout)))
            return
        kq.push(item, weight)
        if rid != P.NO_REPLY:
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
            n = self._take(kq, op, target, True, client)
            if n is not None:
                self._answer(client, rid, op, key, kq, n, out)
                self._serve(key, kq, out)
                return
        self._park(kq.getters, Waiter(client, rid, op, key, target, None,
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
        self._now = now
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

    def _key(self, key: P.Key) -> KeyQueue:
        kq = self._keys.get(key)
        if kq is None:
            kq = self._keys[key] = KeyQueue()
        return kq

    def _full(self, kq: KeyQueue) -> bool:
        return 0 < self.maxsize <= len(kq.items)

    def _deadline(self, now: float, timeout: float | None) -> float:
        return float("inf") if timeout is None else now + timeout

    def _park(self, queue: deque[Waiter], w: Waiter) -> None:
        queue.append(w)
        self._parked[(w.client, w.rid)] = w
        if w.deadline != float("inf"):
            heapq.heappush(self._deadlines, (w.deadline, next(self._seq), w))

    def _finish(self, w: Waiter) -> None:
        w.done = True
        self._parked.pop((w.client, w.rid), None)

    def _take(self, kq: KeyQueue, op: int, target: Any, alone: bool = True,
              client: Hashable = None) -> int | None:
        """How many items a get may take now (0: answer CLOSED), or None to wait.
        ``target``: a get_batch's weight, a get's prefetch; ``alone``: no other get waits
        on the key behind this one; ``client``: the getter."""
        if op != _GET_BATCH:
            if not kq.items:
                return 0 if self.closed else None
            if (target and alone and self._now >= kq.shared_until
                    and (kq.taker is None or kq.taker == client)):
                return 1 + self._ahead(kq, target)
            return 1
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

    def _ahead(self, kq: KeyQueue, most: int) -> int:
        """How many items after the head a get may take ahead (at most ``most``, and at
        most :data:`PREFETCH_BYTES` of them)."""
        cost = self._lend_cost
        if cost is None:
            return 0
        n = 0
        budget = PREFETCH_BYTES
        for i in range(1, min(len(kq.items), most + 1)):
            c = cost(kq.items[i])
            if c is None or c > budget:
                break
            budget -= c
            n += 1
        return n

    def _answer(
        self, client: Hashable, rid: int, op: int, key: P.Key, kq: KeyQueue, n: int,
        out: list[Delivery],
    ) -> None:
        if n == 0:
            out.append(Delivery(client, rid, P.CLOSED))
        else:
            self._reply_items(client, rid, op, key, kq, n, out)

    def _reply_items(
        self, client: Hashable, rid: int, op: int, key: P.Key, kq: KeyQueue, n: int,
        out: list[Delivery],
    ) -> None:
        items, weights = kq.pop(n)
        if kq.taker != client:
            if kq.taker is not None:  # a second consumer: the key is shared for a while
                kq.shared_until = self._now + SHARED_SECONDS
            kq.taker = client
        out.append(Delivery(client, rid, P.OK, items, weights, key))

    def _serve(self, key: P.Key, kq: KeyQueue, out: list[Delivery]) -> None:
        """Answer parked requests of ``key`` in order for as long as its state allows."""
        progress = True
        while progress:
            progress = False
            while kq.getters:
                w = kq.getters[0]
                n = self._take(kq, w.op, w.arg, len(kq.getters) == 1, w.client)
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
