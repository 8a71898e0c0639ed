"""The three parts of a connection, each alone: the inbox (pure), the sender and the
reader, each over one end of a real in-process transport pair whose other end the test
drives by hand. Over shared memory and over the registry proof's loopback TCP."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.connection import Inbox, Incoming, Lease, Reader, incoming
from rlcomm.comm.connection.incoming import read_message
from rlcomm.comm.connection.receiver import start_receiver_thread
from rlcomm.comm.connection.sender import Sender
from rlcomm.comm.transports.shm import SHM_SUPPORTED, ShmTransport
from rlcomm.errors import CommError, CommTimeoutError
from tests.comm.pairs import transport_pair, two_stores
from tests.comm.tcp_loopback import TcpLoopbackTransport
from tests.waiting import wait_for

KINDS = [
    pytest.param(ShmTransport, id="shm", marks=pytest.mark.skipif(
        not SHM_SUPPORTED, reason="shared memory needs x86-64 Linux")),
    pytest.param(TcpLoopbackTransport, id="tcp_loopback"),
]


@pytest.fixture(params=KINDS)
def ends(request):
    a, b = transport_pair(two_stores(), "parts", request.param)
    yield a, b
    a.close()
    b.close()


def _msg(nbytes: int) -> Incoming:
    msg = Incoming(codec.encode(b"")[0], b"x" * nbytes)
    return msg


def _send(transport, obj) -> None:
    """Send ``obj`` as a connection would, straight on ``transport``."""
    header, tensors = codec.encode(obj)
    frame, payload = framing.pack(header, tensors)
    transport.send_frame(frame, payload, 10)


def _no_cuda(device, timeout):
    raise AssertionError("no CUDA here")


# -- the inbox -------------------------------------------------------------------------------------


def test_the_inbox_counts_unread_bytes_against_its_cap():
    inbox = Inbox(max_unread=100)
    assert not inbox and not inbox.full
    inbox.put(_msg(60))
    assert not inbox.full
    inbox.put(_msg(60))
    assert inbox.full and len(inbox) == 2 and inbox.unread == 120
    assert inbox.peek().nbytes == 60
    assert inbox.take()  # 60 left: under the cap again, the driver may read on
    assert not inbox.take()  # it was not full
    assert not inbox and inbox.unread == 0


# -- the sender ------------------------------------------------------------------------------------


def test_the_sender_keeps_call_order_across_queued_and_inline_sends(ends):
    a, b = ends
    failures: list[CommError] = []
    sender = Sender("b", lambda timeout: a, types.SimpleNamespace(error=None), failures.append,
                    _no_cuda)
    sender.transport = a
    futures = [sender.submit(*codec.encode(i), 10) for i in range(20)]
    sender.send_inline(*codec.encode("inline"), 10)  # behind the queued ones
    got = []
    for _ in range(21):
        msg = read_message(b, "a")
        got.append(codec.decode(msg.header, msg.tensors))
    assert got == [*range(20), "inline"]
    assert all(f.done() and f.exception() is None for f in futures)
    assert not failures
    sender.close()


def test_a_one_frame_send_goes_now_or_leaves_the_queue_its_turn(ends):
    a, b = ends
    sender = Sender("b", lambda timeout: a, types.SimpleNamespace(error=None), lambda e: None,
                    _no_cuda)
    sender.transport = a
    assert sender.send_small(framing.small_frame(b"now"), 10)
    assert codec.decode(*_parts(read_message(b, "a"))) == b"now"
    go = threading.Event()
    queued = sender.submit(*codec.encode("queued"), 10, before=lambda: go.wait(10))
    assert sender.queued == 1
    # Behind a queued send it sends nothing: the caller goes the general way.
    assert not sender.send_small(framing.small_frame(b"later"), 10)
    assert not b.poll(0)
    go.set()
    queued.result(timeout=10)
    assert sender.queued == 0
    assert codec.decode(*_parts(read_message(b, "a"))) == "queued"
    sender.close()


def _parts(msg: Incoming):
    return msg.header, msg.tensors


def test_the_sender_refuses_to_send_on_a_failed_connection(ends):
    a, _ = ends
    lost = CommError("gone")
    sender = Sender("b", lambda timeout: a, types.SimpleNamespace(error=lost), lambda e: None,
                    _no_cuda)
    with pytest.raises(CommError, match="gone"):
        sender.send_inline(*codec.encode(1), 10)
    sender.close()


# -- the reader ------------------------------------------------------------------------------------


def _reader(transport) -> tuple[Reader, list[CommError]]:
    failures: list[CommError] = []
    reader = Reader("a", failures.append, lambda timeout: transport, _no_cuda)
    reader.attach(transport)
    return reader, failures


def _receive(reader: Reader, timeout: float = 10):
    msg = reader.receive(reader.take_ticket(), timeout, lambda m: (True, m), "recv")
    return codec.decode(msg.header, msg.tensors)


def test_a_receive_op_reads_its_own_message_without_a_driver(ends):
    a, b = ends
    reader, failures = _reader(b)
    assert reader.pollable and reader.lease is Lease.IDLE
    for i in range(50):  # no receiver thread: the caller's fast path reads every one
        _send(a, i)
        assert _receive(reader) == i
    assert reader.lease is Lease.IDLE and not failures
    with pytest.raises(CommTimeoutError):
        _receive(reader, timeout=0.2)


def test_a_plain_receive_reads_its_own_message_in_one_turn_or_leaves_it_queued(ends):
    a, b = ends
    reader, failures = _reader(b)
    for i in range(20):
        _send(a, i)
        ticket, parts = reader.receive_own(time.monotonic() + 10, lambda m: True)
        assert codec.decode(*parts) == i and reader.lease is Lease.IDLE
    # One the op does not take as it is stays queued, for the general way with its ticket.
    _send(a, "general")
    ticket, parts = reader.receive_own(time.monotonic() + 10, lambda m: False)
    assert parts is None and reader.lease is Lease.IDLE
    assert codec.decode(*_parts(reader.receive(ticket, 10, lambda m: (True, m), "recv"))) \
        == "general"
    # (nothing comes: a deadline already past asks for the next ticket alone)
    assert reader.receive_own(time.monotonic(), lambda m: True)[0] == ticket + 1
    assert not failures


@pytest.mark.parametrize("obj", [b"four", torch.arange(3, dtype=torch.float32),
                                 {"w": torch.ones(2)}, ("a", 1)], ids=type)
def test_a_small_message_is_taken_from_its_frame_once_its_header_was_checked(
        ends, monkeypatch, obj):
    a, b = ends
    reader, failures = _reader(b)
    # No header known from an earlier test of this process, and room to keep new ones.
    for module, name in ((incoming, "_SMALL"), (framing, "_KNOWN"), (framing, "_KNOWN_IDS")):
        monkeypatch.setattr(module, name, {})
    checked = []
    classify = incoming.classify
    monkeypatch.setattr(incoming, "classify", lambda *args, **kw: checked.append(1) or
                        classify(*args, **kw))
    for _ in range(20):
        _send(a, obj)
        ticket, parts = reader.receive_own(time.monotonic() + 10, lambda m: True, small=True)
        got = codec.decode(*parts)
        assert type(got) is type(obj) and reader.lease is Lease.IDLE
        if isinstance(obj, dict):
            assert torch.equal(got["w"], obj["w"])
        else:
            assert torch.equal(got, obj) if isinstance(obj, torch.Tensor) else got == obj
    # Over shared memory, only the first message of this header was checked; a transport
    # that cannot hand a whole frame (TCP here) checks each one.
    assert len(checked) == (1 if isinstance(b, ShmTransport) else 20)
    # (nothing comes: a deadline already past asks for the next ticket alone)
    assert reader.receive_own(time.monotonic(), lambda m: True)[0] == ticket + 1
    assert not failures


@pytest.mark.skipif(not SHM_SUPPORTED, reason="shared memory needs x86-64 Linux")
def test_a_small_message_over_a_lowered_limit_or_cut_short_is_refused_as_before(monkeypatch):
    a, b = transport_pair(two_stores(), "parts", ShmTransport)
    try:
        reader, failures = _reader(b)
        for _ in range(2):  # its header is checked, and known
            _send(a, b"x" * 64)
            assert codec.decode(*reader.receive_own(time.monotonic() + 10, lambda m: True,
                                                    small=True)[1]) == b"x" * 64
        monkeypatch.setattr(incoming, "max_message_bytes", lambda: 63)
        _send(a, b"x" * 64)
        assert reader.receive_own(time.monotonic() + 10, lambda m: True, small=True)[1] is None
        assert len(failures) == 1 and "limit of 63" in str(failures[0])
    finally:
        monkeypatch.undo()
        a.close()
        b.close()
    a, b = transport_pair(two_stores(), "parts", ShmTransport)
    try:
        reader, failures = _reader(b)
        frame, _ = framing.pack(*codec.encode(b"x" * 64))
        for cut in (0, 1):  # the second frame lacks its last payload byte
            a.send_frame(frame[:len(frame) - cut], (), 10)
            parts = reader.receive_own(time.monotonic() + 10, lambda m: True, small=True)[1]
            assert (parts is None) == bool(cut)
        assert len(failures) == 1 and "declares 64 bytes" in str(failures[0])
    finally:
        a.close()
        b.close()


def test_a_plain_receive_that_timed_out_does_not_wait_again(ends):
    _, b = ends
    reader, _ = _reader(b)
    deadline = time.monotonic() + 0.2
    ticket, parts = reader.receive_own(deadline, lambda m: True)
    assert parts is None and reader.lease is Lease.IDLE
    began = time.monotonic()
    with pytest.raises(CommTimeoutError, match="within 30"):
        reader.receive(ticket, 30, lambda m: (True, m), "recv", deadline)
    assert time.monotonic() - began < 30  # it kept the deadline it began with


def test_a_stalled_payload_waits_for_the_receive_op_that_takes_it(ends):
    a, b = ends
    reader, _ = _reader(b)
    src = torch.arange(300_000, dtype=torch.float32)
    header, tensors = codec.encode_raw(src)
    frame, payload = framing.pack(header, tensors)
    a.send_frame(frame, payload, 10)
    msg = reader.receive(reader.take_ticket(), 10, lambda m: (True, m), "recv_tensor")
    assert msg.deferred and reader.lease is Lease.STALLED
    dst = torch.empty_like(src)
    buffers = [codec.as_bytes(dst)]
    reader.read_deferred(msg, lambda t: reader.payloads.read_into(t, buffers, 10), 10,
                         "recv_tensor")
    assert reader.lease is Lease.IDLE and torch.equal(dst, src)


def test_the_receiver_thread_stops_reading_at_the_inbox_cap(ends):
    a, b = ends
    reader, _ = _reader(b)
    reader.inbox.max_unread = 1  # one message, then the driver stops
    start_receiver_thread(reader)
    big = torch.ones(10_000, dtype=torch.uint8)  # past the inline size: counted in bytes
    sent = threading.Thread(target=lambda: [_send(a, big) for _ in range(3)])
    sent.start()
    sent.join(timeout=10)  # all three are on the transport (its ring holds them)
    # The driver read one, and then left the stream while the inbox is full.
    wait_for(lambda: len(reader.inbox) == 1 and reader.lease is Lease.IDLE,
             "the driver read one message and stopped", 10)
    assert len(reader.inbox) == 1 and b.poll(0)  # the other two wait on the transport
    for _ in range(3):  # each take makes room: the driver reads the next one
        assert torch.equal(_receive(reader), big)
    reader.set_error(CommError("done"))  # ends the receiver thread
