"""Every ordering rule of the CUDA IPC protocol, one test each, on the fake device layer
(``tests/comm/fake_device.py``: asynchronous streams, events, a caching allocator that
hands a freed block out again at once).

Each test slows the stream whose work the rule waits for, so that without the rule the
other side's work comes first and the data is wrong. The rules, in
:mod:`rlcomm.comm.transports.cuda_ipc`:

- sender, ``offer``: the send stream waits for the caller's order (its writes to the
  payload); a staging copy waits for the receiver's *done* (its copy out of the slot's
  last message); the caller's tensors are kept from reuse until the staging copy has read
  them; *ready* is recorded after the copy;
- sender, ``complete``: the caller's stream (or the host) waits for *ready* (staged) or for
  the receiver's *done* (lent) before the caller may write the payload again;
- receiver, ``_copy_out``: the receive stream waits for the caller's order (its buffers
  are free to write) or, when there is none, for the current stream the new memory comes
  from; it waits for the sender's *ready*; *done* is recorded after the copy; new memory
  is kept from reuse until the copy is done; the caller's order waits for *done*.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from rlcomm.comm.store.client import StoreClient, StoreServer, sub_store
from rlcomm.comm.transports.cuda_ipc import CudaIpcTransport
from rlcomm.settings import get_settings, update_settings
from tests.comm.fake_device import FakeDevice
from tests.waiting import wait_for

#: Latency of a slowed stream: its work comes well after what the other side queues.
SLOW = 0.05
N = 64  # floats in a small (staged) payload; 4096 make a lent one


@pytest.fixture
def pair():
    """A sender and a receiver, each on its own fake device (one GPU, two "processes"):
    slots of 4 KiB (larger payloads are lent), 4 of them."""
    before = get_settings()
    update_settings(cuda_slot_bytes=4096, cuda_staging_slots=4)
    server = StoreServer("127.0.0.1", b"o" * 32)
    devs = [FakeDevice(), FakeDevice()]
    ends: dict[int, CudaIpcTransport] = {}

    def make(rank: int) -> None:
        store = StoreClient("127.0.0.1", server.port, b"o" * 32, 30).prefixed("pair/o")
        ends[rank] = CudaIpcTransport(sub_store(store, "cuda_ipc"), rank, f"end{1 - rank}",
                                      torch.device("cpu"), 10, os.getpid(), devs[rank])

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join(timeout=10)
    try:
        yield ends[0], ends[1], devs[0], devs[1]
        for dev in devs:
            dev.synchronize_all()
            assert not dev.errors, dev.errors
    finally:
        for end in ends.values():
            end.close()
        server.close()
        update_settings(cuda_slot_bytes=before.cuda_slot_bytes,
                        cuda_staging_slots=before.cuda_staging_slots)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _deadline() -> float:
    return time.monotonic() + 10


def _lend(a: CudaIpcTransport, b: CudaIpcTransport, dev_a: FakeDevice, dev_b: FakeDevice,
          src: torch.Tensor, into: torch.Tensor, host: bool = False) -> None:
    """A lent message from ``a`` into ``into`` on ``b``: the send completes (it waits
    for the ack) while the receiver takes it, both ordered on their current streams."""
    out = a.offer([src], dev_a.current, _deadline())
    assert out.lent
    done = threading.Thread(target=a.complete, args=(out, dev_a.current, _deadline()),
                            kwargs={"host": host})
    done.start()
    b.accept(out.offer, [_bytes(src)], [into], None, dev_b.current)
    done.join(timeout=10)
    assert not done.is_alive()


def _write_again(dev: FakeDevice, src: torch.Tensor, host: bool) -> None:
    """The caller writes its payload once the send returned: on its current stream (a
    blocking send ordered it), or, after an async send (the host waited), on any stream."""
    stream = dev.new_stream(torch.device("cpu")) if host else dev.current
    dev.launch(lambda: src.fill_(-1.0), stream)


# -- the sender -------------------------------------------------------------------------------


def test_the_staging_copy_reads_the_payload_after_the_callers_writes(pair):
    """offer: the send stream waits for the caller's order."""
    a, b, dev_a, dev_b = pair
    dev_a.current.latency = SLOW  # the caller's write to its payload is still queued
    src = dev_a.tensor(torch.zeros(N))
    dev_a.launch(lambda: src.fill_(5.0))
    out = a.offer([src], dev_a.current, _deadline())
    a.complete(out, dev_a.current, _deadline())
    (got,) = b.accept(out.offer, [_bytes(src)], None, None, dev_b.current)
    assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((N,), 5.0))


def test_a_slot_is_written_again_after_the_receiver_copied_its_last_message(pair):
    """offer: a staging copy waits for the receiver's *done*."""
    a, b, dev_a, dev_b = pair
    b._recv_stream.latency = SLOW  # the receiver's copy out of the slot comes late
    first = a.offer([torch.full((N,), 1.0)], None, _deadline())
    (got,) = b.accept(first.offer, [N * 4], None, None, dev_b.current)
    wait_for(lambda: a.stats()["in_flight"] == 0, "the sender takes the ack in", 10)
    second = a.offer([torch.full((N,), 2.0)], None, _deadline())
    assert second.slot == first.slot  # the slot the ack gave back, at once
    assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((N,), 1.0))


def test_a_payload_freed_after_an_async_send_is_not_reused_before_the_staging_copy(pair):
    """offer: the caller's tensors are kept from reuse until the staging copy read them
    (an async send: nothing orders the caller's stream after the copy)."""
    a, b, dev_a, dev_b = pair
    a._send_stream.latency = SLOW
    src = dev_a.tensor(torch.full((N,), 3.0))
    mark = dev_a.new_event()
    dev_a.record(mark, dev_a.current)  # what an async send orders its read after
    out = a.offer([src], mark, _deadline())
    del src  # the caller lets its tensor go, and allocates more at once
    again = dev_a.tensor(torch.full((N,), -1.0))
    a.complete(out, None, _deadline(), host=True)
    (got,) = b.accept(out.offer, [N * 4], None, None, dev_b.current)
    assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((N,), 3.0))
    assert torch.equal(dev_a.read(again), torch.full((N,), -1.0))


def test_the_receiver_copies_a_staged_payload_after_it_is_in_the_slot(pair):
    """offer records *ready* after the staging copy; the receiver's copy waits for it."""
    a, b, dev_a, dev_b = pair
    a._send_stream.latency = SLOW
    out = a.offer([torch.full((N,), 4.0)], None, _deadline())
    (got,) = b.accept(out.offer, [N * 4], None, None, dev_b.current)
    assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((N,), 4.0))


@pytest.mark.parametrize("host", [False, True], ids=["stream", "host"])
def test_the_caller_writes_a_staged_payload_again_after_the_staging_copy(pair, host):
    """complete (staged): the caller's stream, or the host, waits for *ready*."""
    a, b, dev_a, dev_b = pair
    a._send_stream.latency = SLOW
    src = dev_a.tensor(torch.full((N,), 6.0))
    out = a.offer([src], dev_a.current, _deadline())
    a.complete(out, dev_a.current, _deadline(), host=host)
    _write_again(dev_a, src, host)
    (got,) = b.accept(out.offer, [N * 4], None, None, dev_b.current)
    assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((N,), 6.0))


@pytest.mark.parametrize("host", [False, True], ids=["stream", "host"])
def test_the_caller_writes_a_lent_payload_again_after_the_receivers_copy(pair, host):
    """complete (lent): after the ack, the caller's stream, or the host, waits for the
    receiver's *done* (the ack comes when the copy is queued, not done)."""
    a, b, dev_a, dev_b = pair
    b._recv_stream.latency = SLOW
    src = dev_a.tensor(torch.full((4096,), 7.0))
    into = torch.zeros(4096)
    _lend(a, b, dev_a, dev_b, src, into, host=host)
    _write_again(dev_a, src, host)
    assert torch.equal(dev_b.read(into), torch.full((4096,), 7.0))


# -- the receiver -----------------------------------------------------------------------------


def test_the_receivers_copy_waits_for_the_callers_work_on_its_buffers(pair):
    """_copy_out: the receive stream waits for the caller's order before writing into
    its tensors (a kernel of the caller still reads them)."""
    a, b, dev_a, dev_b = pair
    dev_b.current.latency = SLOW
    params = torch.full((4096,), 1.0)
    seen: list[float] = []
    dev_b.launch(lambda: seen.append(float(params[0])))  # reads the old weights
    _lend(a, b, dev_a, dev_b, torch.full((4096,), 2.0), params)
    assert torch.equal(dev_b.read(params), torch.full((4096,), 2.0))
    assert seen == [1.0]


def test_a_copy_taken_in_before_any_receive_waits_for_the_current_streams_kernels(pair):
    """_copy_out without an order (a staged payload taken in as its frame is read): the
    new memory comes from the current stream's pool, where a block just freed may still
    be read by kernels queued there; the receive stream waits for them."""
    a, b, dev_a, dev_b = pair
    dev_b.current.latency = SLOW
    old = dev_b.tensor(torch.full((N,), 1.0))
    raw = dev_b._raw(old.view(torch.uint8))  # what a kernel reads: the bytes, not the tensor
    seen: list[float] = []
    dev_b.launch(lambda: seen.append(float(raw.view(torch.float32)[0])))
    del old  # its owner lets it go while the kernel is queued
    out = a.offer([torch.full((N,), 9.0)], None, _deadline())
    (got,) = b.accept(out.offer, [N * 4], None, None, None)
    assert dev_b.reused == 1  # the allocator handed that block out again
    b.order_after(dev_b.current)
    assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((N,), 9.0))
    assert seen == [1.0]


def test_new_memory_of_a_receive_is_not_reused_before_its_copy(pair):
    """_copy_out keeps the new memory from reuse until the receive stream's copy is done
    (a message taken in, then dropped unread)."""
    a, b, dev_a, dev_b = pair
    b._recv_stream.latency = SLOW
    out = a.offer([torch.full((N,), 9.0)], None, _deadline())
    (got,) = b.accept(out.offer, [N * 4], None, None, None)
    del got
    mine = dev_b.tensor(torch.full((N,), 1.0))
    assert torch.equal(dev_b.read(mine), torch.full((N,), 1.0))
    dev_b.synchronize_all()
    assert torch.equal(dev_b.read(mine), torch.full((N,), 1.0))


@pytest.mark.parametrize("lent", [False, True], ids=["staged", "lent"])
def test_the_caller_reads_what_it_received_after_the_copy(pair, lent):
    """_copy_out records *done* after the copy and orders the caller's stream after it."""
    a, b, dev_a, dev_b = pair
    b._recv_stream.latency = SLOW
    n = 4096 if lent else N
    if lent:
        into = torch.zeros(n)
        _lend(a, b, dev_a, dev_b, torch.full((n,), 8.0), into)
        got = into
    else:
        out = a.offer([torch.full((n,), 8.0)], None, _deadline())
        (got,) = b.accept(out.offer, [n * 4], None, None, dev_b.current)
        got = got.view(torch.float32)
    assert torch.equal(dev_b.read(got), torch.full((n,), 8.0))


# -- a lent payload the sender writes into the receiver's registered tensors ----------------


def _registered(a, b, dev_a, dev_b, into: torch.Tensor, times: int = 2) -> torch.Tensor:
    """Receive lent payloads into ``into`` until the sender writes it (the second time);
    returns the sender's tensor, for the next sync."""
    src = dev_a.tensor(torch.full((into.numel(),), 0.5))
    for _ in range(times):
        _lend(a, b, dev_a, dev_b, src, into)
    assert b.stats()["registered"] == 1 and a.stats()["targets"] == 1
    dev_a.synchronize_all()  # nothing of these syncs is left queued for the next one
    dev_b.synchronize_all()
    return src


def test_the_sender_writes_registered_tensors_after_the_receivers_reads(pair):
    """_written_by_sender records *done* after the caller's work on its tensors; the
    sender's write waits for it."""
    a, b, dev_a, dev_b = pair
    params = torch.full((4096,), 1.0)
    src = _registered(a, b, dev_a, dev_b, params)
    dev_a.launch(lambda: src.fill_(2.0))
    dev_b.current.latency = SLOW
    seen: list[float] = []
    dev_b.launch(lambda: seen.append(float(params[0])))  # a kernel reads the old weights
    copies = dev_a.copies
    _lend(a, b, dev_a, dev_b, src, params)
    assert dev_a.copies == copies + 1  # the sender wrote it
    assert torch.equal(dev_b.read(params), torch.full((4096,), 2.0))
    assert seen == [0.5]


def test_the_receiver_reads_registered_tensors_after_the_senders_write(pair):
    """_write records *ready* after its copy; the receiver's stream waits for it."""
    a, b, dev_a, dev_b = pair
    params = torch.zeros(4096)
    src = _registered(a, b, dev_a, dev_b, params)
    dev_a.launch(lambda: src.fill_(3.0))
    a._send_stream.latency = SLOW  # the sender's write comes late
    _lend(a, b, dev_a, dev_b, src, params)
    assert torch.equal(dev_b.read(params), torch.full((4096,), 3.0))


@pytest.mark.parametrize("host", [False, True], ids=["stream", "host"])
def test_the_caller_writes_a_payload_it_wrote_into_the_receiver_again_after_that_write(pair, host):
    """complete (written by the sender): the caller's stream, or the host, waits for the
    sender's own *ready*, not the receiver's *done*."""
    a, b, dev_a, dev_b = pair
    params = torch.zeros(4096)
    src = _registered(a, b, dev_a, dev_b, params)
    dev_a.launch(lambda: src.fill_(4.0))
    a._send_stream.latency = SLOW
    _lend(a, b, dev_a, dev_b, src, params, host=host)
    _write_again(dev_a, src, host)
    assert torch.equal(dev_b.read(params), torch.full((4096,), 4.0))
