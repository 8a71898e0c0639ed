"""The flight recorder: the point-to-point and broadcast ops of this process that are
under way (and the channel requests it waits for), and the last ones that began (a
small ring), for ``rlcomm status`` and for the analysis in a timeout's error
(:mod:`rlcomm.comm.status`).

Recording is on every message's path, so it is cheap and takes no lock: when an op
begins, one small list (id, op, peer, size, began, ended, error) goes into a dict of the ops
under way and into its slot of the ring; when it ends, it leaves the dict and its end
time is written into the list. Under the GIL a dict's item assignment and ``pop`` and a
list's item assignment are atomic, and the ids come from one ``itertools.count``
(whose ``next`` is atomic too), so threads record at once without contending for
anything. A reader copies the dict and the ring (one C call each) and may see an op a
moment late, never a torn one. An op under way longer than the ring is long stays in
the dict: ops under way are never lost.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, NamedTuple

from rlcomm.settings import get_settings

_monotonic = time.monotonic

# The fields of a recorded entry (a list, so that its end can be written in place).
_KEY, _OP, _PEER, _SIZE, _BEGAN, _ENDED, _ERROR = range(7)


def size_of(size: Any) -> int:
    """The bytes an entry's size stands for: an int, a message's header, or a small
    message's frame (:func:`.framing.small_frame`; each counted when the op is shown: a
    send records what it has rather than pay for the sum per message); -1 when not
    known (a receive)."""
    if type(size) is int:
        return size
    if type(size) is bytes:
        from rlcomm.comm.framing import payload_bytes  # (framing imports torch)

        return payload_bytes(size)
    metas = getattr(size, "tensors", None)
    if metas is None:
        return -1
    try:
        return sum(m.nbytes for m in metas)
    except Exception:  # noqa: BLE001 - a size is only shown; an odd header shows none
        return -1


class Op(NamedTuple):
    """A recorded op: what it is, with whom, how many bytes (-1: not known, a receive),
    when it began and ended (``time.monotonic()``; ``ended`` None while under way), and
    the class name of its error (None: it succeeded, or is under way)."""

    key: int
    op: str
    peer: Any
    nbytes: int
    began: float
    ended: float | None
    error: str | None

    @classmethod
    def of(cls, entry: list) -> Op:
        return cls(entry[_KEY], entry[_OP], entry[_PEER], size_of(entry[_SIZE]),
                   entry[_BEGAN], entry[_ENDED] or None, entry[_ERROR])


class FlightRecorder:
    """Ops under way and the last ``size`` that began (see the module docstring).

    Args:
        size: how many ops the ring keeps (0: none; ops under way are kept all the same).
    """

    __slots__ = ("size", "_slots", "pending", "_ids", "_ring")

    def __init__(self, size: int):
        self.size = size
        self._slots = max(size, 1)  # a recorder of size 0 writes one slot it never shows
        self.pending: dict[int, list] = {}
        self._ids = itertools.count(1)
        self._ring: list[list | None] = [None] * self._slots

    def begin(self, op: str, peer: Any, size: Any = -1) -> int:
        """Record that ``op`` with ``peer`` begins; returns its id for :meth:`end`.
        ``size``: its bytes, or the message's header (see :func:`size_of`)."""
        key = next(self._ids)
        self.pending[key] = self._ring[key % self._slots] = [
            key, op, peer, size, _monotonic(), 0.0, None]
        return key

    def end(self, key: int, error: BaseException | None = None) -> None:
        """Record that op ``key`` ended (with ``error``, if it failed)."""
        entry = self.pending.pop(key, None)
        if entry is not None:
            if error is not None:
                entry[_ERROR] = type(error).__name__
            entry[_ENDED] = _monotonic()

    def end_future(self, key: int, future: Any) -> None:
        """:meth:`end` for an op whose future is done (a done-callback)."""
        self.end(key, None if future.cancelled() else future.exception())

    def find(self, key: int) -> Op | None:
        """Op ``key``, under way or still in the ring."""
        entry = self.pending.get(key)
        if entry is None and self.size:
            entry = self._ring[key % self._slots]
        if entry is not None and entry[_KEY] == key:
            return Op.of(entry)
        return None

    def clear(self) -> None:
        """Forget every op (a forked child starts with none of its parent's)."""
        self.pending = {}
        self._ring = [None] * self._slots

    def under_way(self) -> list[Op]:
        """The ops under way, oldest first."""
        return [Op.of(entry) for _, entry in sorted(self.pending.copy().items())]

    def recent(self) -> list[Op]:
        """The ops of the ring that ended, in the order they began."""
        ring = self._ring.copy() if self.size else []
        ops = [Op.of(entry) for entry in ring if entry is not None and entry[_ENDED]]
        return sorted(ops, key=lambda o: o.key)


#: This process's recorder.
RECORDER = FlightRecorder(get_settings().flight_recorder_ops)
os.register_at_fork(after_in_child=RECORDER.clear)
