"""Local channels (``local=True``): queues in this process, items handed over as they are.

A local channel has no worker: its :class:`LocalLink` applies requests to a
:class:`~rlcomm.channel.core.ChannelCore` in the calling thread and resolves the futures
(its :class:`~rlcomm.channel.requester.Requester`'s) from the core's replies. Items are not encoded or copied. Local channels are found by
name in this process only.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from rlcomm.channel import protocol as P
from rlcomm.channel.core import ChannelCore
from rlcomm.channel.requester import Entry, Requester
from rlcomm.channel.state import Delivery
from rlcomm.errors import ChannelError


class LocalLink:
    """A ``local=True`` channel: the queues live in this process; items are not copied.

    Nothing is written behind or taken ahead: every request is applied at once.
    """

    #: A put waits for its answer (applied at once, so it costs nothing to wait).
    writes_behind = False

    def __init__(self, channel: str, maxsize: int):
        self.channel = channel
        self.requests = Requester(channel, maxsize, "(local)", self._post, self._give_back)
        self.request = self.requests.request  # bound once: every request goes through it
        self.lose = self.requests.lose
        self.core = ChannelCore(channel, maxsize, self._deliver)

    def __repr__(self) -> str:
        return f"LocalLink({self.channel!r})"

    def stats(self, key: P.Key) -> dict[str, Any]:
        """As :meth:`.client.Link.stats`: a local channel has no worker, nothing to lose,
        send or take ahead."""
        return {"worker": "(local)", "lost": self.requests.lost, "worker_gone": False,
                "writes_behind": False, "gone_checks": 0, "sent_inline": 0, "sent_off": 0,
                "held": 0, "prefetched": 0}

    def prepare_item(self, item: Any) -> tuple[Any, list]:
        return item, []

    def put_behind(self, req: P.Put, tensors: list, hold: bool = False,
                   inline: bool = True) -> None:
        raise AssertionError("a local channel never writes behind")

    def take_prefetched(self, key: P.Key) -> tuple[bool, Any]:
        return False, None

    def prefetched(self, key: P.Key) -> int:
        return 0

    def prefetched_upto(self, key: P.Key, weight: float) -> list[tuple[Any, float]]:
        return []

    def unget(self, key: P.Key, entries: list[tuple[Any, float]]) -> None:
        """Nothing is ever taken ahead (:meth:`prefetched_upto` is empty)."""

    def _post(self, entries: list[Entry], inline: bool, hold: bool = False) -> None:
        self.core.handle(self, [req for req, _ in entries])

    def _give_back(self, key: P.Key, items: list[Any], weights: list[float]) -> None:
        self.requests.post_oneway(P.Requeue(key, list(items), list(weights)))

    def _deliver(self, client: Hashable, deliveries: list[Delivery]) -> None:
        complete = self.requests.complete
        for d in deliveries:
            if d.status == P.ERROR:
                complete(d.rid, d.status, text=str(d.value))
            else:
                complete(d.rid, d.status, d.value, d.weights)


_channels: dict[str, Any] = {}
_lock = threading.Lock()


def find(name: str) -> Any:
    """The local channel ``name`` of this process, or ``None``."""
    return _channels.get(name)


def register(name: str, make: Any) -> Any:
    """Register the channel ``make()`` under ``name``.

    Raises:
        ChannelError: a local channel of that name exists already in this process.
    """
    with _lock:
        if name in _channels:
            raise ChannelError(f"a local channel named {name!r} exists already in this process")
        channel = _channels[name] = make()
        return channel


def unregister(name: str, channel: Any) -> None:
    """Forget ``channel`` (if it is still the one registered under ``name``)."""
    with _lock:
        if _channels.get(name) is channel:
            del _channels[name]
