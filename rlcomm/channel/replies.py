"""What a channel worker may send to one client without waiting on it.

A write to a shared-memory connection waits only when the peer has not read enough of
what came before: its ring is full, or (for a large payload) its pool of segments is
and the segment's announcement finds the peer's signal socket full. A client that is
stopped (SIGSTOP), or stalls, reads nothing, so a worker thread that writes to it may
wait for as long as the client is stopped. The channel worker therefore sends a reply
on the thread that produced it (the selector thread, the timer thread: no thread hop,
which the small-item round trip is most sensitive to) only when the write cannot wait,
and otherwise hands it to the client's own reply thread.

:class:`ReadWindow` is how it knows: every request message of a client carries how many
reply messages that client has read (:mod:`~rlcomm.channel.protocol`), and the window
keeps the size of each reply sent since. The thread that flushes a batch of replies
encodes it, and sends it itself when

- its payload is on the CPU (a CUDA payload goes over NCCL or CUDA IPC, which may wait);
- the bytes sent and not yet read, with it (:func:`message_bytes`, counting the payload
  as if it all went through the ring), stay within half the ring
  (:data:`WINDOW_BYTES`), so the ring has room for all of it;
- fewer than :data:`WINDOW_MESSAGES` messages are unread, so the wake-up tokens and
  segment announcements behind them stay far below what the signal socket holds.

A client that keeps up (it reads every reply before its next request) never leaves the
inline path. A stopped client fills its window in at most :data:`WINDOW_BYTES` and
:data:`WINDOW_MESSAGES`; later replies wait on its reply thread, which alone waits.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from rlcomm.comm import codec
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.endpoint import SHARED_MEMORY_RING_BYTES

#: Bytes of replies a client may have unread while replies to it still go inline.
WINDOW_BYTES = SHARED_MEMORY_RING_BYTES // 2
#: Reply messages a client may have unread while replies to it still go inline (each
#: may cost one wake-up token on the signal socket, which holds a few hundred).
WINDOW_MESSAGES = 64
#: Bytes a message adds besides its header and payload: the ring's records, the frame's
#: length, the header's few bytes of inline size.
_MESSAGE_OVERHEAD = 256
_PER_TENSOR = 32


def message_bytes(header: MessageHeader, tensors: list[torch.Tensor]) -> int:
    """The bytes an encoded message takes in a ring, at most (header, payload, records)."""
    payload = sum(t.numel() * t.element_size() for t in tensors)
    return (len(codec.header_to_bytes(header)) + payload + _MESSAGE_OVERHEAD
            + _PER_TENSOR * len(tensors))


class ReadWindow:
    """The reply messages sent to one client that it has not reported read (see the module
    docstring). Thread-safe: the sending thread records, the reading thread reports."""

    def __init__(self, max_bytes: int = WINDOW_BYTES, max_messages: int = WINDOW_MESSAGES):
        self._max_bytes = max_bytes
        self._max_messages = max_messages
        self._lock = threading.Lock()
        self._unread: deque[int] = deque()  # sizes, oldest first
        self._unread_bytes = 0
        self._read = 0  # messages the client reported read

    def admits(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` more stays within the window."""
        with self._lock:
            return (len(self._unread) < self._max_messages
                    and self._unread_bytes + nbytes <= self._max_bytes)

    def sent(self, nbytes: int) -> None:
        """A message of ``nbytes`` is about to be written (record it first: the client's
        report that it read the message may come before the write call returns)."""
        with self._lock:
            self._unread.append(nbytes)
            self._unread_bytes += nbytes

    def read(self, count: int) -> None:
        """The client reports it has read ``count`` reply messages in all."""
        with self._lock:
            newly = min(count - self._read, len(self._unread))
            if newly <= 0:
                return
            self._read = count
            for _ in range(newly):
                self._unread_bytes -= self._unread.popleft()

    @property
    def unread(self) -> tuple[int, int]:
        """``(messages, bytes)`` sent and not reported read."""
        with self._lock:
            return len(self._unread), self._unread_bytes
