"""Shared-memory transport for two processes on one node.

Per direction, the sender owns a *ring* (a ``memfd`` mapped by both ends) and a pool of
*segments* (more ``memfd`` mappings). A small payload is copied into the ring; a payload
of at least :data:`SEGMENT_THRESHOLD` bytes is copied into a pooled, pre-faulted
segment and only a descriptor goes through the ring, so the receiver can either copy it
out (:meth:`recv_into`) or take a zero-copy view of it (:meth:`recv_new`). A segment
returns to the sender's pool when the receiver is done with it (after the copy, or when
the last view of it is freed): the receiver clears the segment's byte in the ring's
state table, and the sender reuses segments whose byte is clear.

The transport is pollable: a receiver may wait for the next frame (:meth:`poll`) with a
wake-up file descriptor beside the socket, and whichever thread holds the receiving role
then reads it, so a waiting caller reads its own message without a thread hop.

A receiver waiting for data first spins a moment (yielding the CPU), then sets a
*sleeping* flag in the ring and sleeps on a socket (:mod:`~rlcomm.comm.transports.shm_wait`,
which can also wait on many transports at once). Notifications and file descriptors
travel over a pair of sockets (:mod:`~rlcomm.comm.transports.shm_signals`): a one-byte
token after a send while the receiver's sleeping flag is set (a busy or spinning receiver
costs the sender no syscall), a token back when the sender waits for ring space, and
each new memfd. The memory layout is in :mod:`~rlcomm.comm.transports.shm_memory`.
Nothing is ever named in ``/dev/shm``, so the kernel frees every byte when a process
ends, crashes included. A closed socket is how a peer's death is seen.

Ordering: head/tail counters are aligned 8-byte words written by one side each; x86-64
keeps stores in order, which this relies on (see the README's known limits).
"""

from __future__ import annotations

import ctypes
import os
import platform
import select
import socket
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlcomm.comm.transports import bulk_copy, pool, registry, shm_handover, shm_relay
from rlcomm.comm.transports.base import Transport
from rlcomm.comm.transports.shm_fanout import payload_offsets
from rlcomm.comm.transports.shm_memory import (
    CTRL_BYTES,
    HEAD,
    MAX_SEGMENTS,
    RING_BYTES,
    SLEEPING,
    TAIL,
    WAITING,
    Ring,
    Segment,
    SegmentPool,
    check_memory,
    map_fd,
    new_memfd,
    release_segment,
)
from rlcomm.comm.transports.shm_peer import PeerSegments
from rlcomm.comm.transports.shm_ring import (
    BUCKET,
    FRAME,
    HANDED_RECORD,
    INLINE,
    RECORD,
    SEGMENT,
    RingWriter,
)
from rlcomm.comm.transports.shm_signals import HANDED, SignalSockets
from rlcomm.comm.transports.shm_wait import ShmWaiter, Spin, wait_for_data
from rlcomm.errors import CommTimeoutError, PeerLostError
from rlcomm.settings import get_settings

try:  # a small frame put into (taken from) a ring in one C call (optional: setup.py)
    from rlcomm.comm.transports._stream_copy import ring_layout as _ring_layout
    from rlcomm.comm.transports._stream_copy import ring_put as _ring_put
    from rlcomm.comm.transports._stream_copy import ring_take as _ring_take
except ImportError:
    _ring_put = _ring_take = None
else:
    _ring_layout(HEAD, TAIL, SLEEPING, CTRL_BYTES, FRAME)

#: The ring's lock-free counters rely on x86-64 keeping stores in order.
SHM_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")
_MAX_IN_FLIGHT = get_settings().shm_max_in_flight
#: A receiver holding this many of the sender's segments (zero-copy views it keeps, like a
#: queue's items) copies later payloads out instead, so that the sender does not run out
#: of segments and fall back to streaming large payloads through the ring.
_PIN_LIMIT = _MAX_IN_FLIGHT // 2
#: A process that relays what it receives (:mod:`.shm_relay`, a channel worker) keeps
#: more: the views it holds are its queue, and each one it copies out is a copy the relay
#: saves. It leaves the sender this many segments for what is on its way.
_RELAY_SPARE = 8


class ShmTransport(Transport):
    """Same-node connection over shared memory (see module docstring).

    Args:
        store: the rendezvous store (a prefix private to this connection).
        rank: 0 or 1.
        timeout: seconds the rendezvous may take.
        peer: how error messages name the other end.
        peer_pid: the peer's process id: the set-up sockets accept only that process
            of this user (``None``: any process of this user).
    """

    name = "shm"
    pollable = True
    memory_only = True

    def __init__(
        self, store: dist.Store, rank: int, timeout: float, peer: str,
        peer_pid: int | None = None,
    ):
        self._peer = peer
        self._closed = False
        check_memory()
        deadline = time.monotonic() + timeout
        out_fd, out_mm = new_memfd("rlcomm-ring", CTRL_BYTES + RING_BYTES)
        self._out = Ring(out_mm)
        try:
            self._signals, in_fd = SignalSockets.rendezvous(
                store, rank, out_fd, deadline, peer, peer_pid
            )
        finally:
            os.close(out_fd)
        self._out_sock, self._in_sock = self._signals.out, self._signals.inn
        self._in = Ring(map_fd(in_fd, CTRL_BYTES + RING_BYTES))
        os.close(in_fd)
        self._spin = Spin()  # of this transport's own waits for data
        self._pool = SegmentPool(self._out.states, self._signals.send_fd, _MAX_IN_FLIGHT)
        self._writer = RingWriter(self._out, self._pool, self._signals, peer, _MAX_IN_FLIGHT)
        self._segments = PeerSegments(peer)  # incoming, mapped on first sight
        self._pin_limit = (max(_PIN_LIMIT, _MAX_IN_FLIGHT - _RELAY_SPARE)
                           if shm_relay.enabled() else _PIN_LIMIT)

    # -- notifications ----------------------------------------------------------------------

    def _lost(self, what: str) -> PeerLostError:
        return self._signals.lost(what)

    def _notify(self, sock: socket.socket) -> None:
        self._signals.notify(sock)

    def _read_sock(self, sock: socket.socket, block: bool, deadline: float | None, what: str) -> bool:
        """Read one message (token or fd) from ``sock``; False if none was there. A new
        segment of the peer is mapped here."""
        got, new_segment = self._signals.read(sock, block, deadline, what)
        if new_segment is not None:
            seg_id, size, fd = new_segment
            if seg_id == HANDED:  # mapped when its record is read
                self._segments.hand(fd, size, what)  # type: ignore[arg-type]
                return got
            self._segments.map(seg_id, size, fd, what)  # type: ignore[arg-type]
        return got

    # -- sending ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise self._lost("shm send")
        if self.broken:
            raise PeerLostError(
                f"shm stream to {self._peer} is out of step after a send failed part-way"
            )

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        self._check_usable()
        deadline = time.monotonic() + timeout
        try:
            self._writer.send_payload(tensors, deadline)
        except BaseException:
            self.broken = True
            raise
        self._writer.wake_reader()

    def send_frame(self, frame: bytes, payload: Sequence[torch.Tensor], timeout: float) -> None:
        """Send a frame and its payload. It waits for ring space for the whole frame
        before writing any of it, so a send that times out there sent nothing; one that
        fails later marks the transport :attr:`broken`."""
        self._check_usable()
        deadline = time.monotonic() + timeout
        record = RECORD.pack(FRAME, 0, len(frame)) + frame
        handed = self._writer.handed_over(payload)
        if payload or self._writer.space() < len(record):
            segments = self._writer.reserve(len(record), payload, deadline, handed)
        else:  # the common small message: room in the ring, nothing to reserve
            segments = ()
        try:
            self._writer.write(record, deadline)
            self._writer.send_payload(payload, deadline, segments, handed)
        except BaseException:
            self.broken = True
            raise
        self._writer.wake_reader()

    def send_small(self, frame: bytes, timeout: float) -> None:
        """:meth:`send_frame` of a frame without a payload (a small message): written in
        place when the ring has room for it before its end, else the general way."""
        if self._closed or self.broken:
            self._check_usable()
        out = self._out
        if _ring_put is not None:  # the steps below in one call (0.2 µs, not 0.9)
            put = _ring_put(out.base, RING_BYTES, frame)
        else:  # put: -1 where it does not fit before the end, else the sleeping flag
            words = out.words
            head = words[HEAD // 8]
            n = len(frame)
            end = head % RING_BYTES + RECORD.size + n
            if end > RING_BYTES or head + RECORD.size + n - words[TAIL // 8] > RING_BYTES:
                put = -1
            else:
                start = CTRL_BYTES + end - n
                RECORD.pack_into(out.mm, start - RECORD.size, FRAME, 0, n)
                out.mm[start : CTRL_BYTES + end] = frame
                words[HEAD // 8] = head + RECORD.size + n  # published: the reader may take it
                put = int(words[SLEEPING // 8] != 0)
        if put < 0:
            self.send_frame(frame, (), timeout)
        elif put:  # the reader sleeps: a wake-up token (RingWriter.wake_reader's)
            self._signals.notify(self._out_sock)

    def send_bucket(self, pieces: Sequence[torch.Tensor], timeout: float) -> None:
        self._check_usable()
        deadline = time.monotonic() + timeout
        try:
            self._writer.send_bucket(pieces, deadline)
        except BaseException:
            self.broken = True
            raise
        self._writer.wake_reader()

    # -- receiving --------------------------------------------------------------------------

    def available(self) -> int:
        """Bytes in the incoming ring."""
        words = self._in.words
        return int(words[HEAD // 8] - words[TAIL // 8])

    # What a wait for data (:mod:`.shm_wait`) needs of the transport.

    def signal_fd(self) -> int:
        """The socket that a wake-up token (or a new segment) arrives on."""
        return self._in_sock.fileno()

    def poller(self, wake_fd: int | None) -> select.poll:
        """A (cached) poll object on :meth:`signal_fd` and ``wake_fd``."""
        return self._signals.poller(self._in_sock, wake_fd)

    def read_signal(self) -> None:
        """Read what arrived on :meth:`signal_fd`, if anything (a new segment is mapped)."""
        self._read_sock(self._in_sock, False, None, "shm recv")

    def set_sleeping(self, sleeping: bool) -> None:
        """Tell the sender whether this side sleeps (then it sends a token after data)."""
        self._in.words[SLEEPING // 8] = int(sleeping)

    @property
    def lost(self) -> bool:
        """Whether the transport is closed or its peer is known to be gone."""
        return self._closed

    def peer_gone(self) -> bool:
        return self._closed or self._signals.peer_gone()

    def mark_lost(self) -> None:
        """The peer is gone: every later op raises PeerLostError."""
        self._closed = True

    # What a selector needs (:class:`~rlcomm.comm.transports.base.PollableTransport`).

    def has_data(self) -> bool:
        return self.available() > 0 or self._closed

    def waiter(self) -> ShmWaiter:
        return ShmWaiter()

    def _sleep_until_data(self, deadline: float | None, wake_fd: int | None = None) -> bool:
        return wait_for_data((self,), deadline, () if wake_fd is None else (wake_fd,), self._spin)

    def _read(self, dst: torch.Tensor | None, nbytes: int, deadline: float | None) -> bytes | None:
        """Copy ``nbytes`` out of the incoming ring into ``dst`` (a flat, contiguous uint8
        tensor, as every receive passes; by address, as the ring writer copies in), or
        return them."""
        if dst is not None and not dst.is_contiguous():  # (no receive passes one)
            flat = torch.empty(nbytes, dtype=torch.uint8)
            self._read(flat, nbytes, deadline)
            dst.copy_(flat)
            return None
        words = self._in.words
        parts: list[bytes] = []
        addr = 0 if dst is None else dst.data_ptr()
        done = 0
        while done < nbytes:
            avail = self.available()
            if avail == 0:
                if not self._sleep_until_data(deadline):
                    raise CommTimeoutError(f"shm recv from {self._peer} timed out")
                continue
            n = min(avail, nbytes - done)
            tail = int(words[TAIL // 8])
            pos = tail % RING_BYTES
            first = min(n, RING_BYTES - pos)
            if dst is None:
                mm = self._in.mm
                parts.append(mm[CTRL_BYTES + pos : CTRL_BYTES + pos + first])
                if first < n:
                    parts.append(mm[CTRL_BYTES : CTRL_BYTES + n - first])
            else:
                base = self._in.addr
                ctypes.memmove(addr + done, base + pos, first)
                if first < n:
                    ctypes.memmove(addr + done + first, base, n - first)
            words[TAIL // 8] = tail + n
            done += n
            if words[WAITING // 8]:
                words[WAITING // 8] = 0
                self._notify(self._in_sock)
        return b"".join(parts) if dst is None else None

    def poll(self, timeout: float | None, wake_fd: int | None = None) -> bool:
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        return self.available() > 0 or self._sleep_until_data(deadline, wake_fd)

    def frame_in_place(self) -> bytes | None:
        """The next frame when it is all in the ring and does not wrap (the common case:
        one slice instead of two reads), else None (see :meth:`.Transport.frame_in_place`)."""
        words = self._in.words
        if _ring_take is not None:  # the steps below in one call
            frame = _ring_take(self._in.base, RING_BYTES)
            if frame is None:
                return None
        else:
            tail = int(words[TAIL // 8])
            avail = int(words[HEAD // 8]) - tail
            pos = tail % RING_BYTES
            end = pos + RECORD.size
            if avail < RECORD.size or end > RING_BYTES:
                return None
            mm = self._in.mm
            kind, _, n = RECORD.unpack_from(mm, CTRL_BYTES + pos)
            if kind != FRAME or avail < RECORD.size + n or end + n > RING_BYTES:
                return None
            frame = mm[CTRL_BYTES + end : CTRL_BYTES + end + n]
            words[TAIL // 8] = tail + RECORD.size + n
        if words[WAITING // 8]:
            words[WAITING // 8] = 0
            self._notify(self._in_sock)
        return frame

    def _next_record(self, deadline: float | None) -> tuple[int, int, int]:
        return RECORD.unpack(self._read(None, RECORD.size, deadline))

    def _peer_segment(self, seg_id: int, n: int, deadline: float | None) -> Segment:
        """The peer's segment ``seg_id`` (mapped once its fd arrives), checked to hold
        a payload of ``n`` bytes."""
        while seg_id not in self._segments.by_id:
            self._read_sock(self._in_sock, True, deadline, "shm recv")
        return self._segments.checked(seg_id, n)

    def _check_size(self, expected: int, got: int) -> None:
        if expected != got:
            raise PeerLostError(
                f"shm stream with {self._peer} is out of step: expected a {expected}-byte "
                f"payload, the peer sent {got} bytes"
            )

    def recv_frame(self, timeout: float | None, rest: float | None = None) -> bytes:
        if self._closed:
            raise self._lost("shm recv")
        frame = self.frame_in_place()
        if frame is not None:
            return frame
        deadline = None if timeout is None else time.monotonic() + timeout
        kind, _, n = self._next_record(deadline)
        if kind != FRAME:
            raise PeerLostError(f"shm stream with {self._peer} is out of step: expected a frame")
        if rest is not None:
            deadline = time.monotonic() + rest
        return self._read(None, n, deadline)

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in tensors:
            kind, seg_id, n = self._next_record(deadline)
            self._check_size(t.numel(), n)
            if kind == SEGMENT:
                seg = self._peer_segment(seg_id, n, deadline)
                bulk_copy.copy(t, seg.tensor[:n])
                self._in.states[seg_id % MAX_SEGMENTS] = 0
            elif kind == HANDED_RECORD:
                t.copy_(self._map_handed(n, deadline))
            elif n:
                self._read(t, n, deadline)

    def recv_new(self, sizes: Sequence[int], timeout: float | None) -> list[torch.Tensor]:
        """Receive payloads of ``sizes`` bytes; large ones as zero-copy views of segments
        (the segment returns to the sender's pool when the view is freed), or copied
        into pooled buffers while this side holds :data:`_PIN_LIMIT` segments (a
        relaying process: all but :data:`_RELAY_SPARE`)."""
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for size in sizes:
            kind, seg_id, n = self._next_record(deadline)
            self._check_size(size, n)
            if kind == SEGMENT:
                seg = self._peer_segment(seg_id, n, deadline)
                state = seg_id % MAX_SEGMENTS
                if self._pinned() <= self._pin_limit:  # counting this one
                    arr = np.frombuffer(seg.mm, dtype=np.uint8, count=n)
                    weakref.finalize(arr, release_segment, self._in.states, state)
                    out.append(torch.from_numpy(arr))
                else:  # this side keeps many views: copy, so the sender keeps segments
                    t = pool.take(n)
                    bulk_copy.copy(t, seg.tensor[:n])
                    release_segment(self._in.states, state)
                    out.append(t)
            elif kind == HANDED_RECORD:
                out.append(self._map_handed(n, deadline))
            else:
                t = pool.take(n)
                if n:
                    self._read(t, n, deadline)
                out.append(t)
        return out

    def recv_bucket(
        self, sizes: Sequence[int], timeout: float | None,
        into: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor] | None:
        """A bucket as views of the sender's segment (it goes back when they are freed);
        one that came through the ring is read into ``into`` (returns None) or new
        buffers."""
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        kind, seg_id, n = self._next_record(deadline)
        if kind == BUCKET:
            offsets, span = payload_offsets(0, sizes)
            self._check_size(span, n)
            seg = self._peer_segment(seg_id, n, deadline)
            arr = np.frombuffer(seg.mm, dtype=np.uint8, count=n)
            weakref.finalize(arr, release_segment, self._in.states, seg_id % MAX_SEGMENTS)
            whole = torch.from_numpy(arr)
            return [whole[off : off + size] for off, size in zip(offsets, sizes)]
        out = []
        for k, size in enumerate(sizes):
            if k:
                kind, _, n = self._next_record(deadline)
            if kind != INLINE:
                raise PeerLostError(
                    f"shm stream with {self._peer} is out of step: expected a bucket")
            self._check_size(size, n)
            buf = into[k] if into is not None else pool.take(n)
            self._read(buf, n, deadline)
            out.append(buf)
        return None if into is not None else out

    def _map_handed(self, n: int, deadline: float | None) -> torch.Tensor:
        """A copy-on-write view of the next handed-over block, whose record said ``n``
        bytes (its fd arrived on the signal socket before the record)."""
        while not self._segments.handed:
            self._read_sock(self._in_sock, True, deadline, "shm recv")
        fd, offset, nbytes = self._segments.handed.popleft()
        try:
            self._check_size(n, nbytes)
            return shm_handover.map_received(fd, offset, nbytes, f"shm recv from {self._peer}")
        finally:
            os.close(fd)

    def _pinned(self) -> int:
        return self._segments.pinned(self._in.states)

    def close(self) -> None:
        self._closed = True
        self._segments.close()
        self._signals.close()


def _shm(setup: registry.TransportSetup) -> ShmTransport:
    return ShmTransport(setup.store, setup.rank, setup.timeout, setup.peer, peer_pid=setup.peer_pid)


#: Shared memory connects two ends of one x86-64 Linux node, before anything else.
SPEC = registry.register(registry.TransportSpec(
    name=ShmTransport.name, devices=frozenset({registry.CPU}), pollable=True,
    accepts=lambda facts: facts.same_node and SHM_SUPPORTED, factory=_shm, preference=10,
    memory_only=ShmTransport.memory_only,
))
