"""Items a process's gets took ahead (prefetch), first in line for its next gets.

A blocking or async ``get`` on a channel with a worker asks for up to :data:`PREFETCH`
more items in its reply. The worker lends them only when that keeps the channel's
promises (:mod:`~rlcomm.channel.state`: an unbounded channel, CPU items up to a byte budget, the key's one
consumer, nobody else waiting). The process keeps them here, per key, in order:

- ``get`` and ``get_nowait`` take the next one without asking the worker;
- ``get_batch`` takes them first and asks the worker only for the rest of its target
  weight (:func:`batch_with`);
- ``qsize`` counts them.

Items no get of this process took for :data:`PREFETCH_LINGER` seconds go back to the
head of their key (one ``Requeue``), so a process that stopped getting holds none for
long: one thread per process (:class:`_Returner`) looks every so often, while any link
holds items. If another consumer got later items of the key meanwhile, it may get these
after them, out of order (as with items given back after a cancelled ``aget``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rlcomm.channel import protocol as P
from rlcomm.channel.payload import StoredItem
from rlcomm.comm.work import AsyncWork
from rlcomm.errors import ChannelClosedError

logger = logging.getLogger(__name__)

#: Most items a get asks to take ahead, for this process's next gets of the key.
PREFETCH = 32
#: Seconds items taken ahead wait for a get of this process before they go back.
PREFETCH_LINGER = 0.05

Entry = tuple[StoredItem, float]  # an item taken ahead and its weight


class Ahead:
    """One link's items taken ahead, per key (thread-safe).

    Args:
        give_back: posts a ``Requeue`` of items (never sends from the calling thread).
        lost: whether the channel worker is gone (items are then kept for this
            process's gets: nowhere to give them back to).
    """

    def __init__(self, give_back: Callable[[P.Key, list[StoredItem], list[float]], None],
                 lost: Callable[[], bool]):
        self._give_back = give_back
        self._lost = lost
        self._lock = threading.Lock()
        self._queues: dict[P.Key, deque[Entry]] = {}
        self._used: dict[P.Key, float] = {}  # when a get last stashed or took, per key

    def stash(self, key: P.Key, items: list[StoredItem], weights: list[float]) -> None:
        with self._lock:
            self._queues.setdefault(key, deque()).extend(zip(items, weights, strict=True))
            self._used[key] = time.monotonic()
        _returner.watch(self)

    def take(self, key: P.Key) -> StoredItem | None:
        """The next item of ``key`` taken ahead, or None."""
        if not self._queues:
            return None
        with self._lock:
            queue = self._queues.get(key)
            if not queue:
                return None
            self._used[key] = time.monotonic()
            item = queue.popleft()[0]
            if not queue:  # an emptied key goes: gets then skip the lock (no items held)
                del self._queues[key]
            return item

    def take_upto(self, key: P.Key, weight: float) -> list[Entry]:
        """Items of ``key`` from the head until their weights reach ``weight``."""
        if not self._queues:
            return []
        out: list[Entry] = []
        with self._lock:
            queue = self._queues.get(key)
            have = 0.0
            while queue and have < weight:
                out.append(queue.popleft())
                have += out[-1][1]
            if out:
                self._used[key] = time.monotonic()
                if not queue:
                    del self._queues[key]
        return out

    def unget(self, key: P.Key, entries: list[Entry]) -> None:
        """Put ``entries`` (taken by :meth:`take_upto`) back at the head, in order."""
        with self._lock:
            self._queues.setdefault(key, deque()).extendleft(reversed(entries))
            self._used[key] = time.monotonic()
        _returner.watch(self)

    def count(self, key: P.Key) -> int:
        queue = self._queues.get(key)
        return len(queue) if queue else 0

    def return_stale(self, now: float) -> bool:
        """Give back the items of keys no get used for :data:`PREFETCH_LINGER` seconds;
        True while some are still held (False once the worker is gone: no one to give
        them back to, so the process's gets keep them)."""
        if self._lost():
            return False
        with self._lock:
            # Posted under the lock: a get that finds the key empty afterwards posts its
            # request behind the Requeue, so the items are back at the head first.
            for key, queue in list(self._queues.items()):
                if queue and now - self._used.get(key, 0.0) >= PREFETCH_LINGER:
                    del self._queues[key]
                    self._give_back(key, [i for i, _ in queue], [w for _, w in queue])
            return any(self._queues.values())


def batch_with(
    local: list[Entry], remote: Any, give_back: Callable[[list[Entry]], None],
    description: str, timeout: float,
) -> AsyncWork:
    """A ``get_batch``'s work: the items taken ahead (``local``), then what the worker's
    reply to ``remote`` (a :class:`~rlcomm.channel.requester.RequestWork`) brings. If the
    channel is closed and drained, the local items are the (partial) batch; if the
    request fails otherwise or is withdrawn, they go back ahead of the key
    (``give_back``) and the error is raised."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    mine = [item.decode() for item, _ in local]

    def done(fut: concurrent.futures.Future) -> None:
        if fut.cancelled():
            give_back(local)
            out.cancel()
            return
        exc = fut.exception()
        if exc is None:
            out.set_result(mine + fut.result())
        elif isinstance(exc, ChannelClosedError):
            out.set_result(mine)
        else:
            give_back(local)
            out.set_exception(exc)

    remote.future.add_done_callback(done)
    return AsyncWork(out, description, timeout, cancellable=True, on_cancel=remote.withdraw)


class _Returner:
    """The one thread of this process that gives back items taken ahead and left
    unused; it runs while some link holds any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[Ahead] = set()
        self._running = False

    def watch(self, ahead: Ahead) -> None:
        with self._lock:
            self._held.add(ahead)
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="rlcomm-channel-prefetch", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(PREFETCH_LINGER / 2)
            with self._lock:
                watched = list(self._held)
            now = time.monotonic()
            still = set()
            for ahead in watched:
                try:
                    if ahead.return_stale(now):
                        still.add(ahead)
                except Exception:  # noqa: BLE001 - a lost link: its items are lost with it
                    logger.exception("giving back channel items taken ahead failed")
            with self._lock:
                self._held = still | (self._held - set(watched))
                if not self._held:
                    self._running = False
                    return


_returner = _Returner()
