"""The host side of the GPU bench's hand-off floor (``scripts/_handoff.py``), on CPU: two
threads hand numbered payloads through slots in shared memory as the floor's two
processes do, run after run, the receiver started before the sender."""

from __future__ import annotations

import os
import sys
import threading
import time
from multiprocessing import shared_memory

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _handoff import NBYTES, HandOff, HandOffStalled  # noqa: E402

SLOTS = 8


@pytest.fixture
def memory():
    flags = shared_memory.SharedMemory(create=True, size=NBYTES)
    slots = shared_memory.SharedMemory(create=True, size=SLOTS * 8)
    try:
        yield flags, slots
    finally:
        for shm in (flags, slots):
            shm.close()
            shm.unlink()


def _sender(flags, slots, run: int, iters: int, depth: int, late: float) -> None:
    side = HandOff(flags.buf, timeout=10)
    payload = np.ndarray((SLOTS,), dtype=np.int64, buffer=slots.buf)
    time.sleep(late)  # the receiver of this run is already spinning (on stale counts)
    side.start_sending(run)
    for i in range(iters):
        side.wait_room(i, depth)
        payload[i % SLOTS] = run * 1_000_000 + i  # what the copy into slot k writes
        side.sent(i)
    side.wait_finished(iters)


def _receiver(flags, slots, run: int, iters: int, seen: list[int]) -> None:
    side = HandOff(flags.buf, timeout=10)
    payload = np.ndarray((SLOTS,), dtype=np.int64, buffer=slots.buf)
    side.start_receiving(run)
    for i in range(iters):
        side.wait_sent(i)
        seen.append(int(payload[i % SLOTS]))  # what the copy out of slot k reads
        side.taken(i)
    side.finish(iters)


@pytest.mark.parametrize("depth", [1, SLOTS], ids=["ping-pong", "streamed"])
def test_each_run_hands_over_its_own_payloads_in_order(memory, depth):
    flags, slots = memory
    # Runs of different lengths back to back, each receiver started first: the counts
    # the last run left must not count for the next one.
    for run, iters in ((1, 60), (2, 10), (3, 60), (4, 3)):
        seen: list[int] = []
        receiver = threading.Thread(target=_receiver, args=(flags, slots, run, iters, seen))
        receiver.start()
        _sender(flags, slots, run, iters, depth, late=0.05)
        receiver.join(timeout=10)
        assert not receiver.is_alive()
        assert seen == [run * 1_000_000 + i for i in range(iters)]


def test_a_side_whose_peer_does_not_move_stops_with_the_counts(memory):
    flags, _ = memory
    side = HandOff(flags.buf, timeout=0.2)
    with pytest.raises(HandOffStalled, match="the start of run 7 did not happen"):
        side.start_receiving(7)
    side.start_sending(8)
    side.sent(0)
    with pytest.raises(HandOffStalled, match=r"room for message 1 .*run 8, sent 1, taken 0"):
        side.wait_room(1, 1)
