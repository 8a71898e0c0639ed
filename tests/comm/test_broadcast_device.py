"""The device path of a broadcast, planned by GPU, on a fake device layer: a source and
two receivers of one node in this process (real fan-out sockets, real IPC links and a
real store), one receiver seeing the source's GPU and one not."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch

from rlcomm.comm import codec, framing
from rlcomm.comm.broadcast.device import SETUP, DeviceFanout, plan_by_gpu
from rlcomm.comm.bucket_iter import Buckets
from rlcomm.comm.buckets import Shard
from rlcomm.comm.store.client import StoreClient, StoreServer
from rlcomm.comm.taking import Taking
from rlcomm.comm.transports import registry
from rlcomm.comm.transports.cuda_ipc import CudaIpcTransport
from rlcomm.comm.transports.shm import SHM_SUPPORTED
from rlcomm.comm.transports.shm_fanout import FanoutSource
from rlcomm.comm.transports.shm_fanout_sink import FanoutSink
from rlcomm.errors import ProtocolMismatchError
from tests.comm.fake_device import FakeDevice

pytestmark = pytest.mark.skipif(not SHM_SUPPORTED, reason="the fan-out needs shared memory")

NAMES = ["trainer:0", "rollout:0", "rollout:1"]


def test_the_plan_splits_the_node_by_what_each_member_sees():
    local = [1, 2, 3, 4]
    sees = {1: True, 2: False, 4: None}
    assert plan_by_gpu(local, sees) == ([3, 4], [1], [2])
    assert plan_by_gpu([], {}) == ([], [], [])


@pytest.fixture
def node(monkeypatch):
    """A source (member 0, GPU-a) and receivers 1 (sees GPU-a) and 2 (sees GPU-b only),
    each with its own fake device, sharing one store; the registry's CUDA IPC makes its
    links on those fake devices."""
    server = StoreServer("127.0.0.1", b"k" * 32)
    devices = [FakeDevice("GPU-a"), FakeDevice("GPU-a", ("GPU-b", "GPU-a")),
               FakeDevice("GPU-b")]

    made: dict[int, DeviceFanout] = {}

    def factory(setup: registry.TransportSetup) -> CudaIpcTransport:
        # Which member's end this is: the one whose thread is making it.
        index = getattr(_member, "index", 0)
        return CudaIpcTransport(setup.store, setup.rank, setup.peer, setup.device,
                                setup.timeout, setup.peer_pid, devices[index])

    spec = dataclasses.replace(registry.spec("cuda_ipc"), factory=factory)
    monkeypatch.setitem(registry._specs, "cuda_ipc", spec)
    for i in range(3):
        store = StoreClient("127.0.0.1", server.port, b"k" * 32, 30).prefixed("bcast/x")
        made[i] = DeviceFanout(lambda s=store: s, i, [os.getpid()] * 3, NAMES, devices[i])
    source = FanoutSource({1: os.getpid(), 2: os.getpid()}, "test broadcast")
    sinks: dict[int, FanoutSink] = {}

    def connect(i: int) -> None:
        sinks[i] = FanoutSink(source.name, i, os.getpid(), time.monotonic() + 10, "test")

    threads = [threading.Thread(target=connect, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    source.accept(time.monotonic() + 10)
    for t in threads:
        t.join(timeout=10)
    yield made, source, sinks, devices
    for fanout in made.values():
        fanout.close()
    source.close()
    for sink in sinks.values():
        sink.close()
    server.close()
    for dev in devices:  # every queued device operation ran, none past its deadline
        dev.synchronize_all()
        assert not dev.errors, dev.errors


_member = threading.local()


def _receive(fanout: DeviceFanout, sink: FanoutSink, into=None, taking=None
             ) -> tuple[object, str]:
    """What BroadcastGroup's receiver does: set-up messages, then the broadcast's own:
    an offer (copied on the device) or a host copy; ``taking``: what the receive takes
    of it (an iterator, shards), as BroadcastGroup hands a whole message to it."""
    _member.index = fanout.index
    deadline = time.monotonic() + 10
    while True:
        msg = sink.recv(deadline)
        header, inline, offer = framing.unpack(msg.frame)
        if not offer.startswith(SETUP):
            break
        fanout.set_up(0, offer, deadline)
    sizes = [m.nbytes for m in header.tensors]
    targets = None if into is None else codec.destinations(header, into)
    if offer:
        current = fanout._ops.current  # BroadcastGroup orders its caller's stream
        buffers = fanout.receive(0, offer, sizes, targets, None, current)
        current.synchronize()  # what the host sees then
        tensors = targets or framing.tensors_from_payload(header, buffers)
        how = "device"
    else:
        tensors = framing.tensors_from_payload(header, msg.payload([n for n in sizes if n]))
        how = "host"
        if targets is not None:
            for t, got in zip(targets, tensors):
                t.copy_(got)
            tensors = targets
    if taking is not None:
        return taking.whole(header, tensors), how
    return (codec.decode(header, tensors) if into is None else into), how


def _broadcast(node, obj, into=None, rounds=1, taking=None):
    made, source, sinks, devices = node
    seq = iter(range(10_000))
    results: dict[int, list] = {1: [], 2: []}

    def receiver(i: int) -> None:
        for _ in range(rounds):
            results[i].append(_receive(made[i], sinks[i], into,
                                       None if taking is None else taking(i)))

    threads = [threading.Thread(target=receiver, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    _member.index = 0
    failures = []
    for _ in range(rounds):
        header, tensors = codec.encode(obj)
        frame, _ = framing.pack(header, tensors)
        failures.append(made[0].send(frame, [t for t in tensors if t.numel()], [1, 2], source,
                                     lambda: next(seq), None, time.monotonic() + 10, False))
    for t in threads:
        t.join(timeout=20)
    return results, failures


def test_a_receiver_on_the_sources_gpu_copies_on_the_device_the_other_gets_host_memory(node):
    made, source, sinks, devices = node
    weights = {"w": torch.randn(64, 64), "b": torch.arange(10.0)}
    results, failures = _broadcast(node, weights, rounds=3)
    assert failures == [{}, {}, {}]
    for i in (1, 2):
        for got, _ in results[i]:
            assert set(got) == {"w", "b"} and all(torch.equal(got[k], weights[k]) for k in got)
    assert [how for _, how in results[1]] == ["device"] * 3
    assert [how for _, how in results[2]] == ["host"] * 3
    # One device copy per receiver and broadcast (lent: none at the source); the
    # source's tensors were shared once for its one device member.
    assert devices[1].copies == 3 and devices[0].copies == 0 and devices[0].shares == 2
    assert devices[2].copies == 0  # GPU-b's process never opened GPU-a's memory
    # Set up once: later broadcasts are one message per member.
    assert made[0]._sees == {(1, "GPU-a"): True, (2, "GPU-a"): False}


def test_receivers_take_a_device_broadcast_into_their_tensors(node):
    weights = {"w": torch.randn(128), "b": torch.ones(3)}
    into = {"w": torch.zeros(128), "b": torch.zeros(3)}
    results, failures = _broadcast(node, weights, into=into)
    assert failures == [{}]
    (got, how), = results[1]
    assert how == "device" and got is into and torch.equal(into["w"], weights["w"])


def test_a_source_writes_a_receivers_tensors_itself_from_the_second_broadcast_into_them(node):
    made, source, sinks, devices = node
    weights = {"w": torch.randn(128), "b": torch.ones(3)}
    into = {"w": torch.zeros(128), "b": torch.zeros(3)}
    results, failures = _broadcast(node, weights, into=into, rounds=3)
    assert failures == [{}, {}, {}]
    assert [how for _, how in results[1]] == ["device"] * 3
    assert torch.equal(into["w"], weights["w"]) and torch.equal(into["b"], weights["b"])
    # The receiver copied the first one out; it registered its tensors with the second,
    # which the source wrote, as the third.
    assert devices[1].copies == 1 and devices[0].copies == 2


def test_a_receiver_that_refuses_fails_the_source_for_it_only(node):
    made, source, sinks, devices = node
    _broadcast(node, {"w": torch.ones(4)})  # set up
    _member.index = 0
    seq = iter(range(100, 200))
    header, tensors = codec.encode({"w": torch.ones(4)})
    frame, _ = framing.pack(header, tensors)

    def refuse() -> None:
        _member.index = 1
        msg = sinks[1].recv(time.monotonic() + 10)
        _, _, offer = framing.unpack(msg.frame)
        made[1].refuse(0, offer, "its tensors do not fit")

    def take() -> None:
        _receive(made[2], sinks[2])

    threads = [threading.Thread(target=refuse), threading.Thread(target=take)]
    for t in threads:
        t.start()
    failures = made[0].send(frame, tensors, [1, 2], source, lambda: next(seq), None,
                            time.monotonic() + 10, False)
    for t in threads:
        t.join(timeout=10)
    assert list(failures) == [1] and isinstance(failures[1], ProtocolMismatchError)
    assert "do not fit" in str(failures[1])
    # The refusal kept the link in step: the next broadcast reaches both.
    results, failures = _broadcast(node, {"w": torch.full((4,), 2.0)})
    assert failures == [{}] and results[1][0][1] == "device"


def test_a_device_broadcast_is_taken_as_an_iterator_of_shards(node):
    """A weight sync's receive options take a device payload as they take a CPU one: the
    iterator (renaming), the shards and their dtype, on the member that copied it on the
    device and on the one that got it through host memory."""
    weights = {"layer.w": torch.arange(64.0).view(8, 8), "layer.b": torch.arange(4.0)}

    def taking(i: int) -> Taking:
        shards = {"layer.w": Shard(1, i - 1, 2, dtype=torch.float64)}
        return Taking(Buckets(transform=lambda pairs: [(f"engine.{n}", t) for n, t in pairs]),
                      shards, f"test member {i}", "member 0", 10.0, "broadcast")

    results, failures = _broadcast(node, weights, taking=taking)
    assert failures == [{}]
    for i, how in ((1, "device"), (2, "host")):
        (got, came), = results[i]
        assert came == how
        pairs = dict(got)
        assert set(pairs) == {"engine.layer.w", "engine.layer.b"}
        want = weights["layer.w"].chunk(2, 1)[i - 1].double()
        assert pairs["engine.layer.w"].dtype == torch.float64
        assert torch.equal(pairs["engine.layer.w"], want)
        assert torch.equal(pairs["engine.layer.b"], weights["layer.b"])
