"""``Connection`` over a real transport pair in one process: who reads the stream (a
waiting receive op, the receiver thread, a pump) and the listener mode. Every test runs
over shared memory and over the loopback-TCP transport of the registry's proof
(:mod:`tests.comm.tcp_loopback`)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from rlcomm.comm import codec
from rlcomm.comm.connection import Connection, Lease, Life
from rlcomm.comm.transports.shm import SHM_SUPPORTED, ShmTransport
from rlcomm.errors import PeerLostError
from tests.comm.pairs import connection_pair, receive, send, send_past_the_ring, two_stores
from tests.comm.tcp_loopback import TcpLoopbackTransport
from tests.waiting import wait_for

KINDS = [
    pytest.param(ShmTransport, id="shm", marks=pytest.mark.skipif(
        not SHM_SUPPORTED, reason="shared memory needs x86-64 Linux")),
    pytest.param(TcpLoopbackTransport, id="tcp_loopback"),
]


@pytest.fixture(params=KINDS)
def conns(request):
    """An attached connection pair over each transport: (rank 0 end, rank 1 end)."""
    a, b = connection_pair(two_stores(), "c", request.param)
    yield a, b
    a.close()
    b.close()


def test_receive_ops_and_the_receiver_thread_share_the_stream(conns):
    a, b = conns
    for i in range(200):  # ping-pong: each receive op reads its own message
        send(a, torch.tensor([i]))
        send(b, receive(b) + 1)
        assert int(receive(a)) == i + 1
    # Nobody receives: the receiver thread takes the stream back and buffers, so sends
    # of more than the ring holds (8 MiB) complete.
    send_past_the_ring(a, b, torch.ones(100 << 10, dtype=torch.uint8), 120)


def test_concurrent_receivers_get_every_message_once_in_ticket_order(conns):
    a, b = conns
    results: dict[int, object] = {}
    tickets = [b.take_ticket() for _ in range(300)]

    def receive(chunk: list[int]) -> None:
        for t in chunk:
            results[t] = b.recv_object(t, 20, None)

    threads = [threading.Thread(target=receive, args=(tickets[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for i in range(300):
        send(a, i)
    for t in threads:
        t.join(timeout=30)
    assert [results[t] for t in tickets] == list(range(300))


def test_send_tensor_payload_is_read_by_the_receive_op(conns):
    a, b = conns
    src = torch.arange(300_000, dtype=torch.float32)  # past the segment threshold
    header, tensors = codec.encode_raw(src)
    a.send_inline(header, tensors, 10)
    send(a, "after")
    dst = torch.empty_like(src)
    b.recv_tensor_into(b.take_ticket(), dst, 10)
    assert torch.equal(dst, src)
    assert receive(b) == "after"


def test_a_pump_dispatches_its_own_reply_on_its_thread(conns):
    a, b = conns
    seen: list[tuple[object, int]] = []
    waiting: dict[object, concurrent.futures.Future] = {}

    def on_message(obj) -> None:
        seen.append((obj, threading.get_ident()))
        fut = waiting.pop(obj, None)
        if fut is not None:
            fut.set_result(obj)

    b.listen(on_message, lambda exc: None)
    with pytest.raises(RuntimeError, match="listened"):
        b.recv_object(b.take_ticket(), 1, None)
    me = threading.get_ident()

    def reply_once_pumping(i: int) -> None:
        # The reply leaves once the pump holds the stream (the receiver thread, if it
        # held it, has left it to the pump): the pump must read it itself.
        wait_for(lambda: b.reader.lease is Lease.CALLER, "the state", 10, interval=0.0005)
        send(a, i)

    for i in range(50):
        fut = waiting[i] = concurrent.futures.Future()
        replier = threading.Thread(target=reply_once_pumping, args=(i,))
        replier.start()
        assert b.pump(fut, 10, lambda: False)
        replier.join(timeout=10)
        assert fut.result(0) == i
    assert [obj for obj, _ in seen] == list(range(50))
    # Every reply was read on the pumping thread: no hand-off.
    assert all(ident == me for _, ident in seen)
    # With no pump running, the receiver thread dispatches.
    send(a, "background")
    wait_for(lambda: len(seen) == 51, "the state", 10, interval=0.0005)
    assert seen[-1][0] == "background" and seen[-1][1] != me


def test_a_pump_ends_when_its_future_is_done_elsewhere(conns):
    a, b = conns
    b.listen(lambda obj: None, lambda exc: None)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    threading.Timer(0.2, fut.set_result, (1,)).start()
    start = time.monotonic()
    assert b.pump(fut, 20, lambda: False)
    assert time.monotonic() - start < 5
    assert not b.pump(concurrent.futures.Future(), 0.2, lambda: False)  # a timeout


def test_a_lost_peer_reaches_the_listener_and_ends_the_pump(conns):
    a, b = conns
    fut: concurrent.futures.Future = concurrent.futures.Future()
    errors: list[Exception] = []

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        fut.set_exception(exc)

    b.listen(lambda obj: None, on_error)
    threading.Timer(0.2, a.close).start()
    assert b.pump(fut, 20, lambda: False)
    assert isinstance(errors[0], PeerLostError) and len(errors) == 1


def test_a_connection_says_where_it_is_in_its_life():
    a, b = connection_pair(two_stores(), "life")
    pending = Connection("nobody")
    assert pending.life is Life.PENDING
    assert a.life is Life.ATTACHED and b.life is Life.ATTACHED
    a.close()
    assert a.life is Life.CLOSED
    # its reader saw the peer's end close
    wait_for(lambda: b.life is Life.FAILED, "the state", 10, interval=0.0005)
    assert isinstance(b.error, PeerLostError)
    b.close()
    pending.fail(PeerLostError("gone"))
    assert pending.life is Life.FAILED
