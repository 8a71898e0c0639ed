"""The sending half of the shared-memory transport: one direction's ring, written by this
side (see :mod:`~rlcomm.comm.transports.shm` for the design)."""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Sequence

import torch

from rlcomm.comm.transports import bulk_copy, shm_handover, shm_relay
from rlcomm.comm.transports.shm_fanout import payload_offsets
from rlcomm.comm.transports.shm_memory import (
    CTRL_BYTES,
    HEAD,
    RING_BYTES,
    SEGMENT_THRESHOLD,
    SLEEPING,
    TAIL,
    WAITING,
    Ring,
    Segment,
    SegmentPool,
    release_segment,
)
from rlcomm.comm.transports.shm_signals import SignalSockets
from rlcomm.errors import CommTimeoutError

#: A ring record's head: kind, segment id, nbytes.
RECORD = struct.Struct("<IIQ")
INLINE, SEGMENT, FRAME, HANDED_RECORD = 1, 2, 3, 4
#: One bucket of a streamed message, its pieces laid out in one segment (the record's
#: size is the bucket's span, :func:`~.shm_fanout.payload_offsets`).
BUCKET = 5
#: Where a payload tensor's memory is handed over: ``(fd, offset, nbytes)`` of a block of
#: :mod:`.shm_handover`, a peer's segment this process relays (:mod:`.shm_relay`), or None.
HandedOver = tuple[int, int, int] | shm_relay.Mapped | None


class RingWriter:
    """Writes records into this side's ring and payloads into its segments.

    Args:
        ring: the outgoing ring.
        pool: the segments of this direction.
        signals: the pair's sockets (wake-up tokens out, ring-space tokens back).
        peer: how error messages name the other end.
        max_in_flight: segments this side may have in flight.
    """

    def __init__(
        self, ring: Ring, pool: SegmentPool, signals: SignalSockets, peer: str,
        max_in_flight: int,
    ):
        self._out = ring
        self._pool = pool
        self._signals = signals
        self._peer = peer
        self._max_in_flight = max_in_flight
        self._relay = (shm_relay.RelaySlots(ring.states, signals.send_fd)
                       if shm_relay.enabled() else None)

    def wake_reader(self) -> None:
        """Send a token after new data, if the peer's reader sleeps (else it sees the data
        on its own: it is reading or spinning)."""
        if self._out.words[SLEEPING // 8]:
            self._signals.notify(self._signals.out)

    def _wait_token(self, deadline: float) -> None:
        """Wait a moment for the peer's ring-space token (short waits: a token can be
        missed when both sides race on the flag)."""
        try:
            self._signals.read(
                self._signals.out, True, min(deadline, time.monotonic() + 0.002), "shm send"
            )
        except CommTimeoutError:
            pass

    def space(self) -> int:
        words = self._out.words
        return RING_BYTES - int(words[HEAD // 8] - words[TAIL // 8])

    def write(self, src: torch.Tensor | bytes, deadline: float) -> None:
        """Copy ``src`` (a flat, contiguous uint8 tensor, or bytes) into the ring, waiting
        for space."""
        words = self._out.words
        is_bytes = isinstance(src, (bytes, bytearray))
        ring = self._out.mm
        # A tensor is copied by address: one call instead of two slices and a copy_,
        # each a torch call (about 10 µs less for a 64 KiB payload on the development
        # machine).
        if not is_bytes and not src.is_contiguous():
            src = src.contiguous()  # (every sender's payload is; an address needs it)
        addr = 0 if is_bytes else src.data_ptr()
        done, total = 0, len(src) if is_bytes else src.numel()
        while done < total:
            space = self.space()
            if space == 0:
                self._wait_space(deadline)
                continue
            n = min(space, total - done)
            head = int(words[HEAD // 8])
            pos = head % RING_BYTES
            first = min(n, RING_BYTES - pos)
            if is_bytes:
                ring[CTRL_BYTES + pos : CTRL_BYTES + pos + first] = src[done : done + first]
                if first < n:
                    ring[CTRL_BYTES : CTRL_BYTES + n - first] = src[done + first : done + n]
            else:
                base = self._out.addr
                ctypes.memmove(base + pos, addr + done, first)
                if first < n:
                    ctypes.memmove(base, addr + done + first, n - first)
            words[HEAD // 8] = head + n
            done += n
            if done < total:
                self.wake_reader()

    def _wait_space(self, deadline: float, need: int = 1) -> None:
        """Wait until the ring has ``need`` free bytes (at most its size)."""
        words = self._out.words
        self.wake_reader()  # the receiver may be asleep with data waiting
        words[WAITING // 8] = 1
        while self.space() < need:
            if time.monotonic() > deadline:
                words[WAITING // 8] = 0
                raise CommTimeoutError(f"shm send to {self._peer} timed out (ring full)")
            self._wait_token(deadline)
        words[WAITING // 8] = 0

    def handed_over(self, payload: Sequence[torch.Tensor]) -> list[HandedOver] | None:
        """Where each payload tensor's memory is handed over or relayed (None: none is)."""
        if not payload:
            return None
        blocks = shm_handover.has_blocks()
        relaying = self._relay is not None and shm_relay.active()
        if not blocks and not relaying:
            return None
        handed: list[HandedOver] = []
        for t in payload:
            h: HandedOver = None
            if t.numel() >= SEGMENT_THRESHOLD:
                if blocks:
                    h = shm_handover.find(t)
                if h is None and relaying:
                    h = shm_relay.find(t)
            handed.append(h)
        return handed if any(h is not None for h in handed) else None

    def reserve(
        self, frame_bytes: int, payload: Sequence[torch.Tensor], deadline: float,
        handed: Sequence[HandedOver] | None = None,
    ) -> list[Segment | None]:
        """Before a message is written: take a segment for each large tensor and wait
        for ring space for the rest, so that writing it cannot stall on a receiver that
        stopped reading. On timeout nothing was written (the segments go back).

        A message too large for that (more large tensors than half the segments in
        flight, or more ring bytes than the ring) is written as it goes instead."""
        sizes = [t.numel() for t in payload]
        large = [i for i, n in enumerate(sizes)
                 if n >= SEGMENT_THRESHOLD and not (handed and handed[i])]
        segments: list[Segment | None] = [None] * len(sizes)
        in_ring = frame_bytes + RECORD.size * len(sizes) + sum(
            n for n in sizes if n < SEGMENT_THRESHOLD
        )
        if len(large) > self._max_in_flight // 2 or in_ring > RING_BYTES:
            return segments
        if large:
            self._pool.pace(deadline)
        words = self._out.words
        while True:
            for i in large:
                if segments[i] is None:
                    segments[i] = self._pool.take(sizes[i], deadline)
            if all(segments[i] is not None for i in large) and self.space() >= in_ring:
                words[WAITING // 8] = 0
                return segments
            if time.monotonic() > deadline:
                words[WAITING // 8] = 0
                for seg in segments:
                    if seg is not None:
                        release_segment(self._out.states, seg.id)
                raise CommTimeoutError(
                    f"shm send to {self._peer} timed out before it began: the receiver "
                    "holds all the ring and segments it may (it is not reading)"
                )
            self.wake_reader()  # the receiver may be asleep with data waiting
            words[WAITING // 8] = 1  # it sends a token when it frees ring space
            self._wait_token(deadline)

    def send_payload(
        self, tensors: Sequence[torch.Tensor], deadline: float,
        segments: Sequence[Segment | None] | None = None,
        handed: Sequence[HandedOver] | None = None,
    ) -> None:
        if handed is None and segments is None:
            handed = self.handed_over(tensors)
        for k, t in enumerate(tensors):
            n = t.numel()
            block = handed[k] if handed else None
            if type(block) is tuple:  # only the fd travels
                fd, offset, nbytes = block
                self._signals.send_handed(fd, offset, nbytes, deadline)
                self.write(RECORD.pack(HANDED_RECORD, 0, n), deadline)
                continue
            if block is not None and self._relay is not None:  # the peer's segment goes on
                relay_id = self._relay.take(block, t, deadline)
                if relay_id is not None:
                    self.write(RECORD.pack(SEGMENT, relay_id, n), deadline)
                    continue
            seg = segments[k] if segments else None
            if seg is None and n >= SEGMENT_THRESHOLD:
                seg = self._pool.take(n, deadline)
            if seg is not None:
                bulk_copy.copy(seg.tensor[:n], t)
                self.write(RECORD.pack(SEGMENT, seg.id, n), deadline)
            else:
                self.write(RECORD.pack(INLINE, 0, n), deadline)
                if n:
                    self.write(t.numpy().tobytes() if n <= 4096 else t, deadline)

    def send_bucket(self, pieces: Sequence[torch.Tensor], deadline: float) -> None:
        """One bucket of a streamed message: its pieces copied into one segment (waiting
        for one to come back while the receiver reads the buckets before), then one
        :data:`BUCKET` record. A bucket no segment can hold goes through the ring, a
        record per piece."""
        sizes = [t.numel() for t in pieces]
        offsets, span = payload_offsets(0, sizes)
        seg = self._pool.take_waiting(span, deadline, self._signals.peer_gone)
        if seg is None:
            for t in pieces:
                self.write(RECORD.pack(INLINE, 0, t.numel()), deadline)
                self.write(t, deadline)
            return
        for off, t in zip(offsets, pieces):
            bulk_copy.copy(seg.tensor[off : off + t.numel()], t)
        self.write(RECORD.pack(BUCKET, seg.id, span), deadline)
