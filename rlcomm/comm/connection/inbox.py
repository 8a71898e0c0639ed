"""The inbox of a connection: received messages not yet taken by a receive op, bounded.

A pure container: the connection's lock guards it (it takes none itself). Its bound is
the unread-bytes cap of the trust issue: while it holds :func:`max_unread_bytes` or more,
the reader's driver stops reading, so a sender to a worker that never receives fills the
transport and then waits (its send times out with a clear error).
"""

from __future__ import annotations

from collections import deque

from rlcomm.comm.connection.incoming import Incoming
from rlcomm.comm.options import max_unread_bytes


class Inbox:
    """Messages in arrival order, with the bytes they hold counted against a cap.

    Args:
        max_unread: the cap in bytes (default: the ``max_unread_bytes`` setting now).
    """

    def __init__(self, max_unread: int | None = None):
        self._messages: deque[Incoming] = deque()
        self.unread = 0  # bytes held by the messages
        self.max_unread = max_unread_bytes() if max_unread is None else max_unread

    def __len__(self) -> int:
        return len(self._messages)

    def __bool__(self) -> bool:
        return bool(self._messages)

    @property
    def full(self) -> bool:
        """Whether it holds its cap or more (the driver then stops reading)."""
        return self.unread >= self.max_unread

    def put(self, msg: Incoming) -> None:
        """Queue ``msg`` (a reader that found the inbox not full may always put one)."""
        self._messages.append(msg)
        self.unread += msg.nbytes

    def __iter__(self):
        return iter(self._messages)

    def grew(self, msg: Incoming, nbytes: int) -> None:
        """``msg``, queued, now holds ``nbytes`` more (its offered payload was copied in)."""
        msg.nbytes += nbytes
        self.unread += nbytes

    def peek(self) -> Incoming:
        """The oldest message, left queued."""
        return self._messages[0]

    def take(self) -> bool:
        """Remove the oldest message. Returns whether that made room below the cap (the
        driver, stopped at the cap, may read on)."""
        was_full = self.full
        self.unread -= self._messages.popleft().nbytes
        return was_full and not self.full
