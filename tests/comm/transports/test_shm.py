"""The shared-memory transport alone: two ends in one process (threads), a real store."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import threading
import time

import numpy as np
import pytest
import torch

from rlcomm.comm.store.client import StoreClient
from rlcomm.comm.store.server import StoreServer
from rlcomm.comm.transports import shm, shm_memory
from rlcomm.comm.transports.shm import ShmTransport
from rlcomm.errors import CommTimeoutError, PeerLostError
from tests.comm.pairs import transport_pair, two_stores
from tests.waiting import wait_for


@pytest.fixture
def pair():
    ends = transport_pair(two_stores(), "t")
    yield ends
    for end in ends:
        end.close()


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_sizes_across_ring_and_segments(pair):
    a, b = pair
    sizes = [0, 1, 17, 4096, shm_memory.SEGMENT_THRESHOLD - 1, shm_memory.SEGMENT_THRESHOLD, 3 << 20,
             shm_memory.RING_BYTES + 12345]
    sent = [_bytes(n, i) for i, n in enumerate(sizes)]
    # The sender runs ahead in a thread: ring-full waits and wrap-around get exercised.
    sender = threading.Thread(target=lambda: [a.send([t], 30) for t in sent])
    sender.start()
    for t in sent:
        got = torch.empty_like(t)
        b.recv_into([got], 30)
        assert torch.equal(got, t)
    sender.join(timeout=30)


def test_strided_payloads_are_copied_as_their_elements_not_their_memory(pair):
    """The ring copies a payload by address; one that is not contiguous (no sender of
    rlcomm's makes one) goes and lands element by element all the same."""
    a, b = pair
    base = _bytes(3 * 8192, 7)
    sent = base[::3]  # every third byte: 8192 bytes, strided
    into = torch.zeros(2 * 8192, dtype=torch.uint8)
    a.send([sent], 30)
    b.recv_into([into[::2]], 30)
    assert torch.equal(into[::2], sent) and not into[1::2].any()


def test_frames_and_many_small_messages_wrap_the_ring(pair):
    a, b = pair
    n = (shm_memory.RING_BYTES // 1000) * 3

    def send_all():
        for i in range(n):
            a.send_frame(f"frame {i}".encode() * 50, [_bytes(100, i)], 30)

    t = threading.Thread(target=send_all)
    t.start()
    for i in range(n):
        assert b.recv_frame(30) == f"frame {i}".encode() * 50
        (payload,) = b.recv_new([100], 30)
        assert torch.equal(payload, _bytes(100, i))
    t.join(timeout=30)


#: The ways a small frame is put into the ring and taken from it: the C helper's one call
#: each (where the optional module is built), or the same steps in Python.
WAYS = [
    pytest.param("c", id="c", marks=pytest.mark.skipif(
        shm._ring_put is None, reason="the optional C module is not built")),
    pytest.param("python", id="python"),
]


def _way(monkeypatch, way: str) -> None:
    if way == "python":
        monkeypatch.setattr(shm, "_ring_put", None)
        monkeypatch.setattr(shm, "_ring_take", None)


@pytest.mark.parametrize("way", WAYS)
def test_small_frames_written_in_place_wrap_the_ring_and_wait_when_it_is_full(
        pair, way, monkeypatch):
    _way(monkeypatch, way)
    a, b = pair
    # Frames of odd lengths, so that one ends up straddling the ring's end (written the
    # general way) and the ring fills before the reader starts.
    frames = [bytes([i % 251]) * (1000 + i % 97) for i in range(shm_memory.RING_BYTES // 500)]
    sent = threading.Event()

    def send_all():
        for frame in frames:
            a.send_small(frame, 30)
        sent.set()

    t = threading.Thread(target=send_all)
    t.start()
    wait_for(lambda: b.available() > shm_memory.RING_BYTES - 1100, "the ring to fill")
    assert not sent.is_set()  # the sender waits for room, nothing overwritten
    for frame in frames:
        assert b.recv_frame(30) == frame
    t.join(timeout=30)
    assert sent.is_set() and b.available() == 0


def test_zero_copy_views_return_segments_to_the_pool(pair):
    a, b = pair
    n = 2 << 20
    a.send([_bytes(n, 1)], 10)
    (view,) = b.recv_new([n], 10)
    assert torch.equal(view, _bytes(n, 1))
    seg_id = next(s.id for s in a._pool.segments if a._out.states[s.id])
    # Held by the receiver: the sender must not reuse it.
    a.send([_bytes(n, 2)], 10)
    (second,) = b.recv_new([n], 10)
    assert torch.equal(view, _bytes(n, 1)) and torch.equal(second, _bytes(n, 2))
    del view
    gc.collect()
    assert a._out.states[seg_id] == 0
    pool_before = len(a._pool.segments)
    a.send([_bytes(n, 3)], 10)
    (third,) = b.recv_new([n], 10)
    assert torch.equal(third, _bytes(n, 3)) and len(a._pool.segments) == pool_before


def test_receiver_holding_many_views_gets_copies_and_leaves_the_sender_segments(pair):
    a, b = pair
    n = 1 << 20
    held = []
    for i in range(shm._MAX_IN_FLIGHT + 3):
        a.send([_bytes(n, i)], 10)
        held.extend(b.recv_new([n], 10))
    # The first _PIN_LIMIT payloads are views of the sender's segments; later ones are
    # copies (their segments went back at once), so the sender's pool stops growing.
    views = [t for t in held if any(
        t.data_ptr() == np.frombuffer(seg.mm, dtype=np.uint8).ctypes.data
        for seg in b._segments.by_id.values())]
    assert len(views) == shm._PIN_LIMIT
    assert b._pinned() == shm._PIN_LIMIT
    assert len(a._pool.segments) == shm._PIN_LIMIT + 1
    for i, t in enumerate(held):
        assert torch.equal(t, _bytes(n, i))
    del views, held, t
    gc.collect()
    assert b._pinned() == 0


def test_sender_far_ahead_streams_through_the_ring(pair):
    a, b = pair
    n = 1 << 20
    count = shm._MAX_IN_FLIGHT + 5
    sender = threading.Thread(target=lambda: [a.send([_bytes(n, i)], 30) for i in range(count)])
    sender.start()
    sender.join(timeout=30)  # the ring (8 MiB) takes what the segments do not
    assert not sender.is_alive()
    assert len(a._pool.segments) == shm._MAX_IN_FLIGHT
    for i in range(count):
        got = torch.empty(n, dtype=torch.uint8)
        b.recv_into([got], 10)
        assert torch.equal(got, _bytes(n, i))


def test_recv_timeout_and_peer_close(pair):
    a, b = pair
    start = time.monotonic()
    with pytest.raises(CommTimeoutError):
        b.recv_into([torch.empty(4, dtype=torch.uint8)], 0.3)
    assert time.monotonic() - start < 3
    a.close()
    with pytest.raises(PeerLostError):
        b.recv_into([torch.empty(4, dtype=torch.uint8)], 5)


def test_poll_waits_for_a_frame_and_ends_on_the_wake_fd(pair):
    a, b = pair
    assert b.poll(0.05) is False  # nothing sent: a timeout, nothing consumed
    a.send_frame(b"hello", [], 5)
    assert b.poll(1) is True
    assert b.recv_frame(1) == b"hello"
    wake_r, wake_w = os.pipe()
    try:
        threading.Timer(0.2, os.write, (wake_w, b"w")).start()
        start = time.monotonic()
        assert b.poll(10, wake_r) is False
        assert 0.1 < time.monotonic() - start < 5
    finally:
        os.close(wake_r)
        os.close(wake_w)


#: The secret of the exchange's store (a server of this test, clients in its processes).
_SECRET = b"ping-pong-test-secret"


def _ping_pong_end(rank: int, port: int, count: int, ways: list[str], out: mp.Queue) -> None:
    """One end of two-process exchanges with irregular pauses (see the test), one per way
    in ``ways``, in order, each on a transport of its own: frames sent the general way
    (``"frame"``) or as small messages (``"c"``, ``"python"``: :data:`WAYS`; the Python
    way turns the C calls off for the rest of this process, so it comes last)."""
    client = StoreClient("127.0.0.1", port, _SECRET, 30)
    for way in ways:
        end = ShmTransport(client.prefixed(f"pp-{way}"), rank, 30, f"end{1 - rank}")
        if way == "python":
            shm._ring_put = shm._ring_take = None
        send = ((lambda f, end=end: end.send_frame(f, [], 10)) if way == "frame" else
                (lambda f, end=end: end.send_small(f, 10)))
        rng = random.Random(rank)
        try:
            for i in range(count):
                if rank == 0:
                    send(i.to_bytes(4, "little"))
                    got = end.recv_frame(10)
                else:
                    got = end.recv_frame(10)
                    # Pauses around the spin length: the receiver alternates between
                    # catching the frame while spinning and sleeping on its flag.
                    time.sleep(rng.choice((0, 0, 0.00005, 0.0003, 0.002)))
                    send(got)
                if int.from_bytes(got, "little") != i:
                    raise AssertionError(f"{way}: frame {i} came back as {got!r}")
            out.put((rank, way, "ok"))
        except BaseException as exc:  # reported to the test
            out.put((rank, way, repr(exc)))
            return
        finally:
            end.close()


@pytest.mark.timeout(120)
def test_two_processes_never_miss_a_wake_up():
    """The sender sends a wake-up token only while the receiver's sleeping flag is set;
    two real processes exchanging with irregular pauses must never stall (a missed
    token would show as a 10 s timeout): frames sent the general way, and small frames
    put and taken by the C calls and by the Python steps (the two processes run the
    three exchanges in turn)."""
    ways = ["frame", *(["c"] if shm._ring_put is not None else []), "python"]
    server = StoreServer("127.0.0.1", _SECRET)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    count = 1500
    procs = [ctx.Process(target=_ping_pong_end, args=(r, server.port, count, ways, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[tuple[int, str], str] = {}
    try:
        while len(results) < 2 * len(ways) and not any(v != "ok" for v in results.values()):
            rank, way, result = out.get(timeout=100)
            results[rank, way] = result
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        server.close()
    assert results == {(r, w): "ok" for r in (0, 1) for w in ways}


# -- pacing: a sender with most of its segments in flight waits a moment for its receiver
# (SegmentPool.pace). It goes on as soon as the receiver gives a segment back, and a
# receiver that gives none back costs it one bounded wait, not one per message.

MIB = 1 << 20
PACE_AT = int(shm._MAX_IN_FLIGHT * shm_memory.PACE_SHARE)


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
    monkeypatch.setattr(shm_memory, "PACE_OFF_SECONDS", 30.0)  # "soon" even on a slow machine
    a, b = pair
    _fill(a)
    t = time.monotonic()
    _send(a, PACE_AT)
    assert time.monotonic() - t >= 0.3  # it waited, then went on
    assert a._pool.paced == [0, 1]
    for i in range(PACE_AT + 1, PACE_AT + 4):
        _send(a, i)
    assert a._pool.paced == [0, 1]  # no wait again so soon
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
    wait_for(lambda: a._pool.pacing, "the sender waits in pace()", 10)
    assert not sent  # waiting: PACE_AT segments are in flight
    released = time.monotonic()
    for i in range(4):  # read and drop four: their segments go back
        assert b.recv_frame(10) == f"m{i}".encode()
        (got,) = b.recv_new([MIB], 10)
        del got
    sender.join(timeout=20)
    assert sent and sent[0] >= released
    assert a._pool.paced == [1, 0]
