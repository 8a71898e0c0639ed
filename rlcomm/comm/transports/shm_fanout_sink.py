"""A receiver's end of a one-to-many shared-memory link (see
:mod:`~rlcomm.comm.transports.shm_fanout` for the protocol): it checks the source's
process, maps each slot copy-on-write per message and clears its flag byte when the last
view of that mapping is freed. A bucket of a stream is read instead through a read-only
mapping of its slot made once and kept (at most :data:`STREAM_SLOTS` of them), since
its bytes are only copied out."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import select
import socket
import struct
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from rlcomm.comm.transports.shm_fanout import (
    FLAGS_BYTES,
    HANDED_RANGE,
    HANDED_SLOT,
    JOIN,
    MAX_HANDED,
    MAX_INLINE_FRAME,
    MAX_REASON,
    MAX_VERDICT_BODY,
    MESSAGE,
    NO_SLOT,
    STREAM_SLOTS,
    TAKES,
    VERDICT,
    payload_offsets,
    peer_credentials,
)
from rlcomm.comm.transports.shm_handover import map_received
from rlcomm.comm.transports.shm_memory import check_memory, checked_size
from rlcomm.errors import AuthenticationError, CommTimeoutError, PeerLostError
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Room for the most fds a handed-over message carries.
_HANDED_FD_SPACE = socket.CMSG_SPACE(4 * MAX_HANDED)


class FanoutMessage:
    """A received message: its sequence number, frame, and the slot's view (or None)."""

    def __init__(self, seq: int, frame: bytes, segment: torch.Tensor | None,
                 handed: list[torch.Tensor] | None = None):
        self.seq, self.frame, self.segment = seq, frame, segment
        self.handed = handed  # views of handed-over memory, one per payload tensor

    def payload(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Views of the payload tensors of ``sizes`` bytes in the slot (checked against
        the slot's size before any view is made)."""
        if not sizes:
            return []
        if self.handed is not None:
            if [t.numel() for t in self.handed] != list(sizes):
                raise PeerLostError(
                    f"a broadcast declares payloads of {list(sizes)} bytes but hands over "
                    f"{[t.numel() for t in self.handed]}"
                )
            return self.handed
        offsets, need = payload_offsets(len(self.frame), sizes)
        if self.segment is None or need > self.segment.numel():
            have = 0 if self.segment is None else self.segment.numel()
            raise PeerLostError(
                f"a broadcast declares {need} bytes of payload but its slot holds {have}"
            )
        return [self.segment[off : off + n] for off, n in zip(offsets, sizes)]


class FanoutSink:
    """A receiver's side of its link to one source.

    Args:
        name: the source's socket name (from the authenticated store).
        member: this receiver's member index (the source checks it against the pid).
        source_pid: the source's process id (checked with ``SO_PEERCRED``).
        deadline: for the set-up.
        label: how error messages name the broadcast and the source.
        limit: the largest message this receiver takes, told to the source (default:
            ``RLCOMM_MAX_MESSAGE_BYTES``): a larger one streams, and this receiver says
            whether it takes it.
    """

    def __init__(self, name: str, member: int, source_pid: int, deadline: float, label: str,
                 limit: int | None = None):
        if not name.startswith("\0rlcomm-bcast-"):
            raise AuthenticationError(f"{label}: unexpected socket name {name!r}")
        check_memory()
        self._label = label
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.settimeout(max(0.05, deadline - time.monotonic()))
            self._sock.connect(name)
            pid, uid = peer_credentials(self._sock)
            if uid != os.getuid() or pid != source_pid:
                raise AuthenticationError(f"{label}: the socket belongs to another process")
            if limit is None:
                limit = get_settings().max_message_bytes
            self._sock.sendall(JOIN.pack(member, limit))
            _, fds, _, _ = socket.recv_fds(self._sock, 16, 1)
            if len(fds) != 1:
                raise PeerLostError(f"{label}: the source sent no flags memory")
            try:
                if checked_size(fds[0], label) != FLAGS_BYTES:
                    raise AuthenticationError(f"{label}: flags memory of the wrong size")
                self._flags_mm = mmap.mmap(fds[0], FLAGS_BYTES)
            finally:
                os.close(fds[0])
        except (TimeoutError, OSError) as exc:
            self._sock.close()
            raise CommTimeoutError(f"{label}: connecting to the source failed: {exc}") from exc
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)
        self._flags = np.frombuffer(self._flags_mm, dtype=np.uint8)
        self._fds: dict[int, tuple[int, int]] = {}  # slot -> (fd, size)
        # Read-only mappings of the slots streams go through, the latest used last.
        self._stream_maps: OrderedDict[int, mmap.mmap] = OrderedDict()
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)

    def verdict(self, seq: int, verdict: int, why: str = "", body: bytes = b"") -> None:
        """Tell the source whether this receiver takes message ``seq`` (``TAKES``,
        ``REFUSES``, ``OVER_LIMIT``), and why not; ``body``: what comes with a ``TAKES``
        (at most ``MAX_VERDICT_BODY`` bytes)."""
        if len(body) > MAX_VERDICT_BODY:
            raise ValueError(f"a verdict body of {len(body)} bytes, over {MAX_VERDICT_BODY}")
        data = VERDICT.pack(seq, verdict) + (body if verdict == TAKES
                                             else why.encode()[:MAX_REASON])
        try:
            self._sock.send(data, socket.MSG_DONTWAIT)
        except OSError as exc:  # a full or closed socket: the source sees no verdict
            logger.debug("%s: the verdict on message %d did not go: %s", self._label, seq, exc)

    def recv(self, deadline: float, stream: bool = False) -> FanoutMessage:
        """The next message, waiting until ``deadline``. ``stream``: it is a bucket of a
        stream, read through the slot's kept read-only mapping.

        Raises:
            CommTimeoutError: nothing came in time.
            PeerLostError: the source is gone, or sent a message that does not check out.
        """
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._poller.poll(remaining * 1000):
            raise CommTimeoutError(f"{self._label}: nothing arrived in time")
        try:
            data, ancillary, _, _ = self._sock.recvmsg(
                MESSAGE.size + MAX_INLINE_FRAME + MAX_HANDED * HANDED_RANGE.size,
                _HANDED_FD_SPACE, socket.MSG_DONTWAIT
            )
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise CommTimeoutError(f"{self._label}: nothing arrived in time") from exc
            raise PeerLostError(f"{self._label}: the source is gone ({exc})") from exc
        fds = [
            fd for level, kind, raw in ancillary
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4])
        ]
        try:
            return self._message(data, fds, stream)
        finally:
            for fd in fds:
                os.close(fd)

    def _message(self, data: bytes, fds: list[int], stream: bool = False) -> FanoutMessage:
        if not data:
            raise PeerLostError(f"{self._label}: the source is gone")
        if len(data) < MESSAGE.size:
            raise PeerLostError(f"{self._label}: a malformed message ({len(data)} bytes)")
        seq, slot, has_fd, size, frame_len = MESSAGE.unpack_from(data)
        if slot == NO_SLOT:
            frame = data[MESSAGE.size :]
            if len(frame) != frame_len:
                raise PeerLostError(f"{self._label}: a truncated frame")
            return FanoutMessage(seq, frame, None)
        if slot == HANDED_SLOT:
            return self._handed(seq, data[MESSAGE.size :], has_fd, frame_len, fds)
        if slot >= FLAGS_BYTES:
            raise PeerLostError(f"{self._label}: slot {slot} out of range")
        if has_fd:
            if len(fds) != 1:
                raise PeerLostError(f"{self._label}: a new slot came without its memory")
            old = self._fds.pop(slot, None)
            if old is not None:
                os.close(old[0])
            self._forget_map(slot)
            real = checked_size(fds[0], self._label)
            self._fds[slot] = (os.dup(fds[0]), real)
        if slot not in self._fds:
            raise PeerLostError(f"{self._label}: slot {slot} was never passed")
        fd, real = self._fds[slot]
        if size != real or frame_len > real:
            raise PeerLostError(
                f"{self._label}: a message declares a {size}-byte slot with a {frame_len}-byte "
                f"frame; the slot has {real} bytes"
            )
        if stream:
            mm = self._stream_map(slot, fd, real)
        else:
            mm = mmap.mmap(fd, real, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        frame = mm[:frame_len]
        arr = np.frombuffer(mm, dtype=np.uint8)
        weakref.finalize(arr, _release, self._flags, slot)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only: only copied out
            return FanoutMessage(seq, frame, torch.from_numpy(arr))

    def _stream_map(self, slot: int, fd: int, size: int) -> mmap.mmap:
        """The kept read-only mapping of ``slot`` (made now if need be; the least
        recently used one beyond :data:`STREAM_SLOTS` goes)."""
        mm = self._stream_maps.pop(slot, None)
        if mm is None:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._stream_maps[slot] = mm
        while len(self._stream_maps) > STREAM_SLOTS:
            self._close_map(self._stream_maps.popitem(last=False)[1])
        return mm

    def _forget_map(self, slot: int) -> None:
        mm = self._stream_maps.pop(slot, None)
        if mm is not None:
            self._close_map(mm)

    @staticmethod
    def _close_map(mm: mmap.mmap) -> None:
        try:
            mm.close()
        except BufferError:  # a view of it is still alive; it unmaps when freed
            pass

    def _handed(self, seq: int, rest: bytes, count: int, frame_len: int,
                fds: list[int]) -> FanoutMessage:
        """A message whose ``count`` payload tensors are handed-over memfds."""
        if len(fds) != count or len(rest) != frame_len + count * HANDED_RANGE.size:
            raise PeerLostError(f"{self._label}: a malformed handed-over message")
        views = [
            map_received(fd, *HANDED_RANGE.unpack_from(rest, frame_len + k * HANDED_RANGE.size),
                         self._label)
            for k, fd in enumerate(fds)
        ]
        return FanoutMessage(seq, rest[:frame_len], None, views)

    def close(self) -> None:
        self._sock.close()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for slot in list(self._stream_maps):
            self._forget_map(slot)


def _release(flags: np.ndarray, slot: int) -> None:
    """The last view of a slot's mapping is gone: hand the slot back to the source."""
    flags[slot] = 0
