"""The one-to-many shared-memory fan-out, in one process (both ends of each link)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from rlcomm.comm.transports import shm_fanout
from rlcomm.comm.transports.shm_fanout import FanoutSource, payload_offsets
from rlcomm.comm.transports.shm_fanout_sink import FanoutSink
from rlcomm.errors import AuthenticationError, CommTimeoutError, PeerLostError

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd")


def _linked(n: int) -> tuple[FanoutSource, list[FanoutSink]]:
    source = FanoutSource({m: os.getpid() for m in range(1, n + 1)}, "test fan-out")
    deadline = time.monotonic() + 5
    accepting = threading.Thread(target=source.accept, args=(deadline,))
    accepting.start()  # the source's side of the set-up (another process in real use)
    sinks = [FanoutSink(source.name, m, os.getpid(), deadline, f"sink {m}") for m in range(1, n + 1)]
    accepting.join()
    assert source.missing() == []
    return source, sinks


def _payload(i: int) -> list[torch.Tensor]:
    return [torch.full((1 << 18,), i, dtype=torch.uint8), torch.arange(100, dtype=torch.uint8)]


def test_every_receiver_gets_views_of_one_slot():
    source, sinks = _linked(3)
    try:
        payload = _payload(7)
        assert source.publish(0, b"frame", payload, time.monotonic() + 5) == {}
        sizes = [t.numel() for t in payload]
        views = []
        for sink in sinks:
            msg = sink.recv(time.monotonic() + 5)
            assert msg.seq == 0 and msg.frame == b"frame"
            got = msg.payload(sizes)
            assert [torch.equal(g, p) for g, p in zip(got, payload)] == [True, True]
            views.append(got)
        assert len(source.slots) == 1
        # Copy-on-write: one receiver's write is its own.
        views[0][0][:10] = 1
        assert int(views[1][0][:10].sum()) == 70 and int(views[0][0][:10].sum()) == 10
        assert int(source.slots[0].tensor[payload_offsets(5, sizes)[0][0]]) == 7
    finally:
        source.close()
        for sink in sinks:
            sink.close()


def test_slot_is_reused_once_every_receiver_dropped_its_views():
    source, sinks = _linked(2)
    sizes = [t.numel() for t in _payload(0)]
    try:
        held = []
        for i in range(20):
            assert source.publish(i, b"f", _payload(i), time.monotonic() + 5) == {}
            for sink in sinks:
                got = sink.recv(time.monotonic() + 5).payload(sizes)
                assert int(got[0][0]) == i
                if i < 2:
                    held.append(got)  # the first two stay held: two slots pinned
                del got
        assert len(source.slots) == 3, [s.size for s in source.slots]
        held.clear()
        for i in range(20, 25):
            source.publish(i, b"f", _payload(i), time.monotonic() + 5)
            for sink in sinks:
                sink.recv(time.monotonic() + 5)
        assert len(source.slots) == 3
    finally:
        source.close()
        for sink in sinks:
            sink.close()


def test_small_message_rides_in_the_datagram():
    source, sinks = _linked(1)
    try:
        assert source.publish(3, b"x" * 1000, [], time.monotonic() + 5) == {}
        msg = sinks[0].recv(time.monotonic() + 5)
        assert (msg.seq, msg.frame, msg.segment) == (3, b"x" * 1000, None)
        assert source.slots == []
    finally:
        source.close()
        sinks[0].close()


def test_gone_receiver_frees_its_slots_and_is_reported():
    source, sinks = _linked(2)
    sizes = [t.numel() for t in _payload(0)]
    try:
        source.publish(0, b"f", _payload(0), time.monotonic() + 5)
        kept = sinks[0].recv(time.monotonic() + 5).payload(sizes)
        sinks[1].recv(time.monotonic() + 5)
        sinks[0].close()  # as if its process died, holding views
        failures = source.publish(1, b"f", _payload(1), time.monotonic() + 5)
        assert list(failures) == [1] and isinstance(failures[1], PeerLostError)
        assert int(sinks[1].recv(time.monotonic() + 5).payload(sizes)[0][0]) == 1
        assert len(source.slots) == 1  # the dead receiver's hold does not pin the slot
        del kept
    finally:
        source.close()
        sinks[1].close()


def test_waits_are_bounded():
    source, sinks = _linked(1)
    try:
        start = time.monotonic()
        with pytest.raises(CommTimeoutError):
            sinks[0].recv(time.monotonic() + 0.2)
        assert time.monotonic() - start < 2
    finally:
        source.close()
        sinks[0].close()
    with pytest.raises(PeerLostError):
        sinks[0].recv(time.monotonic() + 1)


def test_source_closed_is_peer_lost():
    source, sinks = _linked(1)
    source.close()
    with pytest.raises(PeerLostError):
        sinks[0].recv(time.monotonic() + 2)
    sinks[0].close()


def test_wrong_process_is_refused():
    source = FanoutSource({1: os.getpid() + 1_000_000}, "test fan-out")
    try:
        deadline = time.monotonic() + 2
        accepting = threading.Thread(target=source.accept, args=(time.monotonic() + 0.5,))
        accepting.start()
        with pytest.raises((CommTimeoutError, PeerLostError)):
            FanoutSink(source.name, 1, os.getpid(), deadline, "sink")
        accepting.join()
        assert source.missing() == [1]
        with pytest.raises(AuthenticationError):
            FanoutSink(source.name, 1, os.getpid() + 1_000_000, deadline, "sink")
    finally:
        source.close()


def test_declared_payload_past_the_slot_is_refused():
    source, sinks = _linked(1)
    try:
        source.publish(0, b"f", _payload(0), time.monotonic() + 5)
        msg = sinks[0].recv(time.monotonic() + 5)
        with pytest.raises(PeerLostError):
            msg.payload([msg.segment.numel()])
    finally:
        source.close()
        sinks[0].close()


def test_a_free_slot_too_small_is_replaced_when_the_pool_is_full(monkeypatch):
    monkeypatch.setattr(shm_fanout, "MAX_SLOTS", 1)
    source, sinks = _linked(1)
    try:
        for i, numel in enumerate([1 << 10, 3 << 20, 1 << 10]):
            payload = [torch.full((numel,), i, dtype=torch.uint8)]
            assert source.publish(i, b"f", payload, time.monotonic() + 5) == {}
            got = sinks[0].recv(time.monotonic() + 5).payload([numel])
            assert torch.equal(got[0], payload[0])
            del got
        assert len(source.slots) == 1 and source.slots[0].size >= 3 << 20
    finally:
        source.close()
        sinks[0].close()
