"""The memory of the shared-memory transport: ``memfd`` mappings, rings and segments.

A *ring* mapping is a control block of :data:`CTRL_BYTES` (int64 words at the byte
offsets :data:`HEAD`, :data:`TAIL`, :data:`WAITING`, :data:`SLEEPING`, and one state
byte per segment from :data:`STATES`) followed by :data:`RING_BYTES` of data. The
sender writes ``HEAD`` and ``WAITING``; the receiver writes ``TAIL``, ``SLEEPING`` and
clears segment states. A *segment* is a mapping that carries one large payload; a
sender keeps its segments in a :class:`SegmentPool`.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import mmap
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from rlcomm.errors import (
    AuthenticationError,
    CapacityError,
    CommError,
    CommTimeoutError,
    PeerLostError,
)
from rlcomm.settings import get_settings

logger = logging.getLogger(__name__)

#: Bytes of each direction's ring (payloads below the segment threshold, descriptors).
RING_BYTES = get_settings().shm_ring_bytes
#: Payloads of at least this many bytes go through pooled segments.
SEGMENT_THRESHOLD = get_settings().shm_segment_threshold
#: Most bytes of segments one direction keeps (a payload no segment can hold goes through
#: the ring; one over a quarter of it streams in buckets, :mod:`rlcomm.comm.buckets`).
POOL_BYTES = get_settings().shm_pool_bytes
#: Segment states of one direction (own segments, then relayed ones).
MAX_SEGMENTS = 1024
#: The top states carry segments relayed from other peers (:mod:`.shm_relay`).
RELAY_SLOTS = 64
FIRST_RELAY_SLOT = MAX_SEGMENTS - RELAY_SLOTS
#: Bytes of a ring's control block, before its data.
CTRL_BYTES = 4096
#: Byte offsets in the control block: the counters and flags, then the segment states.
HEAD, TAIL, WAITING, SLEEPING, STATES = 0, 8, 16, 24, 1024
#: A sender with this share of its segments in flight waits a moment for the receiver to
#: give one back before it takes another (:meth:`SegmentPool.pace`) ...
PACE_SHARE = 0.75
#: ... at most this long (seconds) ...
PACE_SECONDS = 0.006
#: ... and, when none came back in that time (the receiver keeps them), it does not wait
#: again for this long.
PACE_OFF_SECONDS = 0.05
#: How often a paced take looks whether a segment came back (seconds).
PACE_POLL_SECONDS = 50e-6
#: Segments a stream of buckets goes through, at most (while the receiver copies one
#: out, the sender fills the other).
STREAM_SEGMENTS = 2
#: The seals of a memfd another process maps: it can neither shrink nor grow.
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4)


#: Where a container's memory limit is written (cgroup v2, then v1).
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def node_memory() -> tuple[int, str]:
    """The memory this process's shared memory may take, and where that figure comes
    from: the node's ``MemTotal``, or its container's limit when that is lower."""
    total, where = 0, "MemTotal in /proc/meminfo"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    total = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 1 << 62):
            total, where = int(text), f"the container's memory limit ({path})"
        break
    return total, where


def dev_shm_bytes() -> int | None:
    """The size of ``/dev/shm`` (None: there is none)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


@functools.lru_cache(maxsize=1)
def check_memory() -> None:
    """What a node's first shared-memory transport (or fan-out) checks, once per
    process: that ``memfd`` works, and that the pool fits the node's memory.

    rlcomm's shared memory is ``memfd_create`` memory: a small ``/dev/shm`` (64 MB in a
    Docker container by default) does not bound it (the container's memory limit
    does), and is only logged.

    Raises:
        CommError: ``memfd_create`` fails (a sandbox that forbids it).
        CapacityError: ``RLCOMM_SHM_POOL_BYTES`` is more than the node's memory.
    """
    try:
        fd = os.memfd_create("rlcomm-check", getattr(os, "MFD_CLOEXEC", 0))
        os.close(fd)
    except (AttributeError, OSError) as exc:
        raise CommError(
            f"shared memory between workers needs memfd_create, which failed here ({exc}); "
            "use CollectiveGroupOptions(transport='gloo') for these workers") from exc
    total, where = node_memory()
    if total and POOL_BYTES > total:
        raise CapacityError(
            f"the pool, RLCOMM_SHM_POOL_BYTES={POOL_BYTES} ({POOL_BYTES >> 20} MiB), is more than this "
            f"node's memory, {total} bytes ({total >> 20} MiB, {where}): set it to at most "
            f"{total // 4} (a quarter of it); a streamed sync holds only two buckets of it "
            "per connection")
    shm = dev_shm_bytes()
    if shm is not None and shm < POOL_BYTES:
        logger.info("/dev/shm holds %d bytes, less than RLCOMM_SHM_POOL_BYTES=%d: rlcomm "
                    "does not use /dev/shm (its shared memory is memfd_create memory)",
                    shm, POOL_BYTES)


def map_fd(fd: int, size: int, populate: bool = True) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` shared (and pre-faulted, with ``populate``)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def new_memfd(name: str, size: int, populate: bool = True) -> tuple[int, mmap.mmap]:
    """A new anonymous memory file of ``size`` bytes and its mapping. Without
    ``populate``, its pages fault in at the first write (a split copy faults them in on
    several threads at once: :mod:`~rlcomm.comm.transports.bulk_copy`)."""
    fd = os.memfd_create(name, getattr(os, "MFD_CLOEXEC", 0))
    os.ftruncate(fd, size)
    return fd, map_fd(fd, size, populate)


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes that can no longer shrink or grow (so a receiver's
    mapping can never run past its end)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS | getattr(fcntl, "F_SEAL_SEAL", 1))
    except BaseException:
        os.close(fd)
        raise
    return fd


def checked_size(fd: int, what: str) -> int:
    """The size of a received memfd, after checking that it is sealed against shrinking."""
    seals = fcntl.fcntl(fd, getattr(fcntl, "F_GET_SEALS", 1034))
    if seals & _SEALS != _SEALS:
        raise AuthenticationError(f"{what}: the source passed a memfd that is not sealed")
    return os.fstat(fd).st_size


class Ring:
    """A mapped ring: control words, segment states and the data bytes."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        # The control words as a memoryview: an item is a Python int, read or written in
        # about a quarter of a NumPy scalar's time (every message reads and writes them).
        self.words = memoryview(mm)[:32].cast("q")
        self.states = np.frombuffer(mm, dtype=np.uint8, count=MAX_SEGMENTS, offset=STATES)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=CTRL_BYTES, count=RING_BYTES)
        #: The address of the data bytes (payloads are copied in and out by address).
        self.addr = self.data.data_ptr()
        #: The address of the control block (the mapping's first byte).
        self.base = self.addr - CTRL_BYTES


class Segment:
    """One mapped segment (``id`` indexes the ring's segment states)."""

    def __init__(self, seg_id: int, size: int, mm: mmap.mmap):
        self.id = seg_id
        self.size = size
        self.mm = mm
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8, count=size)


def release_segment(states: np.ndarray, seg_id: int) -> None:
    """Hand segment ``seg_id`` back to its sender's pool."""
    states[seg_id] = 0


class SegmentPool:
    """A sender's segments, reused once the receiver clears their states.

    Args:
        states: the segment state bytes of the sender's ring.
        announce: passes a new segment's ``(id, size, memfd, deadline)`` to the receiver.
        max_in_flight: grow the pool only while fewer segments are in flight: a sender
            that runs far ahead of its receiver streams through the ring instead of
            mapping new memory.
    """

    def __init__(
        self,
        states: np.ndarray,
        announce: Callable[[int, int, int, float], None],
        max_in_flight: int,
    ):
        self._states = states
        self._announce = announce
        self._max_in_flight = max_in_flight
        self.segments: list[Segment] = []
        self._by_size: dict[int, list[Segment]] = {}
        self._turns: dict[int, int] = {}  # where the next look in each size starts
        self._bytes = 0
        self._pace_at = max(1, int(max_in_flight * PACE_SHARE))
        self._pace_off_until = 0.0
        #: Paced takes: ended by a segment coming back, and ended by the time limit.
        self.paced = [0, 0]
        #: Whether a take waits in :meth:`pace` now (read-only to others: tests, status).
        self.pacing = False

    def pace(self, deadline: float) -> None:
        """Before taking a segment: while :data:`PACE_SHARE` of ``max_in_flight`` are in
        flight, wait (at most :data:`PACE_SECONDS`) for the receiver to give one back.

        A receiver that falls behind a faster sender (a channel worker between a producer
        and a consumer) holds more and more of its segments, and past its own limit it
        copies what comes in, which slows it further. A short wait here keeps the sender
        at the receiver's pace instead. A receiver that keeps what it got (a queue
        nobody reads yet) gives nothing back in that time: the sender then takes
        segments without waiting for :data:`PACE_OFF_SECONDS`.
        """
        k = len(self.segments)
        if k < self._pace_at:
            return
        now = time.monotonic()
        states = self._states[:k]
        if now < self._pace_off_until or int(np.count_nonzero(states)) < self._pace_at:
            return
        end = min(deadline, now + PACE_SECONDS)
        self.pacing = True
        try:
            while True:
                time.sleep(PACE_POLL_SECONDS)
                if int(np.count_nonzero(states)) < self._pace_at:
                    self.paced[0] += 1
                    return
                now = time.monotonic()
                if now >= end:
                    self.paced[1] += 1
                    self._pace_off_until = now + PACE_OFF_SECONDS
                    return
        finally:
            self.pacing = False

    def take(self, nbytes: int, deadline: float, grow: bool = True) -> Segment | None:
        """A free segment for ``nbytes``, now marked in flight; None if there is none and
        the pool may not grow (the payload then streams through the ring). ``grow``:
        the pool may grow for it."""
        states = self._states
        size = max(1 << 20, 1 << (nbytes - 1).bit_length())  # sizes are powers of 2
        best = None
        same = self._by_size.get(size)
        if same:  # round robin: in a stream, the oldest segment is the likeliest free
            turn = self._turns.get(size, 0)
            for k in range(len(same)):
                seg = same[(turn + k) % len(same)]
                if states[seg.id] == 0:
                    best = seg
                    self._turns[size] = (turn + k + 1) % len(same)
                    break
        if best is None:  # a free larger one, the smallest that fits
            for seg in self.segments:
                if states[seg.id] == 0 and seg.size >= nbytes and (
                    best is None or seg.size < best.size
                ):
                    best = seg
        if best is None:
            best = self._grow(size, deadline) if grow else None
            if best is None:
                return None
        states[best.id] = 1
        return best

    def take_waiting(self, nbytes: int, deadline: float, gone: Callable[[], bool]) -> Segment | None:
        """A segment for ``nbytes`` as :meth:`take` gives one (the pool grows only while
        fewer than :data:`STREAM_SEGMENTS` could hold it), else the first of those that
        comes back (a stream of buckets reuses its segments at the receiver's pace).
        None when no segment can ever hold it (the pool is too small, or full of
        smaller ones).

        Raises:
            CommTimeoutError: none came back by ``deadline``.
            PeerLostError: ``gone()`` says the receiver is gone.
        """
        wait = PACE_POLL_SECONDS
        while True:
            fitting = sum(1 for s in self.segments if s.size >= nbytes)
            seg = self.take(nbytes, deadline, grow=fitting < STREAM_SEGMENTS)
            if seg is not None:
                return seg
            if not fitting:
                return None
            if gone():
                raise PeerLostError("shm send: the receiver is gone")
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    "shm send: the receiver gave no segment back in time (it is not "
                    "reading)")
            time.sleep(wait)
            wait = min(wait * 2, 0.001)

    def _grow(self, size: int, deadline: float) -> Segment | None:
        in_use = int(np.count_nonzero(self._states[: len(self.segments)]))
        if (
            in_use >= self._max_in_flight
            or self._bytes + size > POOL_BYTES
            or len(self.segments) >= FIRST_RELAY_SLOT
        ):
            return None
        seg_id = len(self.segments)
        fd, mm = new_memfd("rlcomm-seg", size, populate=False)
        seg = Segment(seg_id, size, mm)
        try:
            # Bounded: the peer reads its socket whenever its ring runs empty.
            self._announce(seg_id, size, fd, deadline)
        finally:
            os.close(fd)
        self.segments.append(seg)
        self._by_size.setdefault(size, []).append(seg)
        self._bytes += size
        return seg
