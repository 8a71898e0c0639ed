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
keeps the size of each reply sent since. A batch of replies may go inline when

- its size bound (:func:`replies_bound`) is known: plain values, bytes, strings, CPU
  tensors and lists, tuples, dicts and dataclasses of them;
- the bytes sent and not yet read, with it, stay within half the ring
  (:data:`WINDOW_BYTES`), so the ring has room for all of it;
- fewer than :data:`WINDOW_MESSAGES` messages are unread, so the wake-up tokens and
  segment announcements behind them stay far below what the signal socket holds.

A client that keeps up (it reads every reply before its next request) never leaves the
inline path. A stopped client fills its window in at most :data:`WINDOW_BYTES` and
:data:`WINDOW_MESSAGES`; later replies wait on its reply thread, which alone waits.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Any

import torch

from rlcomm.comm import codec
from rlcomm.comm.codec import MessageHeader
from rlcomm.comm.transports.shm_memory import RING_BYTES

#: Bytes of replies a client may have unread while replies to it still go inline.
WINDOW_BYTES = RING_BYTES // 2
#: Reply messages a client may have unread while replies to it still go inline (each
#: may cost one wake-up token on the signal socket, which holds a few hundred).
WINDOW_MESSAGES = 64
#: Bytes a message adds besides its items and heads: the ring's records, the frame's
#: length and the header's fixed fields.
_MESSAGE_OVERHEAD = 256
#: Bytes an item's structure may add per element (a pickle opcode, a tensor's meta).
_PER_ELEMENT = 32
_PER_TENSOR = 128
#: Items nested deeper, or containers longer, than this are not sized (they go through
#: the reply thread): sizing must stay cheap next to encoding.
_MAX_DEPTH = 4
_MAX_LEN = 4096

_SCALARS = (type(None), bool, float)


def _bound(obj: Any, depth: int) -> int | None:
    """At most how many bytes ``obj`` takes in an encoded message; ``None``: unknown."""
    tp = type(obj)
    if tp in _SCALARS:
        return _PER_ELEMENT
    if tp is int:
        return _PER_ELEMENT + obj.bit_length() // 8
    if tp is bytes or tp is bytearray:
        return len(obj) + _PER_ELEMENT
    if tp is str:
        return 4 * len(obj) + _PER_ELEMENT  # UTF-8: at most four bytes per character
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            return None  # a CUDA payload goes over NCCL or CUDA IPC: it may wait
        return obj.numel() * obj.element_size() + _PER_TENSOR
    if depth >= _MAX_DEPTH:
        return None
    if tp is list or tp is tuple:
        if len(obj) > _MAX_LEN:
            return None
        total = _PER_ELEMENT
        for x in obj:
            n = _bound(x, depth + 1)
            if n is None:
                return None
            total += n
        return total
    if tp is dict:
        if len(obj) > _MAX_LEN:
            return None
        total = _PER_ELEMENT
        for k, v in obj.items():
            nk, nv = _bound(k, depth + 1), _bound(v, depth + 1)
            if nk is None or nv is None:
                return None
            total += nk + nv
        return total
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        total = 4 * len(tp.__qualname__) + 4 * len(tp.__module__) + _PER_TENSOR
        for f in dataclasses.fields(obj):
            n = _bound(getattr(obj, f.name), depth + 1)
            if n is None:
                return None
            total += 4 * len(f.name) + n
        return total
    return None


def replies_bound(heads: list[tuple], items: list[Any]) -> int | None:
    """At most how many bytes the message of these replies takes; ``None``: unknown."""
    total = _MESSAGE_OVERHEAD
    for head, item in zip(heads, items, strict=True):
        nh, ni = _bound(head, 0), _bound(item, 0)
        if nh is None or ni is None:
            return None
        total += nh + ni
    return total


def message_bytes(header: MessageHeader, tensors: list[torch.Tensor]) -> int:
    """The bytes an encoded message takes in a ring, at most (header, payload, records)."""
    payload = sum(t.numel() * t.element_size() for t in tensors)
    return (len(codec.header_to_bytes(header)) + payload + _MESSAGE_OVERHEAD
            + _PER_ELEMENT * len(tensors))


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
