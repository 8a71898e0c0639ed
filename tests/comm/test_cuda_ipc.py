"""CUDA IPC between two workers on one GPU, and the choice between it and NCCL.

The pure parts (the choice, the payload layout, the store protocol, input checks, the
connection's wiring) run on CPU; the worker tests need a CUDA device.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rlcomm import (
    CollectiveGroupOptions,
    FlexiblePlacementStrategy,
    PackedPlacementStrategy,
    Worker,
)
from rlcomm.comm import codec
from rlcomm.comm.bucket_iter import Buckets
from rlcomm.comm.codec import Kind, MessageHeader, TensorMeta
from rlcomm.comm.connection import Connection
from rlcomm.comm.connection.sender import DeviceOrder
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.store.client import StoreClient, StoreServer, sub_store
from rlcomm.comm.transports import cuda_ipc, gpus, registry
from rlcomm.comm.transports.cuda_ipc import (
    ALIGN,
    CudaIpcTransport,
    byte_views,
    payload_layout,
)
from rlcomm.comm.transports.gpus import exchange_gpu_uuids
from rlcomm.comm.transports.shm import SHM_SUPPORTED
from rlcomm.errors import CommTimeoutError, PeerLostError, ProtocolMismatchError
from rlcomm.settings import get_settings, update_settings
from tests.comm.fake_device import FakeDevice, held
from tests.waiting import wait_for

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_shm = pytest.mark.skipif(not SHM_SUPPORTED, reason="shared memory needs x86-64 Linux")


@pytest.fixture(params=["tcpstore", "rlcomm"])
def stores(request):
    """A store server and two clients of it under one connection prefix (rank 0, 1):
    torch's TCPStore, and rlcomm's own store (whose ``take`` the offer board uses)."""
    if request.param == "tcpstore":
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2)]
        yield [dist.PrefixStore("pair/x", c) for c in clients]
        return
    own = StoreServer("127.0.0.1", b"s" * 32)
    try:
        yield [StoreClient("127.0.0.1", own.port, b"s" * 32, 30).prefixed("pair/x")
               for _ in range(2)]
    finally:
        own.close()



# -- the choice --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("same_node", "mine", "theirs", "expected"),
    [
        (True, "GPU-a", "GPU-a", "cuda_ipc"),  # one GPU of one node
        (True, "GPU-a", "GPU-b", "nccl"),  # two GPUs of one node
        (False, "GPU-a", "GPU-b", "nccl"),  # two nodes
    ],
)
def test_choice_of_cuda_transport(same_node, mine, theirs, expected):
    for a, b in ((mine, theirs), (theirs, mine)):  # both ends decide alike
        facts = registry.PairFacts(same_node=same_node, same_gpu=a == b)
        assert registry.select(facts, registry.CUDA).name == expected


def test_gpu_uuids_are_swapped_through_the_store(stores):
    got: dict[int, str] = {}

    def swap(rank: int) -> None:
        got[rank] = exchange_gpu_uuids(stores[rank], rank, f"GPU-{rank}", 10, f"end{1 - rank}")

    t = threading.Thread(target=swap, args=(1,))
    t.start()
    # Rank 1 published its UUID: it waits for rank 0's now (or is about to).
    wait_for(lambda: stores[0].check(["cuda_uuid/1"]), "rank 1 publishes its GPU UUID", 10)
    swap(0)
    t.join(timeout=10)
    assert got == {0: "GPU-1", 1: "GPU-0"}


def test_gpu_uuid_swap_times_out_naming_the_peer(stores):
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match="peer-z.*first CUDA send or receive"):
        exchange_gpu_uuids(stores[0], 0, "GPU-0", 0.5, "peer-z")
    assert time.monotonic() - start < 5


# -- pure helpers -------------------------------------------------------------------------------


def test_payload_layout_aligns_each_tensor():
    offsets, total = payload_layout([10, 0, 300, 1])
    assert offsets == [0, ALIGN, ALIGN, 2 * ALIGN + 256]
    assert total == 2 * ALIGN + 256 + 1
    assert all(o % ALIGN == 0 for o in offsets)
    assert payload_layout([]) == ([], 0)
    assert payload_layout([ALIGN, ALIGN]) == ([0, ALIGN], 2 * ALIGN)
    with pytest.raises(ValueError, match=">= 0"):
        payload_layout([4, -1])


def test_byte_views_refuse_cpu_and_strided_tensors():
    with pytest.raises(ValueError, match="tensor 0 is on cpu.*CUDA tensors only"):
        byte_views([torch.ones(3)], "send")
    strided = r"tensor 0 \(shape \(4, 4\), strides \(1, 4\)\) is not contiguous"
    with pytest.raises(ValueError, match=strided):
        byte_views([torch.ones(4, 4).t()], "send")



# -- the protocol on a fake device -----------------------------------------------------------


@pytest.fixture
def small_slots():
    """Slots of 4 KiB (payloads above are lent), 4 of them; restored after."""
    before = get_settings()
    update_settings(cuda_slot_bytes=4096, cuda_staging_slots=4)
    yield
    update_settings(cuda_slot_bytes=before.cuda_slot_bytes,
                    cuda_staging_slots=before.cuda_staging_slots)


@pytest.fixture
def ipc(stores, small_slots):
    """Two CUDA IPC transports on fake devices (one GPU, one process each): real link
    sockets and set-up through the store, CPU memory as the GPU's."""
    devs = [FakeDevice(), FakeDevice()]
    ends: dict[int, CudaIpcTransport] = {}

    def make(rank: int) -> None:
        ends[rank] = CudaIpcTransport(
            sub_store(stores[rank], "cuda_ipc"), rank, f"end{1 - rank}", torch.device("cpu"),
            10, os.getpid(), devs[rank],
        )

    t = threading.Thread(target=make, args=(1,))
    t.start()
    make(0)
    t.join(timeout=10)
    yield ends[0], ends[1], devs
    for end in ends.values():
        end.close()
    _no_device_errors(devs)


def _no_device_errors(devs: list[FakeDevice]) -> None:
    """Every queued operation ran, none past its deadline or raising."""
    for dev in devs:
        dev.synchronize_all()
        assert not dev.errors, dev.errors


def _send(end, tensors, deadline=None, on_wait=None):
    """Offer ``tensors`` and complete the send as a connection does (no frame needed:
    the offer bytes are handed over by the test)."""
    deadline = time.monotonic() + 5 if deadline is None else deadline
    out = end.offer(tensors, None, deadline, on_wait)
    return out


def test_a_small_payload_is_staged_in_one_copy_and_the_send_does_not_wait(ipc):
    a, b, (dev_a, dev_b) = ipc
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, 4, dtype=torch.int64),
               torch.empty(0), torch.tensor([7], dtype=torch.uint8)]
    out = _send(a, tensors)
    assert not out.lent and out.slot is not None
    a.complete(out, None, time.monotonic() + 0.01)  # nothing to wait for
    assert dev_a.copies == 1  # all tensors into the slot in one batched copy
    sizes = [t.numel() * t.element_size() for t in tensors]
    got = b.accept(out.offer, sizes, None, None, dev_b.current)
    assert dev_b.copies == 1  # and out of it in one copy
    want = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    assert [dev_b.read(g).tolist() for g in got] == [w.tolist() for w in want]
    wait_for(lambda: a.stats()["in_flight"] == 0, "the ack freed the slot", 10)
    assert a.stats()["acked"] == 1 and b.stats()["received"] == 1


def test_a_large_payload_is_lent_and_the_send_waits_for_the_receivers_copy(ipc):
    a, b, (dev_a, dev_b) = ipc
    big = torch.randn(4096)  # 16 KiB > the 4 KiB slots
    out = _send(a, [big])
    assert out.lent and dev_a.copies == 0 and dev_a.shares == 1
    with pytest.raises(CommTimeoutError, match="did not take it in time"):
        a.complete(out, None, time.monotonic() + 0.2)
    # A lent payload the receiver did not take in time: this path is out of step.
    with pytest.raises(PeerLostError, match="failed earlier"):
        _send(a, [big])


def test_a_lent_payload_lands_straight_in_the_receivers_tensors(ipc):
    a, b, (dev_a, dev_b) = ipc
    params = {"w": torch.randn(64, 64), "b": torch.randn(4096)}
    dst = {k: torch.zeros_like(v) for k, v in params.items()}
    for _ in range(3):
        dev_a.current.synchronize()  # the last receiver's copy is done: write again
        params["w"].add_(1)
        out = _send(a, list(params.values()))
        done = threading.Thread(target=a.complete,
                                args=(out, dev_a.current, time.monotonic() + 10))
        done.start()
        b.accept(out.offer, [v.numel() * 4 for v in params.values()], list(dst.values()),
                 None, dev_b.current)
        done.join(timeout=10)
        assert not done.is_alive()
        assert all(torch.equal(dev_b.read(dst[k]), params[k]) for k in params)
    # One copy per sync, into place: the receiver's at first; from the second sync into
    # the same tensors on, the sender's, into them (registered once).
    assert dev_b.copies == 1 and dev_a.copies == 2 and dev_b.allocated == 0
    assert dev_a.shares == 2 and dev_b.shares == 2  # each allocation shared once, then reused
    assert b.stats()["opened"] == 2 and b.stats()["registered"] == 1
    assert a.stats()["targets"] == 1


def _lend_into(a, b, dev_a, src: list[torch.Tensor], into: list[torch.Tensor]) -> None:
    """A lent message from ``a`` taken by ``b`` into ``into`` (the send completes
    meanwhile, as a blocking send's does)."""
    out = _send(a, src)
    assert out.lent
    done = threading.Thread(target=a.complete, args=(out, dev_a.current, time.monotonic() + 10))
    done.start()
    b.accept(out.offer, [t.numel() * t.element_size() for t in src], into, None,
             b._ops.current)
    done.join(timeout=10)
    assert not done.is_alive()


def test_receiving_into_new_tensors_each_time_registers_nothing(ipc):
    a, b, (dev_a, dev_b) = ipc
    src = [torch.randn(4096)]
    for _ in range(4):
        # New memory each time, at the same address (the allocator hands out the block
        # the last one freed): new storages, not the ones received into before.
        into = [dev_b.tensor(torch.zeros(4096))]
        _lend_into(a, b, dev_a, src, into)
        assert torch.equal(dev_b.read(into[0]), src[0])
        del into
    assert dev_b.reused == 3
    assert b.stats()["registered"] == 0 and dev_a.copies == 0 and dev_b.copies == 4


def test_registered_tensors_the_receiver_frees_are_let_go_by_the_sender(ipc):
    a, b, (dev_a, dev_b) = ipc
    src = [torch.randn(4096)]
    into = [dev_b.tensor(torch.zeros(4096))]  # the receiver's own memory (its allocator)
    for _ in range(3):
        _lend_into(a, b, dev_a, src, into)
    assert b.stats()["registered"] == 1 and a.stats()["targets"] == 1 and dev_a.opened == 1
    share = b._registered[next(iter(b._registered))].shares[0]
    assert held(share) == 1  # the sender holds it open
    dev_b.synchronize_all()
    del into  # the receiver frees its tensors
    b.release_idle(time.monotonic(), 3600)  # retires registrations of freed tensors
    assert b.stats()["registered"] == 0
    wait_for(lambda: a.stats()["targets"] == 0, "the sender takes the retirement in", 10)
    assert dev_a.opened == 0 and held(share) == 0
    assert len(dev_b._limbo) == 1  # freed while the sender held it: kept aside
    b.release_idle(time.monotonic(), 3600)  # the next pass collects it
    assert dev_b._limbo == [] and dev_b.tensor(torch.zeros(4096)) is not None
    assert dev_b.reused == 1  # the receiver's allocator has that memory again


def _written_twice(a, b, dev_a) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A payload and the tensors it was received into twice (registered now)."""
    src, into = [torch.randn(4096)], [torch.zeros(4096)]
    for _ in range(2):
        _lend_into(a, b, dev_a, src, into)
    return src, into


def test_a_sender_that_cannot_write_registered_tensors_has_the_receiver_copy_them(ipc):
    a, b, (dev_a, dev_b) = ipc
    src, into = _written_twice(a, b, dev_a)
    number = next(iter(a._targets))
    a._targets[number] = "the sender could not open it"  # as after a failed open
    src[0].add_(1)
    copies = dev_b.copies
    _lend_into(a, b, dev_a, src, into)
    assert dev_b.copies == copies + 1 and torch.equal(dev_b.read(into[0]), src[0])
    assert b.stats()["registered"] == 0  # that registration is dropped


def test_tensors_that_cannot_be_shared_are_copied_into_by_the_receiver(ipc, monkeypatch):
    a, b, (dev_a, dev_b) = ipc

    def refuse(t):
        raise RuntimeError("memory of another allocator")

    monkeypatch.setattr(dev_b, "share", refuse)
    src = [torch.randn(4096)]
    into = [torch.zeros(4096)]
    for _ in range(4):
        _lend_into(a, b, dev_a, src, into)
        assert torch.equal(dev_b.read(into[0]), src[0])
    assert dev_b.copies == 4 and dev_a.copies == 0 and a.stats()["targets"] == 0


def test_a_sender_that_does_not_write_in_time_fails_the_receive_and_writes_no_more(ipc):
    a, b, (dev_a, dev_b) = ipc
    src, into = _written_twice(a, b, dev_a)
    out = _send(a, src)  # a sender whose send never waits for its receiver
    with pytest.raises(CommTimeoutError, match="the sender did not write it in time"):
        b.accept(out.offer, [16384], into, None, dev_b.current, time.monotonic() + 0.2)
    copies = dev_a.copies
    with pytest.raises(PeerLostError):  # the sender finds the link closed, writes nothing
        a.complete(out, dev_a.current, time.monotonic() + 5)
    assert dev_a.copies == copies


def test_a_dead_sender_leaves_no_registered_tensor_held(ipc):
    a, b, (dev_a, dev_b) = ipc
    _written_twice(a, b, dev_a)
    (known,) = b._registered.values()
    assert [held(s) for s in known.shares] == [1]
    b.close(lost=True)  # the sender's process died: nobody closes what it opened
    assert [held(s) for s in known.shares] == [0]


def test_slots_are_reused_after_acks_and_a_full_staging_times_out(ipc):
    a, b, (_, dev_b) = ipc
    outs = [_send(a, [torch.full((8,), float(i))]) for i in range(4)]
    assert sorted(o.slot for o in outs) == [0, 1, 2, 3]
    with pytest.raises(CommTimeoutError, match="all 4 staging slots"):
        _send(a, [torch.ones(8)], time.monotonic() + 0.2)
    for i, out in enumerate(outs[:2]):
        (got,) = b.accept(out.offer, [32], None, None, dev_b.current)
        assert torch.equal(dev_b.read(got).view(torch.float32), torch.full((8,), float(i)))
    again = _send(a, [torch.ones(8)])  # waits for, and takes, a slot the acks freed
    assert again.slot in (outs[0].slot, outs[1].slot)


def test_a_send_waiting_for_a_slot_runs_its_on_wait(ipc):
    a, b, _ = ipc
    outs = [_send(a, [torch.full((8,), float(i))]) for i in range(4)]
    took: list[int] = []

    def on_wait() -> None:  # what a connection does: take in what the peer offered
        if outs:
            b.accept(outs.pop(0).offer, [32], None, None, None)
            took.append(1)

    _send(a, [torch.ones(8)], on_wait=on_wait)
    assert took


def test_a_refused_offer_reaches_a_lending_sender(ipc):
    a, b, _ = ipc
    out = _send(a, [torch.randn(4096)])
    with pytest.raises(ProtocolMismatchError, match="buffers are"):
        b.accept(out.offer, [100], None, None, None)
    with pytest.raises(ProtocolMismatchError, match="refused it: it holds tensors of"):
        a.complete(out, None, time.monotonic() + 5)
    # Refusals keep both ends in step.
    out = _send(a, [torch.ones(8)])
    assert b.accept(out.offer, [32], None, None, None)[0].numel() == 32


def test_offers_out_of_order_or_malformed_close_the_path(ipc):
    a, b, _ = ipc
    first, second = _send(a, [torch.ones(8)]), _send(a, [torch.ones(8)])
    with pytest.raises(ProtocolMismatchError, match="message 0 was due"):
        b.accept(second.offer, [32], None, None, None)
    with pytest.raises(PeerLostError, match="failed earlier"):
        b.accept(first.offer, [32], None, None, None)
    with pytest.raises(ProtocolMismatchError, match="malformed offer"):
        CudaIpcTransport.accept(b, b"\x93garbage", [32], None, None, None)


def test_an_offer_of_memory_the_receiver_cannot_see_is_refused(ipc):
    a, b, (_, dev_b) = ipc
    dev_b.visible = {"GPU-other": 0}
    out = _send(a, [torch.ones(8)])
    with pytest.raises(ProtocolMismatchError, match="does not see"):
        b.accept(out.offer, [32], None, None, None)


def test_the_sender_sees_its_peer_lost_and_releases_what_it_shared(ipc):
    a, b, (dev_a, _) = ipc
    staged = _send(a, [torch.ones(8)])
    lent_tensor = torch.randn(4096)
    lent = _send(a, [lent_tensor])
    shares = [s for s in a._shared]
    assert len(shares) == 2 and all(held(s) == 1 for s in shares)
    b.close()  # the receiver's process is gone: its end of the link closes
    with pytest.raises(PeerLostError, match="gone"):
        a.complete(lent, None, time.monotonic() + 5)
    a.close(lost=True)  # what the connection does when its peer is lost
    assert all(held(s) == 0 for s in shares)
    assert a.stats()["staging_bytes"] == 0 and a.stats()["lent"] == 0
    del staged


def test_idle_staging_and_opened_memory_are_released(ipc):
    a, b, (_, dev_b) = ipc
    before = get_settings().cuda_idle_release
    update_settings(cuda_idle_release=0.2)
    try:
        out = _send(a, [torch.ones(8)])
        b.accept(out.offer, [32], None, None, None)
        wait_for(lambda: a.stats()["in_flight"] == 0, "the condition", 10)
        assert a.stats()["staging_bytes"] and b.stats()["opened"] == 1
        wait_for(lambda: a.stats()["staging_bytes"] == 0 and b.stats()["opened"] == 0,
                 "the condition", 10)
        out = _send(a, [torch.full((8,), 3.0)])  # staging is made anew on demand
        (got,) = b.accept(out.offer, [32], None, None, dev_b.current)
        assert dev_b.read(got).view(torch.float32)[0] == 3.0
    finally:
        update_settings(cuda_idle_release=before)


def test_a_thousand_syncs_hold_no_more_memory_than_one(ipc):
    a, b, (dev_a, dev_b) = ipc
    dev_a.latency = dev_b.latency = 0.0  # memory, not ordering: the streams keep up
    params = [torch.randn(2048) for _ in range(4)]
    dst = [torch.empty_like(p) for p in params]

    def sync(fresh: bool) -> None:
        # Fresh tensors come from the fake's allocator, whose freed memory torch's way
        # keeps aside while the receiver holds it (a test's own tensors stay alive).
        src = [dev_a.tensor(p) for p in params] if fresh else params
        out = a.offer(src, dev_a.current, _deadline())
        done = threading.Thread(target=a.complete,
                                args=(out, dev_a.current, time.monotonic() + 10))
        done.start()
        b.accept(out.offer, [8192] * 4, dst, None, dev_b.current)
        done.join(timeout=10)

    for fresh in (False, True):  # the same tensors each time, and new ones each time
        for _ in range(500):
            sync(fresh)
        dev_b.synchronize_all()  # the copies queued on the receiver's stream are done
        # The receiver keeps open what the sender still holds (the parameters, and the
        # last sync's fresh tensors); each lent offer named the tensors freed since the
        # last one, and the receiver closed those.
        assert b.stats()["opened"] == dev_b.opened == (8 if fresh else 4)
        assert a.stats()["lent"] == (8 if fresh else 4)
        assert dev_b.allocated == 0
    assert a.stats()["acked"] == 1000
    assert torch.equal(dev_b.read(dst[0]), params[0])


def test_tensors_sent_one_by_one_stay_open_until_the_sender_frees_them(ipc):
    """A lent allocation stays open on the receiver until the sender frees it: sending
    tensors one by one, again and again, opens each once and closes none (each close
    would synchronize the receiver's stream); the next lent offer after some are freed
    names them, and the receiver closes those alone."""
    a, b, (dev_a, dev_b) = ipc
    # 16 KiB each (lent), from the fake's allocator: the sender's storage dies when
    # freed, though the receiver holds its memory open.
    params = [dev_a.tensor(torch.full((4096,), float(i))) for i in range(16)]
    into = torch.empty(4096)

    def send_one(t: torch.Tensor) -> None:
        out = a.offer([t], dev_a.current, _deadline())
        done = threading.Thread(target=a.complete, args=(out, dev_a.current, _deadline()))
        done.start()
        b.accept(out.offer, [t.numel() * 4], [into], None, dev_b.current)
        done.join(timeout=10)
        assert not done.is_alive()

    for _ in range(3):
        for i in range(16):
            send_one(params[i])
    assert torch.equal(dev_b.read(into), dev_a.read(params[-1]))
    assert dev_a.shares == 16 and dev_b.opened == 16 and dev_b.closes == 0
    shares = list(a._shared)
    del params[8:]  # the sender frees half of them
    send_one(params[0])
    wait_for(lambda: a.stats()["in_flight"] == 0, "the sender takes the ack in", 10)
    dev_b.synchronize_all()  # queued copies out of the freed tensors are done
    assert dev_b.opened == 8 and dev_b.closes == 8 and b.stats()["opened"] == 8
    assert a.stats()["lent"] == a.stats()["shared"] == 8  # none left to release for b
    assert [held(s) for s in shares] == [1] * 8 + [0] * 8


def _deadline() -> float:
    return time.monotonic() + 10


# -- the connection's choice, wired (GPU UUIDs faked) ---------------------------------------------


class _FakeNccl:
    name = "nccl"
    close_on_teardown = False

    def __init__(self, store, rank, timeout, peer, device):
        self.rank = rank

    def as_one_sided(self):  # two-sided, as NCCL: its payloads follow their frame
        return None

    def as_two_sided(self):
        return self


def _choose_both(conns, uuids: dict[str, str], monkeypatch) -> list:
    """Both ends make their CUDA transport at once, their GPUs faked by ``uuids``
    (device name -> UUID; the two ends ask for cuda:0 and cuda:1)."""
    monkeypatch.setattr(gpus, "gpu_uuid", lambda device: uuids[str(device)])
    fake = dataclasses.replace(
        registry.spec("nccl"), factory=lambda setup: _FakeNccl(
            setup.store, setup.rank, setup.timeout, setup.peer, setup.device
        ),
    )
    monkeypatch.setitem(registry._specs, "nccl", fake)
    ipc_on_fake = dataclasses.replace(
        registry.spec("cuda_ipc"), factory=lambda setup: CudaIpcTransport(
            setup.store, setup.rank, setup.peer, setup.device, setup.timeout,
            setup.peer_pid, FakeDevice(),
        ),
    )
    monkeypatch.setitem(registry._specs, "cuda_ipc", ipc_on_fake)
    a, b = conns
    got: list = [None, None]

    def make(i: int, conn: Connection) -> None:
        got[i] = conn._cuda_transport(torch.device("cuda", i), 10)

    t = threading.Thread(target=make, args=(1, b))
    t.start()
    make(0, a)
    t.join(timeout=15)
    return got


@needs_shm
def test_connection_takes_cuda_ipc_on_one_gpu(conns, monkeypatch):
    got = _choose_both(conns, {"cuda:0": "GPU-same", "cuda:1": "GPU-same"}, monkeypatch)
    assert [type(t) for t in got] == [CudaIpcTransport, CudaIpcTransport]
    a, _ = conns
    assert a._cuda_transport(torch.device("cuda", 0), 1) is got[0]  # chosen once


@needs_shm
def test_connection_takes_nccl_on_two_gpus(conns, monkeypatch):
    got = _choose_both(conns, {"cuda:0": "GPU-a", "cuda:1": "GPU-b"}, monkeypatch)
    assert [type(t) for t in got] == [_FakeNccl, _FakeNccl]
    assert [t.rank for t in got] == [0, 1]


@needs_shm
def test_connection_choice_times_out_without_the_peer(conns, monkeypatch):
    monkeypatch.setattr(gpus, "gpu_uuid", lambda device: "GPU-same")
    a, _ = conns
    with pytest.raises(CommTimeoutError, match="with b: the peer did not start"):
        a._cuda_transport(torch.device("cuda", 0), 0.5)
    assert a._cuda is None  # nothing chosen: a later op tries again


# -- offers in frames, over a real connection (fake device) -----------------------------------


@pytest.fixture
def linked(conns, small_slots):
    """An attached shared-memory connection pair whose CUDA path is CUDA IPC on fake
    devices (the connection's own stores and link; CPU tensors stand for GPU memory)."""
    a, b = conns
    devs = [FakeDevice(), FakeDevice()]
    made: dict[int, CudaIpcTransport] = {}

    def make(rank: int, conn: Connection) -> None:
        made[rank] = CudaIpcTransport(sub_store(conn._store, "cuda_ipc"), rank, conn.peer,
                                      torch.device("cpu"), 10, os.getpid(), devs[rank])

    t = threading.Thread(target=make, args=(1, b))
    t.start()
    make(0, a)
    t.join(timeout=10)
    a._cuda, b._cuda = made[0], made[1]
    yield a, b, devs
    _no_device_errors(devs)


def _device_frame(tensors: list[torch.Tensor]) -> bytes:
    """The frame of a list of CUDA tensors (these CPU ones stand for them)."""
    header = MessageHeader(Kind.TENSOR_LIST, [
        TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape), "cuda") for t in tensors
    ])
    hb = codec.header_to_bytes(header)
    return struct.pack("<I", len(hb)) + hb


def _send_device(conn: Connection, tensors, behind: bool = False) -> None:
    """What the sender does with a CUDA payload over a one-sided transport (``behind``:
    the pair's first CUDA message, whose offer follows its frame)."""
    frame = _device_frame(tensors)
    current = conn._cuda._ops.current  # a blocking send's order: the caller's stream
    order = DeviceOrder(current, current, False)
    with conn.sender._lock:
        if behind:
            conn._transport.send_frame(frame, [], 10)
            frame = b""
        conn.sender._send_offered(conn._transport, conn._cuda, frame, tensors, 10, order, behind)


def _received(conn: Connection, into=None):
    """A receive op's tensors, as the host sees them once the caller's stream (which
    the op ordered after its copy) is done."""
    got = conn.recv_object(conn.take_ticket(), 10, None, into)
    conn._cuda._ops.current.synchronize()
    return got


def test_offers_ride_in_frames_and_the_receive_op_copies_out(linked):
    a, b, (dev_a, dev_b) = linked
    small = [torch.arange(100.0), torch.ones(20, dtype=torch.int64)]
    big = [torch.randn(4096), torch.randn(100)]  # 16 KiB: lent
    _send_device(a, small)  # staged: the send returned without b receiving
    sender = threading.Thread(target=_send_device, args=(a, big))
    sender.start()
    got = _received(b)
    assert [torch.equal(x, y) for x, y in zip(got, small)] == [True, True]
    # (A receive into given tensors goes through the transport's tests: the receive
    # op copies into CUDA tensors in place, and these CPU ones are no CUDA tensors.)
    assert [torch.equal(x, y) for x, y in zip(_received(b), big)] == [True, True]
    sender.join(timeout=10)
    assert not sender.is_alive()
    # Nothing of either payload went through the connection's stream or the store.
    assert dev_b.copies == 2 and dev_a.copies == 1 and a._cuda.stats()["acked"] == 2


def test_staged_messages_to_a_worker_that_does_not_receive_yet_all_go(linked):
    a, b, _ = linked
    # Five times the 4 slots: each comes back as b's reader copies its message out,
    # as a CPU payload is read without waiting for recv.
    for i in range(20):
        _send_device(a, [torch.full((16,), float(i))])
    assert [int(_received(b)[0][0]) for _ in range(20)] == list(range(20))
    assert a._cuda.stats()["acked"] == 20


def test_messages_make_no_events_of_their_own(linked):
    """Each end records its own events, made at set-up, on every message: a message
    makes none (torch's ``Stream.wait_stream`` makes and drops one per call)."""
    a, b, (dev_a, dev_b) = linked
    _send_device(a, [torch.ones(16)])
    _received(b)
    made = dev_a.events_made, dev_b.events_made
    for i in range(10):
        _send_device(a, [torch.full((16,), float(i))])  # staged
        sender = threading.Thread(target=_send_device, args=(a, [torch.full((4096,), float(i))]))
        sender.start()  # lent: the send waits for the receive
        assert int(_received(b)[0][0]) == i
        assert int(_received(b)[0][-1]) == i
        sender.join(timeout=10)
        assert not sender.is_alive()
    assert (dev_a.events_made, dev_b.events_made) == made


def test_a_receive_op_orders_its_stream_after_a_copy_taken_in_earlier(linked):
    """The reader copies a staged payload out as its frame arrives, on the transport's
    receive stream, with no caller to order; the receive op orders the caller's stream
    after that copy (``order_after``), so the host reads the payload, not the memory
    before it."""
    a, b, (_, dev_b) = linked
    b._cuda._recv_stream.latency = 0.05  # the copy taken in is still queued
    _send_device(a, [torch.full((16,), 5.0)])
    wait_for(lambda: b._cuda.stats()["received"] == 1, "b's reader takes the offer in", 10)
    assert torch.equal(_received(b)[0], torch.full((16,), 5.0))


def test_the_first_cuda_message_brings_its_offer_behind_its_frame(linked):
    a, b, _ = linked
    payload = [torch.randn(4096)]
    sender = threading.Thread(target=_send_device, args=(a, payload, True))
    sender.start()
    (got,) = _received(b)
    sender.join(timeout=10)
    assert torch.equal(got, payload[0])
    # The stream stalled on it, and went on (its driver may hold it again by now).
    assert b.reader.lease.value in ("idle", "driver")
    _send_device(a, [torch.ones(8)])  # later ones: in the frame
    assert torch.equal(_received(b)[0], torch.ones(8))


@pytest.mark.parametrize("first", [False, True], ids=["offers in frames", "first messages"])
def test_two_workers_that_both_send_lent_payloads_first_both_go_on(linked, first):
    a, b, _ = linked
    to_b, to_a = [torch.randn(4096)], [torch.randn(8192)]
    errors: list[BaseException] = []
    got: dict[str, torch.Tensor] = {}

    def send_then_receive(conn, tensors, name):
        try:
            _send_device(conn, tensors, behind=first)
            got[name] = _received(conn)[0]
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=send_then_receive, args=(a, to_b, "a")),
               threading.Thread(target=send_then_receive, args=(b, to_a, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    # Each waiting send took the other's payload in meanwhile: neither hangs.
    assert not errors and not any(t.is_alive() for t in threads)
    assert torch.equal(got["b"], to_b[0]) and torch.equal(got["a"], to_a[0])


def test_a_peer_lost_mid_transfer_releases_what_it_held(linked):
    a, b, _ = linked
    lent = [torch.randn(4096)]
    sender = threading.Thread(target=lambda: pytest.raises(PeerLostError, _send_device, a, lent))
    sender.start()
    wait_for(lambda: a._cuda.stats()["in_flight"] == 1, "the condition", 10)
    shares = list(a._cuda._shared)
    b.close()  # the receiver's process ends: its link and stream close
    sender.join(timeout=10)
    # The connection failed (its reader, or the waiting send, saw the peer gone), and
    # failing released what the dead peer held of this end's memory.
    wait_for(lambda: a.error is not None and a._cuda.stats()["lent"] == 0, "the condition", 10)
    assert all(held(s) == 0 for s in shares)


# -- workers on one GPU --------------------------------------------------------------------------

SIZES = [1, 1000, 1 << 20, 3 << 20, 17]  # 3 Mi floats outgrow the first staging buffer


class SameGpuPeer(Worker):
    def cuda_transport_to(self, group, rank):
        conn = self._comm.connection(WorkerAddress.of(group, rank), None)
        return None if conn._cuda is None else conn._cuda.name

    def send_all(self, group, rank, device_index=0):
        torch.cuda.set_device(device_index)
        for i, n in enumerate(SIZES):
            self.send(torch.full((n,), float(i), device="cuda"), group, rank)
        self.send(
            {
                "w": torch.arange(10.0, device="cuda"),
                "b": torch.ones(3, 4, dtype=torch.bfloat16, device="cuda"),
                "e": torch.empty(0, device="cuda"),
            },
            group,
            rank,
        )
        for i, n in enumerate(SIZES):
            tensor = torch.full((n,), 100 + i, dtype=torch.int64, device="cuda")
            self.send_tensor(tensor, group, rank)
        for i in range(20):  # many small messages in a row reuse the staging buffer
            self.send(torch.tensor([i], device="cuda"), group, rank)
        reply = self.recv(group, rank)  # the other direction of the same connection
        return reply.is_cuda and reply.tolist() == [1.0, 2.0, 3.0]

    def recv_all(self, group, rank, device_index=0):
        torch.cuda.set_device(device_index)
        ok = {}
        for i, n in enumerate(SIZES):
            t = self.recv(group, rank)
            ok[f"recv {n}"] = t.is_cuda and t.numel() == n and bool((t == i).all())
        d = self.recv(group, rank)
        ok["dict"] = (
            sorted(d) == ["b", "e", "w"]
            and all(v.is_cuda for v in d.values())
            and d["w"].tolist() == list(range(10))
            and d["b"].dtype == torch.bfloat16 and d["b"].float().sum().item() == 12.0
            and d["e"].numel() == 0
        )
        for i, n in enumerate(SIZES):
            buf = torch.zeros(n, dtype=torch.int64, device="cuda")
            self.recv_tensor(buf, group, rank)
            ok[f"recv_tensor {n}"] = bool((buf == 100 + i).all())
        ok["small"] = [int(self.recv(group, rank)) for _ in range(20)] == list(range(20))
        self.send(torch.tensor([1.0, 2.0, 3.0], device="cuda"), group, rank)
        return ok

    def send_unreceived(self, group, rank):
        torch.cuda.set_device(0)
        start = time.monotonic()
        try:
            self.send(torch.ones(4, device="cuda"), group, rank,
                      options=CollectiveGroupOptions(timeout=3))
        except CommTimeoutError as exc:
            return str(exc), time.monotonic() - start
        return "", time.monotonic() - start


def _pair(cluster, name, strategies):
    groups = []
    try:
        for i, strategy in enumerate(strategies):
            groups.append(
                SameGpuPeer.create_group().launch(cluster, strategy, name=f"{name}_{i}")
            )
    except BaseException:
        for g in groups:
            g.shutdown()
        raise
    return groups


@needs_cuda
def test_cuda_send_recv_between_workers_on_one_gpu(cluster):
    # Two groups on hardware rank 0: both workers see that GPU as cuda:0 (no GPU is
    # reserved in Ray, as with fractional num_gpus), so NCCL could not pair them.
    a, b = _pair(cluster, "ipc1", [PackedPlacementStrategy(0, 0)] * 2)
    try:
        hs = a.execute_on(0).send_all("ipc1_1", 0)
        got = b.execute_on(0).recv_all("ipc1_0", 0).wait(timeout=180)[0]
        assert hs.wait(timeout=180) == [True]
        assert got == {k: True for k in got} and len(got) == 2 * len(SIZES) + 2
        assert a.execute_on(0).cuda_transport_to("ipc1_1", 0).wait(timeout=30) == ["cuda_ipc"]
        assert b.execute_on(0).cuda_transport_to("ipc1_0", 0).wait(timeout=30) == ["cuda_ipc"]
    finally:
        a.shutdown()
        b.shutdown()


@needs_cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
def test_one_gpu_under_different_indices_is_found_by_uuid(cluster):
    # The sender sees GPUs 0 and 1 and sends from cuda:1; the receiver sees GPU 1 only,
    # as its cuda:0.
    a, b = _pair(
        cluster, "ipc2", [FlexiblePlacementStrategy([[0, 1]]), PackedPlacementStrategy(1, 1)]
    )
    try:
        hs = a.execute_on(0).send_all("ipc2_1", 0, device_index=1)
        got = b.execute_on(0).recv_all("ipc2_0", 0, device_index=0).wait(timeout=180)[0]
        assert hs.wait(timeout=180) == [True]
        assert got == {k: True for k in got}
        assert b.execute_on(0).cuda_transport_to("ipc2_0", 0).wait(timeout=30) == ["cuda_ipc"]
    finally:
        a.shutdown()
        b.shutdown()


@needs_cuda
def test_cuda_send_to_a_peer_that_never_receives_times_out(cluster):
    a, b = _pair(cluster, "ipc3", [PackedPlacementStrategy(0, 0)] * 2)
    try:
        text, took = a.execute_on(0).send_unreceived("ipc3_1", 0).wait(timeout=60)[0]
        assert "timed out" in text or "did not start" in text
        assert took < 30
    finally:
        a.shutdown()
        b.shutdown()


# -- MPS ------------------------------------------------------------------------------------------


def test_mps_is_seen_from_its_pipe_and_its_daemon(tmp_path):
    pipes, proc = tmp_path / "mps", tmp_path / "proc"
    pipes.mkdir()
    (proc / "17").mkdir(parents=True)
    (proc / "17" / "comm").write_text("python\n")
    (proc / "self").mkdir()  # not a process id: skipped
    assert not gpus.mps_running(str(pipes), str(proc))  # no control pipe
    os.mkfifo(pipes / "control")
    assert not gpus.mps_running(str(pipes), str(proc))  # a pipe left behind, no daemon
    (proc / "23").mkdir()
    (proc / "23" / "comm").write_text("nvidia-cuda-mps\n")  # the kernel's 15 characters
    assert gpus.mps_running(str(pipes), str(proc))


def test_gpu_info_without_cuda_in_use_initializes_nothing():
    info = gpus.gpu_info()
    assert set(info) == {"device", "gpu", "visible", "mps"} and isinstance(info["mps"], bool)
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        assert info["device"] is None and info["gpu"] is None and info["visible"] == []


@pytest.mark.parametrize("lent", [False, True], ids=["staged", "lent"])
def test_a_cuda_message_is_taken_as_an_iterator(linked, lent):
    """recv(into=Buckets()) of a CUDA payload yields every tensor, ordered on the
    caller's stream. (Shards convert and slice with torch ops, which this layer runs on
    the host at once, not on a stream: test_gpu_sync.py has them on a GPU.)"""
    a, b, _ = linked
    n = 64 if lent else 8  # 64 x 64 floats are lent past the 4 KiB slots
    sent = [torch.randn(n, n), torch.arange(float(n))]
    sender = threading.Thread(target=_send_device, args=(a, sent))
    sender.start()
    got = list(b.recv_object(b.take_ticket(), 10, None, Buckets()))
    sender.join(timeout=10)
    b._cuda._ops.current.synchronize()  # what the host sees (a GPU's reads queue after)
    assert [name for name, _ in got] == ["0", "1"]
    assert all(torch.equal(t, s) for (_, t), s in zip(got, sent))


def test_a_staged_offer_is_decoded_once(linked, monkeypatch):
    """The reader asks whether to copy a staged message out at once, then copies it: one
    decode of its offer for both."""
    a, b, _ = linked
    calls = []
    real = cuda_ipc.decode_offer
    monkeypatch.setattr(cuda_ipc, "decode_offer", lambda data, peer: calls.append(1) or real(data, peer))
    for i in range(3):
        _send_device(a, [torch.full((16,), float(i))])
        assert int(_received(b)[0][0]) == i
    assert len(calls) == 3
