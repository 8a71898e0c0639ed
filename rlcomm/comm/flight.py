"""The flight recorder: the point-to-point and broadcast ops of this process that are
under way (and the channel requests it waits for), and the last ones that ended (a
small ring), for ``rlcomm status`` and for the analysis in a timeout's error
(:mod:`rlcomm.comm.status`).

Recording is on every message's path, so it is cheap and takes no lock: an op is a
tuple put into a dict when it begins and moved into the ring when it ends. Under the
GIL a dict's item assignment and ``pop`` and a list's item assignment are atomic, and
the ids come from one ``itertools.count`` (whose ``next`` is atomic too), so threads
record at once without contending for anything. A reader copies the dict and the ring
(one C call each) and may see an op a moment late, never a torn one.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, NamedTuple

from rlcomm.settings import get_settings

_monotonic = time.monotonic


class Op(NamedTuple):
    """An op as recorded: what it is, with whom, how many bytes (-1: not known when it
    began, a receive), and when it began (``time.monotonic()``)."""

    op: str
    peer: Any
    nbytes: int
    started: float


class Ended(NamedTuple):
    """An op that ended: the op, its id, when it ended, and the class name of its error
    (``None``: it succeeded)."""

    op: Op
    key: int
    ended: float
    error: str | None


class FlightRecorder:
    """Ops under way and the last ``size`` that ended (see the module docstring).

    Entries are plain tuples while recorded (a named tuple costs three times as much to
    make); :meth:`under_way` and :meth:`recent` return them as :class:`Op` and
    :class:`Ended`.

    Args:
        size: how many ended ops the ring keeps (0: none).
    """

    def __init__(self, size: int):
        self.size = size
        self.pending: dict[int, tuple] = {}
        self._ids = itertools.count(1)
        self._ended = itertools.count()
        self._ring: list[tuple | None] = [None] * max(size, 1)

    def begin(self, op: str, peer: Any, nbytes: int = -1) -> int:
        """Record that ``op`` with ``peer`` begins; returns its id for :meth:`end`."""
        key = next(self._ids)
        self.pending[key] = (op, peer, nbytes, _monotonic())
        return key

    def end(self, key: int, error: BaseException | None = None) -> None:
        """Record that op ``key`` ended (with ``error``, if it failed)."""
        entry = self.pending.pop(key, None)
        if entry is not None and self.size:
            self._ring[next(self._ended) % self.size] = (
                entry, key, _monotonic(), None if error is None else type(error).__name__
            )

    def end_future(self, key: int, future: Any) -> None:
        """:meth:`end` for an op whose future is done (a done-callback)."""
        self.end(key, None if future.cancelled() else future.exception())

    def find(self, key: int) -> Op | None:
        """Op ``key``, under way or among the ended ops the ring still holds."""
        entry = self.pending.get(key)
        if entry is not None:
            return Op(*entry)
        for ended in self.recent():
            if ended.key == key:
                return ended.op
        return None

    def clear(self) -> None:
        """Forget every op (a forked child starts with none of its parent's)."""
        self.pending = {}
        self._ring = [None] * max(self.size, 1)

    def under_way(self) -> list[tuple[int, Op]]:
        """The ops under way, oldest first."""
        return [(key, Op(*entry)) for key, entry in sorted(self.pending.copy().items())]

    def recent(self) -> list[Ended]:
        """The ended ops the ring holds, in the order they ended."""
        ring = self._ring.copy() if self.size else []
        ended = [Ended(Op(*e[0]), e[1], e[2], e[3]) for e in ring if e is not None]
        return sorted(ended, key=lambda e: e.ended)


#: This process's recorder.
RECORDER = FlightRecorder(get_settings().flight_recorder_ops)
os.register_at_fork(after_in_child=RECORDER.clear)


def nbytes_of(tensors: list[Any]) -> int:
    """The bytes of a message's tensors."""
    if len(tensors) == 1:
        return tensors[0].nbytes
    return sum(t.nbytes for t in tensors)
