"""Local channels (``local=True``): queues in this process, items handed over as they are.

A local channel has no worker: its :class:`LocalLink` applies requests to a
:class:`~rlcomm.channel.core.ChannelCore` in the calling thread and resolves the futures
from the core's replies. Items are not encoded or copied. Local channels are found by
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


class LocalLink(Requester):
    """A ``local=True`` channel: the queues live in this process; items are not copied."""

    def __init__(self, channel: str, maxsize: int):
        super().__init__(channel, maxsize, "(local)")
        self.core = ChannelCore(channel, maxsize, self._deliver)

    def _post(self, entries: list[Entry], inline: bool, hold: bool = False) -> None:
        self.core.handle(self, [req for req, _ in entries])

    def _give_back(self, key: P.Key, items: list[Any], weights: list[float]) -> None:
        self.post_oneway(P.Requeue(key, list(items), list(weights)))

    def _deliver(self, client: Hashable, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            if d.status == P.ERROR:
                self.complete(d.rid, d.status, text=str(d.value))
            else:
                self.complete(d.rid, d.status, d.value, d.weights)


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
