"""Relayed segments: a forwarding process passes a peer's segment on instead of copying it.

Real shared-memory transports, three ends: producer -> relay -> consumer, each pair a
real connection (memfds, rings, signal sockets), the ends on threads of this process
with relaying switched on for it."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from rlcomm.comm.transports import shm_memory, shm_relay
from rlcomm.comm.transports.shm_memory import FIRST_RELAY_SLOT, MAX_SEGMENTS, new_memfd
from rlcomm.errors import ProtocolMismatchError
from tests.comm.pairs import transport_pair, two_stores
from tests.waiting import wait_for

N = 1 << 20


@pytest.fixture
def chain(monkeypatch):
    monkeypatch.setattr(shm_relay, "_enabled", True)
    p2r = transport_pair(two_stores(), "p2r")
    r2c = transport_pair(two_stores(), "r2c")
    yield p2r[0], p2r[1], r2c[0], r2c[1]
    for end in (*p2r, *r2c):
        end.close()


def _bytes(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (N,), dtype=torch.uint8, generator=g)


def _hop(src, dst, tensor: torch.Tensor) -> torch.Tensor:
    src.send_frame(b"f", [tensor], 30)
    assert dst.recv_frame(30) == b"f"
    (got,) = dst.recv_new([tensor.numel()], 30)
    return got


def test_a_forwarded_payload_is_the_producers_segment_not_a_copy(chain):
    producer, relay_in, relay_out, consumer = chain
    x = _bytes(1)
    held = _hop(producer, relay_in, x)
    got = _hop(relay_out, consumer, held)
    assert torch.equal(got, x)
    assert relay_out._pool.segments == []  # the relay copied into none of its own
    # Same pages: what the producer's segment holds now shows in the consumer's view.
    producer._pool.segments[0].tensor[:4] = torch.tensor([7, 7, 7, 7], dtype=torch.uint8)
    assert got[:4].tolist() == [7, 7, 7, 7]
    # The producer's segment stays in flight until the consumer lets its view go.
    del held
    gc.collect()
    assert producer._out.states[0] == 1
    del got
    wait_for(lambda: gc.collect() >= 0 and producer._out.states[0] == 0,
             "the producer's segment came back", 5)


def test_the_next_payload_reuses_the_slot_without_a_new_mapping(chain):
    producer, relay_in, relay_out, consumer = chain
    ids = []
    for seed in range(5):
        x = _bytes(seed)
        got = _hop(relay_out, consumer, _hop(producer, relay_in, x))
        assert torch.equal(got, x)
        ids.append(dict(consumer._segments.relayed))
        del got
        gc.collect()
        wait_for(lambda: gc.collect() >= 0 and producer._out.states[0] == 0, "segment back",
                 5)
    assert len(producer._pool.segments) == 1  # one segment, going round
    assert all(i == ids[0] for i in ids)  # one relay slot, one mapping, passed once
    assert relay_out._pool.segments == []


def test_a_consumer_that_keeps_views_gets_copies_past_its_pin_limit(chain):
    producer, relay_in, relay_out, consumer = chain
    kept = []
    limit = consumer._pin_limit
    for seed in range(limit + 8):
        x = _bytes(seed)
        got = _hop(relay_out, consumer, _hop(producer, relay_in, x))
        assert torch.equal(got, x)
        kept.append(got)
    # Relayed views count toward the consumer's pin limit like the relay's own segments:
    # past it, payloads are copied out and their slots (and producer segments) released.
    wait_for(lambda: gc.collect() >= 0 and consumer._pinned() <= limit + 1,
             "copies past the pin limit", 5)
    assert torch.equal(kept[-1], _bytes(limit + 7))
    assert all(torch.equal(t, _bytes(seed)) for seed, t in enumerate(kept))
    kept.clear()
    wait_for(lambda: gc.collect() >= 0 and not producer._out.states.any(),
             "every producer segment back", 5)


def test_relayed_segments_only_in_relay_slots_and_never_past_a_memfds_end(chain):
    consumer = chain[3]
    fd, _ = new_memfd("t", N)
    try:
        with pytest.raises(ProtocolMismatchError, match="relayed"):  # a slot of its own
            consumer._segments.map(3 * MAX_SEGMENTS + 5, N, os.dup(fd), "test")
        with pytest.raises(ProtocolMismatchError, match="relayed"):  # larger than the file
            consumer._segments.map(3 * MAX_SEGMENTS + FIRST_RELAY_SLOT, 2 * N,
                                       os.dup(fd), "test")
    finally:
        os.close(fd)


def test_without_relaying_a_forward_is_a_copy(monkeypatch):
    monkeypatch.setattr(shm_relay, "_enabled", False)
    ends = [*transport_pair(two_stores(), "a"), *transport_pair(two_stores(), "b")]
    try:
        producer, relay_in, relay_out, consumer = ends
        x = _bytes(9)
        got = _hop(relay_out, consumer, _hop(producer, relay_in, x))
        assert torch.equal(got, x)
        assert len(relay_out._pool.segments) == 1  # copied into the relay's own segment
        assert shm_memory.SEGMENT_THRESHOLD <= N
    finally:
        for end in ends:
            end.close()
