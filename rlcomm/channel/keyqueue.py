"""The queue of one channel key (:class:`KeyQueue`) and a request parked on it
(:class:`Waiter`): the data :class:`~rlcomm.channel.state.ChannelState` keeps per key."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any

from rlcomm.channel import protocol as P


class Waiter:
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


class KeyQueue:
    """The items of one key and the requests parked on it."""

    __slots__ = ("items", "weights", "weight", "getters", "putters", "puts", "gets", "taker",
                 "shared_until")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.weights: deque[float] = deque()
        self.weight: float = 0
        self.getters: deque[Waiter] = deque()
        self.putters: deque[Waiter] = deque()
        self.puts = 0  # items accepted, ever
        self.gets = 0  # items handed out, ever
        self.taker: Hashable = None  # the client that took the last items
        self.shared_until = 0.0  # another client took items before then: no lending

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
