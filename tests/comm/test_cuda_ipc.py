"""CUDA IPC between two workers on one GPU, and the choice between it and NCCL.

The pure parts (the choice, the payload layout, the store protocol, input checks, the
connection's wiring) run on CPU; the worker tests need a CUDA device.
"""

from __future__ import annotations

import dataclasses
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
from rlcomm.comm.connection import Connection
from rlcomm.comm.identity.address import WorkerAddress
from rlcomm.comm.store import StoreClient, StoreServer, sub_store
from rlcomm.comm.transports import gpus, registry
from rlcomm.comm.transports.cuda_ipc import CudaIpcTransport
from rlcomm.comm.transports.cuda_ipc_board import (
    ALIGN,
    Offer,
    OfferBoard,
    byte_views,
    payload_layout,
)
from rlcomm.comm.transports.gpus import exchange_gpu_uuids
from rlcomm.comm.transports.shm import SHM_SUPPORTED
from rlcomm.errors import CommTimeoutError, PeerLostError, ProtocolMismatchError

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


def _offer(**changes) -> Offer:
    fields = dict(
        gpu="GPU-1234", mem_handle=b"\x01" * 64, storage_bytes=4 << 20, storage_offset=512,
        ref_counter=b"/torch_1_2", ref_counter_offset=3, share_event=b"\x02" * 64,
        share_event_sync=True, event=b"\x03" * 64, offsets=[0, 256], sizes=[10, 20],
    )
    fields.update(changes)
    return Offer(**fields)


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
    time.sleep(0.2)  # rank 1 waits for rank 0's key meanwhile
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


# -- the store protocol ---------------------------------------------------------------------------


def test_offer_board_round_trip_and_cleanup(stores):
    sender, receiver = OfferBoard(stores[0], 0, "r"), OfferBoard(stores[1], 0, "s")
    offer = _offer()
    sender.post(0, offer)
    assert receiver.take(0, 5) == offer
    receiver.ack(0)
    sender.wait_ack(0, 5)
    # Read keys are deleted: a long stream does not grow the store.
    assert not stores[0].check(["0/offer/0"]) and not stores[0].check(["0/ack/0"])
    sender.post(1, _offer(sizes=[1, 2]))
    assert receiver.take(1, 5).sizes == [1, 2]


def test_offer_board_refusal_reaches_the_sender(stores):
    sender, receiver = OfferBoard(stores[0], 1, "r"), OfferBoard(stores[1], 1, "s")
    sender.post(7, _offer())
    receiver.take(7, 5)
    receiver.ack(7, "buffers of other sizes")
    with pytest.raises(ProtocolMismatchError, match="message 7 to r: .*buffers of other sizes"):
        sender.wait_ack(7, 5)


def test_offer_board_waits_time_out(stores):
    sender, receiver = OfferBoard(stores[0], 0, "r"), OfferBoard(stores[1], 0, "s")
    with pytest.raises(CommTimeoutError, match="recv of message 0 with s"):
        receiver.take(0, 0.3)
    sender.post(0, _offer())
    with pytest.raises(CommTimeoutError, match="send of message 0 with r"):
        sender.wait_ack(0, 0.3)
    # The client is still usable after a timed-out wait.
    assert receiver.take(0, 5) == _offer()


def test_directions_use_their_own_keys(stores):
    """Both ranks send message 0 at once: each receives the other's offer."""
    boards = {r: OfferBoard(stores[r], r, "p") for r in (0, 1)}
    boards[0].post(0, _offer(gpu="from-0"))
    boards[1].post(0, _offer(gpu="from-1"))
    assert OfferBoard(stores[1], 0, "p").take(0, 5).gpu == "from-0"
    assert OfferBoard(stores[0], 1, "p").take(0, 5).gpu == "from-1"


# -- the transport without a GPU -------------------------------------------------------------------


def test_transport_checks_before_touching_the_gpu(stores):
    with pytest.raises(ValueError, match="rank must be 0 or 1"):
        CudaIpcTransport(stores[0], 2, "p")
    transport = CudaIpcTransport(stores[0], 0, "p")
    with pytest.raises(ValueError, match="cuda_ipc send to p: tensor 0 is on cpu"):
        transport.send([torch.ones(2)], 1)
    with pytest.raises(ValueError, match="cuda_ipc recv from p: tensor 0 is on cpu"):
        transport.recv_into([torch.ones(2)], 1)
    transport.send([], 0.1)  # an empty payload is no message: nothing to wait for
    transport.recv_into([], 0.1)
    transport.close()
    with pytest.raises(PeerLostError, match="closed"):
        transport.send([], 1)


def test_transports_of_both_ends_meet_on_their_cloned_stores(stores):
    ends = [CudaIpcTransport(sub_store(stores[r], "cuda_ipc"), r, "p") for r in (0, 1)]
    try:
        ends[0]._outgoing.post(0, _offer(gpu="from-0"))
        ends[1]._outgoing.post(0, _offer(gpu="from-1"))
        assert ends[1]._incoming.take(0, 5).gpu == "from-0"
        assert ends[0]._incoming.take(0, 5).gpu == "from-1"
        ends[1]._incoming.ack(0)
        ends[0]._outgoing.wait_ack(0, 5)
        # The keys lie under the transport's own prefix of the connection's store.
        ends[0]._outgoing.post(1, _offer())
        assert stores[1].check(["cuda_ipc/0/offer/1"])
    finally:
        for end in ends:
            end.close()


# -- the connection's choice, wired (GPU UUIDs faked) ---------------------------------------------


class _FakeNccl:
    name = "nccl"
    close_on_teardown = False

    def __init__(self, store, rank, timeout, peer, device):
        self.rank = rank


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
