"""One-to-many shared memory: one source hands a payload to many receivers of its node.

The source copies a payload once into a pooled, pre-faulted, sealed ``memfd`` *slot*;
each receiver maps that slot copy-on-write (``MAP_PRIVATE``) and gets zero-copy views of
it. Writing to a view copies the written pages into the receiver's own memory: the
source's slot and the other receivers' views never change.

Per source and receiver there is one *link*: an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket
(abstract name, published by the source in an authenticated store; both ends check the
other's process with ``SO_PEERCRED``) and a one-page *flags* memfd made by the source,
one byte per slot. The source sets a receiver's byte when it hands the slot over; the
receiver clears it when the last view of its mapping is freed (a ``weakref.finalize``).
A slot is reused once every live receiver's byte is clear. A receiver whose socket is
closed (its process is gone) holds nothing.

A message is one datagram: :data:`MESSAGE` (sequence number, slot, whether the slot's fd
rides along, the slot's size, the frame's length), followed by the frame when there is
no slot (a message without a payload); with a slot, the frame sits at the start of the
slot and the payload tensors follow at :func:`payload_offsets`. A slot's memfd travels
once per receiver (SCM_RIGHTS). Nothing here knows codecs or workers: a frame is bytes.

A receiver joins with its member index and the largest message it accepts
(:data:`JOIN`). Besides that, it writes only *verdicts* (:data:`VERDICT`: whether it
takes a message the source asked about, and if not, why, in a few words of text): a
message that streams in buckets goes on only once every receiver has said it takes it
(:meth:`FanoutSource.verdicts`). A stream's buckets go through at most
:data:`STREAM_SLOTS` slots, which the receivers map once, read-only, and read again.
This module is the source's side and the protocol; the receiver's side is
:mod:`~rlcomm.comm.transports.shm_fanout_sink`.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import socket
import struct
import time
import uuid
from collections.abc import Collection, Sequence

import numpy as np
import torch

from rlcomm.comm.transports import bulk_copy, shm_handover
from rlcomm.comm.transports.shm_memory import POOL_BYTES, check_memory, sealed_memfd
from rlcomm.errors import AuthenticationError, CommTimeoutError, PeerLostError
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Most slots a source keeps (one flag byte each in a receiver's one-page flags memfd).
#: With all of them held (receivers keep views, or have not yet read), the source waits.
MAX_SLOTS = min(get_settings().bcast_max_slots, 4096)
#: Largest frame that rides inside a datagram (a message without payload).
MAX_INLINE_FRAME = 32 << 10
#: Alignment of the frame's end and of each payload tensor in a slot.
ALIGN = 64
NO_SLOT = 0xFFFFFFFF
#: The "slot" of a message whose payload is handed-over memory
#: (:mod:`~rlcomm.comm.transports.shm_handover`): each tensor's memfd rides along, and a
#: :data:`HANDED_RANGE` per tensor follows the frame.
HANDED_SLOT = 0xFFFFFFFE
HANDED_RANGE = struct.Struct("<QQ")  # offset, bytes
#: Most handed-over tensors one message may carry (the kernel passes at most 253 fds).
MAX_HANDED = 250
MESSAGE = struct.Struct("<QIIQQ")  # seq, slot, fd follows, slot bytes, frame bytes
#: What a receiver sends when it connects: its member index, the largest message it takes.
JOIN = struct.Struct("<IQ")
#: A receiver's answer to a message: its sequence number, its verdict (:data:`TAKES`,
#: :data:`REFUSES`, :data:`OVER_LIMIT`); then, when it does not take it, why (UTF-8 text
#: of at most :data:`MAX_REASON` bytes), and when it takes it, what the caller's protocol
#: says with it (at most :data:`MAX_VERDICT_BODY` bytes, opaque here).
VERDICT = struct.Struct("<QB")
REFUSES, TAKES, OVER_LIMIT = 0, 1, 2
MAX_REASON = 2048
MAX_VERDICT_BODY = 64 << 10
#: Most slots one stream of buckets goes through (the receivers keep their mappings).
STREAM_SLOTS = min(2, MAX_SLOTS)
_CRED = struct.Struct("3i")  # pid, uid, gid
FLAGS_BYTES = 4096
FD_SPACE = socket.CMSG_SPACE(4)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def payload_offsets(frame_len: int, sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each payload tensor of ``sizes`` bytes starts in a slot whose frame is
    ``frame_len`` bytes, and the bytes the slot needs in all."""
    offsets, end = [], _align(frame_len)
    for n in sizes:
        offsets.append(end)
        end = _align(end + n)
    return offsets, end


def _slot_bytes(need: int) -> int:
    """A slot size for ``need`` bytes: 1 MiB or more, at most 1/8 above ``need``."""
    need = max(need, 1 << 20)
    step = 1 << max(20, need.bit_length() - 4)
    return (need + step - 1) // step * step


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


#: A message whose payload is mostly handed-over memory still goes by fds when its other
#: tensors (a step counter beside a state dict) total at most this many bytes: they are
#: copied into one small memfd of their own.
MAX_HANDED_REST = 4 << 20


def _handed_over(
    frame: bytes, payload: Sequence[torch.Tensor]
) -> tuple[list[tuple[int, int, int]], int | None] | None:
    """``(fd, offset, nbytes)`` of every payload tensor, and the fd of the block made for
    those that were not handed-over memory (close it once sent; None if all were), when
    the message can go by fds; else None (the payload is copied into a slot)."""
    if not payload or len(payload) > MAX_HANDED or len(frame) > MAX_INLINE_FRAME:
        return None
    if not shm_handover.has_blocks():
        return None
    handed = [shm_handover.find(t) for t in payload]
    rest = [i for i, h in enumerate(handed) if h is None]
    if not rest:
        return handed, None  # type: ignore[return-value]
    offsets, need = payload_offsets(0, [payload[i].numel() for i in rest])
    if len(rest) == len(payload) or need > MAX_HANDED_REST:
        return None
    fd = sealed_memfd("rlcomm-bcast-rest", need)
    try:
        with mmap.mmap(fd, need, flags=mmap.MAP_SHARED) as mm:
            block = torch.frombuffer(mm, dtype=torch.uint8)
            for i, off in zip(rest, offsets):
                n = payload[i].numel()
                block[off : off + n].copy_(payload[i])
                handed[i] = (fd, off, n)
            del block
    except BaseException:
        os.close(fd)
        raise
    return handed, fd  # type: ignore[return-value]


class _Slot:
    def __init__(self, index: int, size: int):
        self.index, self.size = index, size
        self.fd = sealed_memfd("rlcomm-bcast", size)
        # Not pre-faulted: the first copy into it faults its pages in on several threads.
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)


class _Link:
    """The source's end of one receiver's link."""

    def __init__(self, member: int, sock: socket.socket, flags_fd: int, limit: int):
        self.member, self.sock = member, sock
        self.flags_mm = mmap.mmap(flags_fd, FLAGS_BYTES)
        self.flags = np.frombuffer(self.flags_mm, dtype=np.uint8)
        self.sent: set[int] = set()  # slots whose fd this receiver has
        self.alive = True
        self.limit = limit  # the largest message it said it takes
        self.verdicts: dict[int, tuple[int, bytes]] = {}  # by message, what it answered

    def check_alive(self) -> bool:
        """Whether the receiver is there: read what it wrote (verdicts); an end of
        stream, or anything that is no verdict, means it is gone."""
        if self.alive:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            if poller.poll(0):
                self.read_verdicts()
        return self.alive

    def read_verdicts(self) -> None:
        """Read the verdicts waiting on the socket (a closed or misbehaving receiver is
        killed)."""
        while self.alive:
            try:
                data = self.sock.recv(VERDICT.size + MAX_VERDICT_BODY, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.kill()
                return
            if len(data) < VERDICT.size:  # b"": closed
                self.kill()
                return
            seq, verdict = VERDICT.unpack_from(data)
            if verdict not in (REFUSES, TAKES, OVER_LIMIT) or len(self.verdicts) > 64:
                self.kill()
                return
            self.verdicts[seq] = (verdict, data[VERDICT.size :])

    def kill(self) -> None:
        self.alive = False
        self.flags[:] = 0  # its process is gone, and its mappings with it
        self.sock.close()


class FanoutSource:
    """The source's side: a listening socket, one link per connected receiver, the slots.

    Args:
        receivers: member index -> process id of each expected receiver.
        label: how error messages name the broadcast and the source.
    """

    def __init__(self, receivers: dict[int, int], label: str):
        check_memory()
        self._expected = dict(receivers)
        self._label = label
        self.name = f"\0rlcomm-bcast-{uuid.uuid4().hex}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(self.name)
        self._server.listen(max(1, len(receivers)))
        self._links: dict[int, _Link] = {}
        self.slots: list[_Slot] = []

    @property
    def pool_bytes(self) -> int:
        """Bytes of shared memory the slots hold."""
        return sum(s.size for s in self.slots)

    def missing(self) -> list[int]:
        """Expected receivers that have not connected, or whose link is gone."""
        return [m for m in self._expected if m not in self._links or not self._links[m].alive]

    def limits(self) -> dict[int, int]:
        """The largest message each connected receiver said it takes."""
        return {m: link.limit for m, link in self._links.items() if link.alive}

    def verdicts(
        self, seq: int, members: Collection[int], deadline: float
    ) -> dict[int, tuple[int, bytes] | None]:
        """What each of ``members`` answered to message ``seq`` (``(verdict, body)``: why
        not, as UTF-8 text, or what came with a ``TAKES``),
        waiting until all answered or ``deadline``; ``None`` for a member that did not
        answer (gone, or too late)."""
        links = {m: self._links[m] for m in members if m in self._links}
        while True:
            waiting = [link for link in links.values()
                       if link.alive and seq not in link.verdicts]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            poller = select.poll()
            for link in waiting:
                poller.register(link.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            poller.poll(max(0.0, left) * 1000)
            for link in waiting:
                link.read_verdicts()
        out: dict[int, tuple[int, bytes] | None] = {}
        for m in members:
            link = links.get(m)
            out[m] = None if link is None else link.verdicts.pop(seq, None)
        return out

    def accept(self, deadline: float) -> None:
        """Take receivers' connections until all expected are here or ``deadline``."""
        while any(m not in self._links for m in self._expected):
            remaining = deadline - time.monotonic()
            poller = select.poll()
            poller.register(self._server, select.POLLIN)
            if not poller.poll(max(0.0, remaining) * 1000):
                return
            conn, _ = self._server.accept()
            try:
                self._admit(conn, deadline)
            except (OSError, AuthenticationError, struct.error) as exc:
                logger.warning("%s: a receiver's connection was refused: %s", self._label, exc)
                conn.close()

    def _admit(self, conn: socket.socket, deadline: float) -> None:
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        pid, uid = peer_credentials(conn)
        member, limit = JOIN.unpack(conn.recv(JOIN.size))
        if uid != os.getuid() or self._expected.get(member) != pid or member in self._links:
            raise AuthenticationError(
                f"process {pid} (uid {uid}) claims to be receiver {member}"
            )
        flags_fd = sealed_memfd("rlcomm-bcast-flags", FLAGS_BYTES)
        try:
            socket.send_fds(conn, [b"ok"], [flags_fd])
            link = _Link(member, conn, flags_fd, limit)
        finally:
            os.close(flags_fd)
        conn.settimeout(None)
        self._links[member] = link

    def _free_slot(self, need: int, deadline: float, stream: bool = False) -> _Slot:
        """The smallest slot of at least ``need`` bytes no live receiver holds; a new one
        when none is free and the pool may grow; else wait for one until ``deadline``.
        ``stream``: a bucket of a stream, which takes no new slot while
        :data:`STREAM_SLOTS` slots could hold it (it waits for one of them)."""
        wait = 0.0001
        while True:
            links = [link for link in self._links.values() if link.check_alive()]
            best = None
            fitting = 0
            for slot in self.slots:
                if slot.size < need:
                    continue
                fitting += 1
                if (best is None or slot.size < best.size) and not any(
                    link.flags[slot.index] for link in links
                ):
                    best = slot
            if best is not None:
                return best
            size = _slot_bytes(need)
            grow = not stream or fitting < STREAM_SLOTS
            if grow and len(self.slots) < MAX_SLOTS and self.pool_bytes + size <= POOL_BYTES:
                slot = _Slot(len(self.slots), size)
                self.slots.append(slot)
                return slot
            free = [s for s in self.slots if not any(link.flags[s.index] for link in links)]
            if grow and free and self.pool_bytes - free[0].size + size <= POOL_BYTES:
                return self._replace(free[0], size)  # free but too small: a bigger one
            if time.monotonic() > deadline:
                holders = sorted(link.member for link in links if any(
                    link.flags[s.index] for s in self.slots if s.size >= need
                ))
                error = CommTimeoutError(
                    f"{self._label}: no free shared-memory slot of {need} bytes: members "
                    f"{holders} still hold views of earlier broadcasts (drop them, or copy "
                    "what you keep)"
                )
                error.holders = holders  # type: ignore[attr-defined]
                raise error
            time.sleep(wait)
            wait = min(wait * 2, 0.001)

    def _replace(self, old: _Slot, size: int) -> _Slot:
        slot = _Slot(old.index, size)
        self.slots[old.index] = slot
        old.tensor = None
        os.close(old.fd)
        try:
            old.mm.close()
        except BufferError:  # a view of it is still alive here; it unmaps when freed
            pass
        for link in self._links.values():
            link.sent.discard(old.index)  # its new memory goes with its next message
        return slot

    def publish(
        self, seq: int, frame: bytes, payload: Sequence[torch.Tensor], deadline: float,
        only: Collection[int] | None = None, bucket: int = 0,
    ) -> dict[int, Exception]:
        """Hand message ``seq`` (``frame``, then the uint8 ``payload`` tensors) to every
        connected receiver (``only``: to those members). Returns the failures by member (a
        receiver whose process is gone, or whose socket stayed full until ``deadline``);
        the others got it. ``bucket``: the message is a bucket of a stream of buckets of
        at most that many bytes (it goes through the stream's slots)."""
        failures: dict[int, Exception] = {}
        slot = None
        by_fd = None if bucket else _handed_over(frame, payload)
        handed, rest_fd = by_fd if by_fd is not None else (None, None)
        if handed is not None:
            payload = ()
        elif payload or len(frame) > MAX_INLINE_FRAME:
            offsets, need = payload_offsets(len(frame), [t.numel() for t in payload])
            if bucket:
                need = max(need, payload_offsets(len(frame), [bucket])[1])
            slot = self._free_slot(need, deadline, stream=bool(bucket))
            slot.mm[: len(frame)] = frame
            for off, t in zip(offsets, payload):
                bulk_copy.copy(slot.tensor[off : off + t.numel()], t)
        try:
            self._hand_to_each(seq, frame, slot, handed, deadline, failures, only)
        finally:
            if rest_fd is not None:  # each receiver got its own reference
                os.close(rest_fd)
        return failures

    def _hand_to_each(
        self, seq: int, frame: bytes, slot: _Slot | None,
        handed: list[tuple[int, int, int]] | None, deadline: float,
        failures: dict[int, Exception], only: Collection[int] | None = None,
    ) -> None:
        for member, link in self._links.items():
            if only is not None and member not in only:
                continue
            if not link.alive:
                failures[member] = PeerLostError(f"{self._label}: receiver {member} is gone")
                continue
            try:
                if handed is not None:
                    self._send_handed(link, seq, frame, handed, deadline)
                else:
                    self._send(link, seq, frame, slot, deadline)
            except OSError as exc:
                if slot is not None:
                    link.flags[slot.index] = 0
                if isinstance(exc, TimeoutError):
                    failures[member] = CommTimeoutError(
                        f"{self._label}: receiver {member} has not read its earlier "
                        "broadcasts (its socket stayed full)"
                    )
                else:
                    link.kill()
                    failures[member] = PeerLostError(
                        f"{self._label}: receiver {member} is gone ({exc})"
                    )

    def _send(
        self, link: _Link, seq: int, frame: bytes, slot: _Slot | None, deadline: float
    ) -> None:
        link.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if slot is None:
                link.sock.send(MESSAGE.pack(seq, NO_SLOT, 0, 0, len(frame)) + frame)
                return
            link.flags[slot.index] = 1
            new = slot.index not in link.sent
            msg = MESSAGE.pack(seq, slot.index, int(new), slot.size, len(frame))
            if new:
                socket.send_fds(link.sock, [msg], [slot.fd])
                link.sent.add(slot.index)
            else:
                link.sock.send(msg)
        finally:
            if link.alive:
                link.sock.settimeout(None)

    def _send_handed(
        self, link: _Link, seq: int, frame: bytes, handed: list[tuple[int, int, int]],
        deadline: float,
    ) -> None:
        """One datagram: the message, the frame, each tensor's range; its fds beside."""
        msg = MESSAGE.pack(seq, HANDED_SLOT, len(handed), 0, len(frame)) + frame + b"".join(
            HANDED_RANGE.pack(offset, nbytes) for _, offset, nbytes in handed
        )
        link.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            socket.send_fds(link.sock, [msg], [fd for fd, _, _ in handed])
        finally:
            if link.alive:
                link.sock.settimeout(None)

    def close(self) -> None:
        self._server.close()
        for link in self._links.values():
            if link.alive:
                link.sock.close()
        for slot in self.slots:
            os.close(slot.fd)
        self._links.clear()
