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
*sleeping* flag in the ring and sleeps on a socket. Notifications and file descriptors
travel over a pair of ``AF_UNIX`` ``SOCK_SEQPACKET`` sockets (one per direction) bound to
abstract names: a one-byte token after a send while the receiver's sleeping flag is set
(a busy or spinning receiver costs the sender no syscall), a token back when the sender
waits for ring space, and each new memfd (SCM_RIGHTS).
Nothing is ever named in ``/dev/shm``, so the kernel frees every byte when a process
ends, crashes included. A closed socket is how a peer's death is seen.

Ordering: head/tail counters are aligned 8-byte words written by one side each; x86-64
keeps stores in order, which this relies on (see the README's known limits).
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import select
import socket
import struct
import time
import uuid
import weakref
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlcomm.comm.transports.base import Transport
from rlcomm.errors import CommTimeoutError, PeerLostError

#: The ring's lock-free counters rely on x86-64 keeping stores in order.
SHM_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create")
#: Bytes of each direction's ring (payloads below the segment threshold, descriptors).
RING_BYTES = int(os.environ.get("RLCOMM_SHM_RING_BYTES", 8 << 20))
#: Payloads of at least this many bytes go through pooled segments.
SEGMENT_THRESHOLD = int(os.environ.get("RLCOMM_SHM_SEGMENT_THRESHOLD", 256 << 10))
#: Most bytes of segments one direction keeps; past it, payloads stream through the ring.
POOL_BYTES = int(os.environ.get("RLCOMM_SHM_POOL_BYTES", 4 << 30))
#: Most seconds a polling receiver checks the ring before it sleeps (``RLCOMM_SHM_SPIN_US``;
#: 0 turns spinning off).
SPIN_SECONDS = float(os.environ.get("RLCOMM_SHM_SPIN_US", 200)) / 1e6
_MAX_SEGMENTS = 1024
_MAX_IN_FLIGHT = int(os.environ.get("RLCOMM_SHM_MAX_IN_FLIGHT", 16))
_CTRL = 4096  # control block before the ring data: counters and segment states
_HEAD, _TAIL, _WAITING, _SLEEPING, _STATES = 0, 8, 16, 24, 1024  # byte offsets
#: A reader's first sleep is this short (seconds): a sender that raced with the reader's
#: sleeping flag and sent no token is seen at the next look (see ``_sleep_until_data``).
_RECHECK = 0.001
_RECORD = struct.Struct("<IIQ")  # kind, segment id, nbytes
_INLINE, _SEGMENT, _FRAME = 1, 2, 3
_TOKEN = b"t"
_FD_BYTES = 4  # a C int
_FD_SPACE = socket.CMSG_SPACE(_FD_BYTES)  # room for one file descriptor per message


def _map_fd(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _new_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, getattr(os, "MFD_CLOEXEC", 0))
    os.ftruncate(fd, size)
    return fd, _map_fd(fd, size)


class _Ring:
    """A mapped ring: control words, segment states and the data bytes."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.words = np.frombuffer(mm, dtype=np.int64, count=4)
        self.states = np.frombuffer(mm, dtype=np.uint8, count=_MAX_SEGMENTS, offset=_STATES)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=_CTRL, count=RING_BYTES)


class _Segment:
    def __init__(self, seg_id: int, size: int, mm: mmap.mmap):
        self.id = seg_id
        self.size = size
        self.mm = mm
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8, count=size)


class ShmTransport(Transport):
    """Same-node connection over shared memory (see module docstring).

    Args:
        store: the rendezvous store (a prefix private to this connection).
        rank: 0 or 1.
        timeout: seconds the rendezvous may take.
        peer: how error messages name the other end.
    """

    name = "shm"
    pollable = True

    def __init__(self, store: dist.Store, rank: int, timeout: float, peer: str):
        self._peer = peer
        self._closed = False
        deadline = time.monotonic() + timeout
        out_fd, out_mm = _new_memfd("rlcomm-ring", _CTRL + RING_BYTES)
        self._out = _Ring(out_mm)
        if rank == 0:
            self._out_sock, self._in_sock, in_fd = self._listen(store, out_fd, deadline)
        else:
            self._out_sock, self._in_sock, in_fd = self._connect(store, out_fd, deadline)
        os.close(out_fd)
        self._in = _Ring(_map_fd(in_fd, _CTRL + RING_BYTES))
        os.close(in_fd)
        for sock in (self._out_sock, self._in_sock):
            sock.settimeout(None)
        self._pollers: dict[tuple[int, int | None], select.poll] = {}
        self._spin = SPIN_SECONDS  # current spin of a wait for data (see _spin_for_data)
        self._segments: list[_Segment] = []  # outgoing pool
        self._pool_bytes = 0
        self._peer_segments: dict[int, _Segment] = {}  # incoming, mapped on first sight

    # -- set-up -----------------------------------------------------------------------------

    @staticmethod
    def _seqpacket() -> socket.socket:
        return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def _listen(self, store: dist.Store, out_fd: int, deadline: float):
        server = self._seqpacket()
        name = f"\0rlcomm-shm-{uuid.uuid4().hex}"
        server.bind(name)
        server.listen(2)
        store.set("shm/addr", name.encode())
        socks: dict[bytes, socket.socket] = {}
        in_fd = -1
        try:
            while len(socks) < 2:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                conn, _ = server.accept()
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                role, fds, _, _ = socket.recv_fds(conn, 16, 1)
                socks[role] = conn
                if role == b"peer->me":  # carries the peer's ring fd
                    in_fd = fds[0]
            socket.send_fds(socks[b"me->peer"], [b"ring"], [out_fd])
        except (TimeoutError, OSError) as exc:
            raise CommTimeoutError(f"shm rendezvous with {self._peer} failed: {exc}") from exc
        finally:
            server.close()
        return socks[b"me->peer"], socks[b"peer->me"], in_fd

    def _connect(self, store: dist.Store, out_fd: int, deadline: float):
        try:
            store.wait(["shm/addr"])
            name = store.get("shm/addr").decode()
            # Roles are named from the listener's side.
            mine_out = self._seqpacket()
            mine_out.settimeout(max(0.01, deadline - time.monotonic()))
            mine_out.connect(name)
            socket.send_fds(mine_out, [b"peer->me"], [out_fd])
            mine_in = self._seqpacket()
            mine_in.settimeout(max(0.01, deadline - time.monotonic()))
            mine_in.connect(name)
            mine_in.sendall(b"me->peer")
            _, fds, _, _ = socket.recv_fds(mine_in, 16, 1)
        except (TimeoutError, OSError, RuntimeError) as exc:
            raise CommTimeoutError(f"shm rendezvous with {self._peer} failed: {exc}") from exc
        return mine_out, mine_in, fds[0]

    # -- notifications ----------------------------------------------------------------------

    def _lost(self, what: str) -> PeerLostError:
        return PeerLostError(f"{what} with {self._peer} failed: the peer process is gone")

    def _wake_reader(self) -> None:
        """Send a token after new data, if the peer's reader sleeps (else it sees the data
        on its own: it is reading or spinning)."""
        if self._out.words[_SLEEPING // 8]:
            self._notify(self._out_sock)

    def _spin_for_data(self, deadline: float | None) -> bool:
        """Check the ring for a moment, yielding the CPU between looks; True if data came.

        A reply often comes within microseconds, and spinning beats sleeping and being
        woken (tens of microseconds and two syscalls). The spin adapts: it doubles after
        data came while spinning and halves (down to an eighth) after it did not, so a
        quiet stream wastes little.
        """
        if self._spin <= 0:
            return False
        now = time.monotonic()
        end = now + self._spin if deadline is None else min(now + self._spin, deadline)
        while self._available() == 0 and time.monotonic() < end:
            os.sched_yield()
        if self._available():
            self._spin = min(SPIN_SECONDS, self._spin * 2)
            return True
        self._spin = max(SPIN_SECONDS / 8, self._spin / 2)
        return False

    def _sleep_until_data(self, deadline: float | None, wake_fd: int | None = None) -> bool:
        """Wait until incoming data is there (True), or ``wake_fd`` / the deadline (False):
        spin a moment, then sleep.

        The sleeping flag tells the sender to send a token. x86 may let the sender read
        the flag before its data is visible here while this side reads the ring before
        its flag is visible there, so both could miss each other: the first sleep is
        therefore :data:`_RECHECK` short; after it the flag is surely visible to the
        sender, and data that raced with it is visible here.
        """
        if self._spin_for_data(deadline):
            return True
        words = self._in.words
        poller = self._poller(self._in_sock, wake_fd)
        sock_fd = self._in_sock.fileno()
        words[_SLEEPING // 8] = 1
        try:
            recheck = True
            while self._available() == 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                wait = remaining
                if recheck:
                    wait = _RECHECK if remaining is None else min(remaining, _RECHECK)
                events = poller.poll(None if wait is None else wait * 1000)
                if not events:
                    recheck = False
                for fd, _ in events:
                    if fd == sock_fd:
                        self._read_sock(self._in_sock, False, None, "shm recv")
                    elif fd == wake_fd:
                        return self._available() > 0
            return True
        finally:
            words[_SLEEPING // 8] = 0

    def _notify(self, sock: socket.socket) -> None:
        try:
            sock.send(_TOKEN, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass  # the peer has plenty of unread tokens already
        except OSError as exc:
            raise self._lost("shm notify") from exc

    def _poller(self, sock: socket.socket, wake_fd: int | None = None) -> select.poll:
        key = (sock.fileno(), wake_fd)
        poller = self._pollers.get(key)
        if poller is None:
            poller = select.poll()  # not select.select: Ray processes have fds past 1024
            for fd in key:
                if fd is not None:
                    poller.register(fd, select.POLLIN)
            self._pollers[key] = poller
        return poller

    def _wait_readable(self, sock: socket.socket, deadline: float | None, what: str) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise CommTimeoutError(f"{what} with {self._peer} timed out")
        if not self._poller(sock).poll(None if remaining is None else remaining * 1000):
            raise CommTimeoutError(f"{what} with {self._peer} timed out")

    def _read_sock(self, sock: socket.socket, block: bool, deadline: float | None, what: str) -> bool:
        """Read one message (token or fd) from ``sock``; False if none was there."""
        if block:
            self._wait_readable(sock, deadline, what)
        try:
            data, ancillary, _, _ = sock.recvmsg(64, _FD_SPACE, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return False
            raise self._lost(what) from exc
        if not data:
            raise self._lost(what)
        fds = _fds_of(ancillary) if ancillary else None
        if fds:
            seg_id, size = struct.unpack("<IQ", data[1:13])
            self._peer_segments[seg_id] = _Segment(seg_id, size, _map_fd(fds[0], size))
            os.close(fds[0])
        return True

    # -- sending ----------------------------------------------------------------------------

    def _space(self) -> int:
        words = self._out.words
        return RING_BYTES - int(words[_HEAD // 8] - words[_TAIL // 8])

    def _write(self, src: torch.Tensor | bytes, deadline: float) -> None:
        """Copy ``src`` (a uint8 tensor, or bytes) into the ring, waiting for space."""
        words = self._out.words
        is_bytes = isinstance(src, (bytes, bytearray))
        ring = self._out.mm if is_bytes else self._out.data
        base = _CTRL if is_bytes else 0
        done, total = 0, len(src) if is_bytes else src.numel()
        while done < total:
            space = self._space()
            if space == 0:
                self._wait_space(deadline)
                continue
            n = min(space, total - done)
            head = int(words[_HEAD // 8])
            pos = head % RING_BYTES
            first = min(n, RING_BYTES - pos)
            if is_bytes:
                ring[base + pos : base + pos + first] = src[done : done + first]
                if first < n:
                    ring[base : base + n - first] = src[done + first : done + n]
            else:
                ring[pos : pos + first].copy_(src[done : done + first])
                if first < n:
                    ring[: n - first].copy_(src[done + first : done + n])
            words[_HEAD // 8] = head + n
            done += n
            if done < total:
                self._wake_reader()

    def _wait_space(self, deadline: float) -> None:
        words = self._out.words
        self._wake_reader()  # the receiver may be asleep with data waiting
        words[_WAITING // 8] = 1
        while self._space() == 0:
            if time.monotonic() > deadline:
                words[_WAITING // 8] = 0
                raise CommTimeoutError(f"shm send to {self._peer} timed out (ring full)")
            try:
                # Short waits: a token can be missed when both sides race on the flag.
                self._read_sock(self._out_sock, True, min(deadline, time.monotonic() + 0.002),
                                "shm send")
            except CommTimeoutError:
                pass
        words[_WAITING // 8] = 0

    def _segment_for(self, nbytes: int, deadline: float) -> _Segment | None:
        states = self._out.states
        best = None
        for seg in self._segments:
            if states[seg.id] == 0 and seg.size >= nbytes and (best is None or seg.size < best.size):
                best = seg
        if best is None:
            # Grow the pool only while few segments are in flight: a sender that runs far
            # ahead of its receiver streams through the ring instead of mapping new memory.
            in_use = sum(int(states[seg.id]) for seg in self._segments)
            size = max(1 << 20, 1 << (nbytes - 1).bit_length())
            if (
                in_use >= _MAX_IN_FLIGHT
                or self._pool_bytes + size > POOL_BYTES
                or len(self._segments) >= _MAX_SEGMENTS
            ):
                return None
            seg_id = len(self._segments)
            fd, mm = _new_memfd("rlcomm-seg", size)
            best = _Segment(seg_id, size, mm)
            try:
                # Bounded: the peer reads its socket whenever its ring runs empty.
                self._out_sock.settimeout(max(0.01, deadline - time.monotonic()))
                socket.send_fds(self._out_sock, [b"f" + struct.pack("<IQ", seg_id, size)], [fd])
            except TimeoutError as exc:
                raise CommTimeoutError(f"shm send to {self._peer} timed out") from exc
            except OSError as exc:
                raise self._lost("shm send") from exc
            finally:
                self._out_sock.settimeout(None)
                os.close(fd)
            self._segments.append(best)
            self._pool_bytes += size
        states[best.id] = 1
        return best

    def send(self, tensors: Sequence[torch.Tensor], timeout: float) -> None:
        if self._closed:
            raise self._lost("shm send")
        deadline = time.monotonic() + timeout
        self._send_payload(tensors, deadline)
        self._wake_reader()

    def send_frame(self, frame: bytes, payload: Sequence[torch.Tensor], timeout: float) -> None:
        if self._closed:
            raise self._lost("shm send")
        deadline = time.monotonic() + timeout
        self._write(_RECORD.pack(_FRAME, 0, len(frame)) + frame, deadline)
        self._send_payload(payload, deadline)
        self._wake_reader()

    def _send_payload(self, tensors: Sequence[torch.Tensor], deadline: float) -> None:
        for t in tensors:
            n = t.numel()
            seg = self._segment_for(n, deadline) if n >= SEGMENT_THRESHOLD else None
            if seg is not None:
                seg.tensor[:n].copy_(t)
                self._write(_RECORD.pack(_SEGMENT, seg.id, n), deadline)
            else:
                self._write(_RECORD.pack(_INLINE, 0, n), deadline)
                if n:
                    self._write(t.numpy().tobytes() if n <= 4096 else t, deadline)

    # -- receiving --------------------------------------------------------------------------

    def _available(self) -> int:
        words = self._in.words
        return int(words[_HEAD // 8] - words[_TAIL // 8])

    def _read(self, dst: torch.Tensor | None, nbytes: int, deadline: float | None) -> bytes | None:
        """Copy ``nbytes`` out of the incoming ring into ``dst`` (or return them)."""
        words = self._in.words
        parts: list[bytes] = []
        done = 0
        while done < nbytes:
            avail = self._available()
            if avail == 0:
                if not self._sleep_until_data(deadline):
                    raise CommTimeoutError(f"shm recv from {self._peer} timed out")
                continue
            n = min(avail, nbytes - done)
            tail = int(words[_TAIL // 8])
            pos = tail % RING_BYTES
            first = min(n, RING_BYTES - pos)
            if dst is None:
                mm = self._in.mm
                parts.append(mm[_CTRL + pos : _CTRL + pos + first])
                if first < n:
                    parts.append(mm[_CTRL : _CTRL + n - first])
            else:
                ring = self._in.data
                dst[done : done + first].copy_(ring[pos : pos + first])
                if first < n:
                    dst[done + first : done + n].copy_(ring[: n - first])
            words[_TAIL // 8] = tail + n
            done += n
            if words[_WAITING // 8]:
                words[_WAITING // 8] = 0
                self._notify(self._in_sock)
        return b"".join(parts) if dst is None else None

    def poll(self, timeout: float | None, wake_fd: int | None = None) -> bool:
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._available() > 0 or self._sleep_until_data(deadline, wake_fd)

    def _frame_in_place(self) -> bytes | None:
        """The next frame when it is all in the ring and does not wrap (the common case:
        one slice instead of two reads), else None."""
        words = self._in.words
        tail = int(words[_TAIL // 8])
        avail = int(words[_HEAD // 8]) - tail
        pos = tail % RING_BYTES
        end = pos + _RECORD.size
        if avail < _RECORD.size or end > RING_BYTES:
            return None
        mm = self._in.mm
        kind, _, n = _RECORD.unpack_from(mm, _CTRL + pos)
        if kind != _FRAME or avail < _RECORD.size + n or end + n > RING_BYTES:
            return None
        frame = mm[_CTRL + end : _CTRL + end + n]
        words[_TAIL // 8] = tail + _RECORD.size + n
        if words[_WAITING // 8]:
            words[_WAITING // 8] = 0
            self._notify(self._in_sock)
        return frame

    def _next_record(self, deadline: float | None) -> tuple[int, int, int]:
        return _RECORD.unpack(self._read(None, _RECORD.size, deadline))

    def _peer_segment(self, seg_id: int, deadline: float | None) -> _Segment:
        while seg_id not in self._peer_segments:
            self._read_sock(self._in_sock, True, deadline, "shm recv")
        return self._peer_segments[seg_id]

    def _check_size(self, expected: int, got: int) -> None:
        if expected != got:
            raise PeerLostError(
                f"shm stream with {self._peer} is out of step: expected a {expected}-byte "
                f"payload, the peer sent {got} bytes"
            )

    def recv_frame(self, timeout: float | None) -> bytes:
        if self._closed:
            raise self._lost("shm recv")
        frame = self._frame_in_place()
        if frame is not None:
            return frame
        deadline = None if timeout is None else time.monotonic() + timeout
        kind, _, n = self._next_record(deadline)
        if kind != _FRAME:
            raise PeerLostError(f"shm stream with {self._peer} is out of step: expected a frame")
        return self._read(None, n, deadline)

    def recv_into(self, tensors: Sequence[torch.Tensor], timeout: float | None) -> None:
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in tensors:
            kind, seg_id, n = self._next_record(deadline)
            self._check_size(t.numel(), n)
            if kind == _SEGMENT:
                seg = self._peer_segment(seg_id, deadline)
                t.copy_(seg.tensor[:n])
                self._in.states[seg_id] = 0
            elif n:
                self._read(t, n, deadline)

    def recv_new(self, sizes: Sequence[int], timeout: float | None) -> list[torch.Tensor]:
        """Receive payloads of ``sizes`` bytes; large ones as zero-copy views of segments
        (the segment returns to the sender's pool when the view is freed)."""
        if self._closed:
            raise self._lost("shm recv")
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for size in sizes:
            kind, seg_id, n = self._next_record(deadline)
            self._check_size(size, n)
            if kind == _SEGMENT:
                seg = self._peer_segment(seg_id, deadline)
                arr = np.frombuffer(seg.mm, dtype=np.uint8, count=n)
                weakref.finalize(arr, _release, self._in.states, seg_id)
                out.append(torch.from_numpy(arr))
            else:
                t = torch.empty(n, dtype=torch.uint8)
                if n:
                    self._read(t, n, deadline)
                out.append(t)
        return out

    def close(self) -> None:
        self._closed = True
        for sock in (self._out_sock, self._in_sock):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _fds_of(ancillary: list) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_BYTES
            fds.extend(struct.unpack(f"{usable // _FD_BYTES}i", data[:usable]))
    return fds


def _release(states: np.ndarray, seg_id: int) -> None:
    states[seg_id] = 0
