"""The segments a peer passed to this side of a shared-memory connection (the receiving
half's memory; :mod:`~rlcomm.comm.transports.shm` reads the records that use them).

A segment arrives as a memfd on the signal socket, with an id and a size, and is mapped
once; records then name it by id. An id of :data:`MAX_SEGMENTS` or more is a segment the
peer relays from another process (:mod:`.shm_relay`): its state is
``id % MAX_SEGMENTS``, one of the relay slots, and it replaces what that slot carried
before. In a process that relays, the peer's own segments stay registered with their fds
so they can be passed on.
"""

from __future__ import annotations

import os
from collections import deque

import numpy as np

from rlcomm.comm.transports import shm_relay
from rlcomm.comm.transports.shm_memory import FIRST_RELAY_SLOT, MAX_SEGMENTS, Segment, map_fd
from rlcomm.errors import ProtocolMismatchError

#: Most handed-over fds a peer may pass ahead of the messages that use them (each is an
#: open file descriptor here until its message is read).
MAX_HANDED_AHEAD = 4096


class PeerSegments:
    """The peer's segments mapped here, by id (see the module docstring).

    Args:
        peer: how error messages name the other end.
    """

    def __init__(self, peer: str):
        self._peer = peer
        self.by_id: dict[int, Segment] = {}
        self.relayed: dict[int, int] = {}  # relay slot -> the id it carries now
        #: Handed-over blocks (:mod:`.shm_handover`) passed ahead of their records:
        #: ``(fd, offset, nbytes)``, each fd open until its record is read.
        self.handed: deque[tuple[int, int, int]] = deque()

    def hand(self, fd: int, where: tuple[int, int], what: str) -> None:
        """Keep a handed-over block's fd and ``(offset, nbytes)`` for its record.

        Raises:
            ProtocolMismatchError: the peer passed too many that no record used.
        """
        if len(self.handed) >= MAX_HANDED_AHEAD:
            os.close(fd)
            raise ProtocolMismatchError(
                f"{what} with {self._peer}: the peer passed over {MAX_HANDED_AHEAD} "
                "handed-over blocks that no message uses; the connection is closed")
        self.handed.append((fd, *where))

    def map(self, seg_id: int, size: int, fd: int, what: str) -> None:
        """Map a segment the peer passed (``fd`` is closed here, or kept for relaying).

        Raises:
            ProtocolMismatchError: a relayed segment outside the relay slots, or larger
                than its memfd.
        """
        try:
            if seg_id >= MAX_SEGMENTS:
                slot = seg_id % MAX_SEGMENTS
                if slot < FIRST_RELAY_SLOT or os.fstat(fd).st_size < size:
                    raise ProtocolMismatchError(
                        f"{what} with {self._peer}: a relayed segment that is not one "
                        f"(slot {slot}, {size} bytes); the connection is closed")
                old = self.relayed.pop(slot, None)
                if old is not None:
                    self.by_id.pop(old, None)
                self.relayed[slot] = seg_id
            # Not pre-faulted: a new segment's pages are the sender's to fault in (its
            # copy is split across threads), and this side's first reads then only map
            # them. Populating here raced the sender and zeroed them on one thread.
            seg = Segment(seg_id, size, map_fd(fd, size, populate=False))
        except BaseException:
            os.close(fd)
            raise
        self.by_id[seg_id] = seg
        if shm_relay.enabled() and seg_id < MAX_SEGMENTS:
            shm_relay.register(seg.tensor.data_ptr(), fd, size, seg.mm)  # it keeps the fd
        else:
            os.close(fd)

    def checked(self, seg_id: int, n: int) -> Segment:
        """Segment ``seg_id`` (mapped), checked to hold a payload of ``n`` bytes.

        Raises:
            ProtocolMismatchError: it is smaller.
        """
        seg = self.by_id[seg_id]
        if n > seg.size:
            raise ProtocolMismatchError(
                f"shm recv with {self._peer}: a {n}-byte payload in a {seg.size}-byte "
                "segment; the connection is closed")
        return seg

    @staticmethod
    def pinned(states: np.ndarray) -> int:
        """How many of the peer's segments (its own and relayed ones) are in flight to,
        or held by, this side."""
        return int(np.count_nonzero(states))

    def close(self) -> None:
        """The connection ends: close the fds kept (handed-over blocks never read, and
        in a relaying process the peer's segments)."""
        while self.handed:
            os.close(self.handed.popleft()[0])
        if shm_relay.enabled():
            shm_relay.forget([seg.tensor.data_ptr() for seg in self.by_id.values()])
