"""The memory of the shared-memory transport: ``memfd`` mappings, rings and segments.

A *ring* mapping is a control block of :data:`CTRL_BYTES` (int64 words at the byte
offsets :data:`HEAD`, :data:`TAIL`, :data:`WAITING`, :data:`SLEEPING`, and one state
byte per segment from :data:`STATES`) followed by :data:`RING_BYTES` of data. The
sender writes ``HEAD`` and ``WAITING``; the receiver writes ``TAIL``, ``SLEEPING`` and
clears segment states. A *segment* is a mapping that carries one large payload.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

#: Bytes of each direction's ring (payloads below the segment threshold, descriptors).
RING_BYTES = int(os.environ.get("RLCOMM_SHM_RING_BYTES", 8 << 20))
#: Payloads of at least this many bytes go through pooled segments.
SEGMENT_THRESHOLD = int(os.environ.get("RLCOMM_SHM_SEGMENT_THRESHOLD", 256 << 10))
#: Most bytes of segments one direction keeps; past it, payloads stream through the ring.
POOL_BYTES = int(os.environ.get("RLCOMM_SHM_POOL_BYTES", 4 << 30))
#: Most segments one direction may have.
MAX_SEGMENTS = 1024
#: Bytes of a ring's control block, before its data.
CTRL_BYTES = 4096
#: Byte offsets in the control block: the counters and flags, then the segment states.
HEAD, TAIL, WAITING, SLEEPING, STATES = 0, 8, 16, 24, 1024


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` shared and pre-faulted."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def new_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new anonymous memory file of ``size`` bytes and its mapping."""
    fd = os.memfd_create(name, getattr(os, "MFD_CLOEXEC", 0))
    os.ftruncate(fd, size)
    return fd, map_fd(fd, size)


class Ring:
    """A mapped ring: control words, segment states and the data bytes."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.words = np.frombuffer(mm, dtype=np.int64, count=4)
        self.states = np.frombuffer(mm, dtype=np.uint8, count=MAX_SEGMENTS, offset=STATES)
        self.data = torch.frombuffer(mm, dtype=torch.uint8, offset=CTRL_BYTES, count=RING_BYTES)


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
