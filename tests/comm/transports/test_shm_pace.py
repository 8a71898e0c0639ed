"""A shared-memory sender with most of its segments in flight waits a moment for its
receiver (``SegmentPool.pace``), on a real transport pair: it goes on as soon as the
receiver gives a segment back, and a receiver that gives none back costs it one bounded
wait, not one per message."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlcomm.comm.transports import shm, shm_memory
from tests.comm.pairs import transport_pair, two_stores

MIB = 1 << 20
PACE_AT = int(shm._MAX_IN_FLIGHT * shm_memory.PACE_SHARE)


@pytest.fixture
def pair():
    ends = transport_pair(two_stores(), "pace")
    yield ends
    for end in ends:
        end.close()


def _send(end, i: int) -> None:
    end.send_frame(f"m{i}".encode(), [torch.full((MIB,), i % 251, dtype=torch.uint8)], 30)


def _fill(a) -> None:
    """Put PACE_AT messages with a segment each in flight (nobody reads them yet)."""
    for i in range(PACE_AT):
        _send(a, i)
    assert a._pool.paced == [0, 0]


@pytest.mark.timeout(60)
def test_a_receiver_that_keeps_its_segments_costs_one_bounded_wait(pair, monkeypatch):
    monkeypatch.setattr(shm_memory, "PACE_SECONDS", 0.3)
    a, b = pair
    _fill(a)
    t = time.monotonic()
    _send(a, PACE_AT)
    assert time.monotonic() - t >= 0.3  # it waited, then went on
    assert a._pool.paced == [0, 1]
    t = time.monotonic()
    for i in range(PACE_AT + 1, PACE_AT + 4):
        _send(a, i)
    assert time.monotonic() - t < 0.3  # no wait again so soon
    assert a._pool.paced == [0, 1]
    for i in range(PACE_AT + 4):  # everything arrives, in order
        assert b.recv_frame(10) == f"m{i}".encode()
        (got,) = b.recv_new([MIB], 10)
        assert bool((got == i % 251).all())
        del got


@pytest.mark.timeout(60)
def test_a_paced_sender_goes_on_once_the_receiver_gives_segments_back(pair, monkeypatch):
    monkeypatch.setattr(shm_memory, "PACE_SECONDS", 30.0)  # only a give-back ends it
    a, b = pair
    _fill(a)
    sent = []
    sender = threading.Thread(target=lambda: (_send(a, PACE_AT), sent.append(time.monotonic())))
    sender.start()
    time.sleep(0.2)
    assert not sent  # waiting: PACE_AT segments are in flight
    released = time.monotonic()
    for i in range(4):  # read and drop four: their segments go back
        assert b.recv_frame(10) == f"m{i}".encode()
        (got,) = b.recv_new([MIB], 10)
        del got
    sender.join(timeout=20)
    assert sent and sent[0] >= released
    assert a._pool.paced == [1, 0]
