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

    @classmethod
    def of(cls, entry: tuple) -> Op:
        """An op from a recorded entry, whose size may be a message's header (counted
        now: a send records its header, not the sum it would cost to make per message)."""
        op, peer, size, started = entry
        return cls(op, peer, size if type(size) is int else size_of(size), started)


def size_of(header: Any) -> int:
    """The bytes of the tensors a message's header describes (-1 if it describes none)."""
    metas = getattr(header, "tensors", None)
    if metas is None:
        return -1
    try:
        return sum(m.nbytes for m in metas)
    except Exception:  # noqa: BLE001 - a size is only shown; an odd header shows none
        return -1


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

    def begin(self, op: str, peer: Any, size: Any = -1) -> int:
        """Record that ``op`` with ``peer`` begins; returns its id for :meth:`end`.
        ``size``: its bytes, or the message's header (:func:`size_of`, counted only
        when the op is shown)."""
        key = next(self._ids)
        self.pending[key] = (op, peer, size, _monotonic())
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
            return Op.of(entry)
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
        return [(key, Op.of(entry)) for key, entry in sorted(self.pending.copy().items())]

    def recent(self) -> list[Ended]:
        """The ended ops the ring holds, in the order they ended."""
        ring = self._ring.copy() if self.size else []
        ended = [Ended(Op.of(e[0]), e[1], e[2], e[3]) for e in ring if e is not None]
        return sorted(ended, key=lambda e: e.ended)


#: This process's recorder.
RECORDER = FlightRecorder(get_settings().flight_recorder_ops)
os.register_at_fork(after_in_child=RECORDER.clear)
