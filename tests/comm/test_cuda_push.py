"""The pushed weight sync (:mod:`rlcomm.comm.transports.cuda_push`) on the fake device
layer (``tests/comm/fake_device.py``: asynchronous streams, interprocess events, a caching
allocator that hands a freed block out again at once): one source and its receivers, each
"process" a :class:`FakeDevice` of one GPU, linked by real sockets through a real store.

The ordering rules, one test each (``scripts/check_cuda_rules.py`` removes each and sees
its test fail):

- registering records the receiver's *free* after the work queued on its stream (its
  own writes to the tensors come before the source's first copy);
- a push's copies wait for the caller's stream (the source's values are written) and for
  each receiver's *free* (its reads of the last version are done);
- *ready* is recorded after the copies; the caller's stream waits for it (writes to the
  source's tensors come after the copies);
- an update orders the receiver's stream after *ready* (its reads see the new version).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from rlcomm.comm.store.client import StoreClient, StoreServer
from rlcomm.comm.transports.cuda_device import Share
from rlcomm.comm.transports.cuda_push import (
    PushSource,
    PushTarget,
    Registration,
    TensorSpec,
    _encode,
    check_registration,
    named_tensors,
    register,
)
from rlcomm.errors import CommTimeoutError, PeerLostError, ProtocolMismatchError
from tests.comm.fake_device import FakeDevice, held

CPU = torch.device("cpu")
#: Latency of a slowed stream: its work comes well after what the other side queues.
SLOW = 0.05
SECRET = b"p" * 32


def _deadline(seconds: float = 10) -> float:
    return time.monotonic() + seconds


class Job:
    """One source and its receivers on fake devices of one GPU, linked through one
    store server (the source's mailbox, in a job)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], receivers: int = 2,
                 latency: float = 0.001):
        self.server = StoreServer("127.0.0.1", SECRET)
        self.dev = FakeDevice(latency=latency)
        self.src = {k: self.dev.tensor(torch.zeros(s)) for k, s in shapes.items()}
        self.source = PushSource(self.src, CPU, self.dev)
        self.devs: list[FakeDevice] = []
        self.params: list[dict[str, torch.Tensor]] = []
        self.targets: list[PushTarget] = []
        for i in range(receivers):
            dev = FakeDevice(latency=latency)
            self.devs.append(dev)
            self.params.append({k: dev.tensor(torch.full(s, -5.0)) for k, s in shapes.items()})
            self.targets.append(self.join(f"r{i}", self.params[i], dev))

    def store(self, name: str) -> StoreClient:
        return StoreClient("127.0.0.1", self.server.port, SECRET, 30).prefixed(f"push/w/{name}")

    def join(self, name: str, params: dict[str, torch.Tensor], dev: FakeDevice,
             pid: int | None = None) -> PushTarget:
        """Register ``params`` as receiver ``name`` while the source attaches it."""
        got: dict = {}

        def reg() -> None:
            try:
                got["target"] = register(self.store(name), params, dev.current, "source",
                                         os.getpid(), _deadline(), dev)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                got["error"] = exc

        t = threading.Thread(target=reg)
        t.start()
        try:
            self.source.attach(self.store(name), name, os.getpid() if pid is None else pid,
                               _deadline())
        finally:
            t.join(timeout=15)
        if "error" in got:
            raise got["error"]
        return got["target"]

    def add(self, name: str, dev: FakeDevice, params: dict[str, torch.Tensor]) -> None:
        """A receiver more, ``params`` on ``dev``, registered as ``name``."""
        self.devs.append(dev)
        self.params.append(params)
        self.targets.append(self.join(name, params, dev))

    def write(self, value: float) -> None:
        """The trainer's step: new values in the source's tensors, on its stream."""
        for t in self.src.values():
            self.dev.launch(lambda t=t: t.fill_(value))

    def push(self) -> int:
        return self.source.push(self.dev.current, _deadline())

    def update(self, i: int) -> int:
        return self.targets[i].update(self.devs[i].current, _deadline())

    def seen(self, i: int, key: str) -> torch.Tensor:
        return self.devs[i].read(self.params[i][key])

    def release(self, i: int) -> None:
        """The rollout is done reading this version (its reads are queued)."""
        self.targets[i].release(self.devs[i].current)

    def close(self) -> None:
        for target in self.targets:
            target.close()
        self.source.close()
        for dev in [self.dev, *self.devs]:
            dev.synchronize_all()
        self.server.close()
        errors = [e for dev in [self.dev, *self.devs] for e in dev.errors]
        assert not errors, errors


@pytest.fixture
def job():
    made = Job({"w": (64,), "b": (8, 4)})
    try:
        yield made
    finally:
        made.close()


def test_each_push_writes_every_receiver_and_updates_see_it(job):
    for step in range(1, 6):
        job.write(float(step))
        assert job.push() == step
        for i in range(2):
            assert job.update(i) == step
            assert torch.equal(job.seen(i, "w"), torch.full((64,), float(step)))
            assert torch.equal(job.seen(i, "b"), torch.full((8, 4), float(step)))
            job.release(i)
    # One batched copy per receiver and push; nothing opened or closed after set-up.
    assert job.dev.copies == 2 * 5
    assert job.dev.closes == 0 and all(dev.closes == 0 for dev in job.devs)


def test_a_thousand_syncs_allocate_and_close_nothing():
    job = Job({"w": (256,)}, receivers=1, latency=0.0)  # ordering is the other tests' part
    try:
        allocated = (job.dev.allocated, job.devs[0].allocated)
        for step in range(1, 1001):
            job.push()
            assert job.update(0) == step
            job.release(0)
        assert (job.dev.allocated, job.devs[0].allocated) == allocated
        assert job.dev.closes == 0 and job.devs[0].closes == 0
    finally:
        job.close()


def test_a_receiver_may_register_a_subset_of_the_sources_tensors():
    job = Job({"w": (16,), "extra": (4,)}, receivers=0)
    try:
        dev = FakeDevice()
        job.add("r0", dev, {"w": dev.tensor(torch.zeros(16))})
        job.write(3.0)
        job.push()
        job.update(0)
        assert torch.equal(job.seen(0, "w"), torch.full((16,), 3.0))
    finally:
        job.close()


# -- ordering rules ----------------------------------------------------------------------------


def test_a_push_copies_the_sources_values_after_the_callers_writes(job):
    """push: the push stream waits for the caller's stream."""
    job.dev.current.latency = SLOW  # the trainer's step is still queued
    job.write(4.0)
    job.push()
    job.update(0)
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 4.0))


def test_a_push_writes_a_receivers_tensors_after_its_reads_of_the_last_version(job):
    """push: the copies wait for the receiver's *free*."""
    job.write(1.0)
    job.push()
    job.update(0)
    job.update(1)
    job.release(1)
    dev = job.devs[0]
    dev.current.latency = SLOW  # the rollout's forward pass reads its weights late
    read: list[torch.Tensor] = []
    w = job.params[0]["w"]
    dev.launch(lambda: read.append(w.clone()))
    job.write(2.0)
    waiting = threading.Thread(target=job.update, args=(0,))  # releases version 1
    waiting.start()
    job.push()
    waiting.join(timeout=10)
    assert job.targets[0].version == 2
    dev.synchronize_all()
    assert torch.equal(read[0], torch.full((64,), 1.0))


def test_the_source_writes_its_tensors_again_after_the_push_read_them(job):
    """push: *ready* after the copies, and the caller's stream waits for it."""
    job.source._stream.latency = SLOW  # the push's copies come late
    job.write(6.0)
    job.push()
    job.write(-1.0)  # the trainer's next step, on its stream
    job.update(0)
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 6.0))


def test_an_update_orders_the_receivers_reads_after_the_copies(job):
    """update: the receiver's stream waits for the source's *ready*."""
    job.source._stream.latency = SLOW
    job.write(8.0)
    job.push()
    job.update(1)
    assert torch.equal(job.seen(1, "b"), torch.full((8, 4), 8.0))


def test_the_first_push_comes_after_the_receivers_own_writes_before_registering():
    """register: *free* is recorded after the work queued on the receiver's stream."""
    job = Job({"w": (32,)}, receivers=0)
    try:
        dev = FakeDevice()
        dev.current.latency = SLOW  # the rollout's own load of its weights is queued
        w = dev.tensor(torch.zeros(32))
        dev.launch(lambda: w.fill_(7.0))
        job.add("r0", dev, {"w": w})
        job.write(9.0)
        job.push()
        job.update(0)
        assert torch.equal(job.seen(0, "w"), torch.full((32,), 9.0))
    finally:
        job.close()


def test_a_release_lets_the_source_write_only_after_the_reads_queued_before_it(job):
    """release: *free* is recorded after the work queued on the receiver's stream."""
    job.write(1.0)
    job.push()
    for i in range(2):
        job.update(i)
    dev = job.devs[1]
    dev.current.latency = SLOW
    read: list[torch.Tensor] = []
    b = job.params[1]["b"]
    dev.launch(lambda: read.append(b.clone()))
    job.release(0)
    job.release(1)
    job.write(2.0)
    job.push()
    dev.synchronize_all()
    assert torch.equal(read[0], torch.full((8, 4), 1.0))
    assert job.update(1) == 2


def test_a_push_may_take_other_tensors_of_the_same_names_and_shapes(job):
    other = {"w": job.dev.tensor(torch.full((64,), 11.0)), "b": job.dev.tensor(torch.ones(8, 4))}
    job.source.push(job.dev.current, _deadline(), tensors=other)
    job.update(0)
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 11.0))
    with pytest.raises(ValueError, match="'b' is torch.float32 \\(2, 16\\)"):
        job.source.push(job.dev.current, _deadline(),
                        tensors={"w": other["w"], "b": job.dev.tensor(torch.ones(2, 16))})


# -- refusals, timeouts and faults ------------------------------------------------------------


def test_a_receiver_whose_tensors_differ_is_refused_on_both_sides():
    job = Job({"w": (16,), "b": (4,)}, receivers=0)
    try:
        dev = FakeDevice()
        with pytest.raises(ProtocolMismatchError, match=r"'b' is float32 \(5,\) at the receiver "
                                                        r"but float32 \(4,\) at the source") as got:
            job.join("r0", {"w": dev.tensor(torch.zeros(16)), "b": dev.tensor(torch.zeros(5))}, dev)
        assert "refused" in str(got.value)
        with pytest.raises(ProtocolMismatchError, match="has no tensor named 'c'"):
            job.join("r0", {"c": dev.tensor(torch.zeros(16))}, dev)
        assert job.source.receivers == []
    finally:
        job.close()


def test_a_receiver_on_another_gpu_is_told_to_use_broadcast():
    job = Job({"w": (16,)}, receivers=0)
    try:
        dev = FakeDevice(gpu="GPU-other")
        with pytest.raises(ProtocolMismatchError, match="needs both on one GPU .use broadcast"):
            job.join("r0", {"w": dev.tensor(torch.zeros(16))}, dev)
    finally:
        job.close()


def test_a_receiver_that_does_not_release_times_the_push_out_and_nothing_is_written(job):
    job.write(1.0)
    job.push()
    job.update(0)
    job.update(1)
    job.release(1)
    job.write(2.0)
    with pytest.raises(CommTimeoutError, match="to r0: it has not released version 1") as got:
        job.source.push(job.dev.current, _deadline(0.3))
    assert got.value.peer == "r0"
    assert job.source.version == 1
    assert torch.equal(job.seen(1, "w"), torch.full((64,), 1.0))
    job.release(0)
    assert job.push() == 2
    assert job.update(0) == 2 and job.update(1) == 2
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 2.0))


def test_an_update_without_a_push_times_out_and_the_next_push_still_comes(job):
    with pytest.raises(CommTimeoutError, match="weight update from source .holding version 0."):
        job.targets[0].update(job.devs[0].current, _deadline(0.2))
    job.write(5.0)
    job.push()
    assert job.update(0) == 1
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 5.0))


def test_a_receiver_that_closes_is_left_out_of_later_pushes(job):
    job.push()
    job.update(0)
    job.release(0)
    job.targets[1].close()
    job.write(3.0)
    assert job.dev.opened == 4  # each receiver's two storages, open at the source
    assert job.push() == 2  # no error: r1 left cleanly
    assert job.source.receivers == ["r0"]
    assert job.dev.opened == 2  # what it opened of r1's is closed
    assert job.update(0) == 2
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 3.0))


def test_a_receiver_whose_process_is_gone_fails_one_push_by_name_and_the_others_get_it(job):
    job.push()
    job.update(0)
    job.update(1)
    job.release(0)
    job.targets[1]._link.sock.close()  # what the kernel does when the process dies
    job.write(4.0)
    with pytest.raises(PeerLostError, match="r1 is left out from now on") as got:
        job.push()
    assert got.value.peer == "r1"
    assert job.source.receivers == ["r0"]
    assert job.update(0) == 2
    assert torch.equal(job.seen(0, "w"), torch.full((64,), 4.0))
    job.release(0)
    assert job.push() == 3


def test_a_closed_source_ends_its_receivers_updates(job):
    job.source.close()
    with pytest.raises(PeerLostError, match="the source closed its weight push"):
        job.update(0)
    with pytest.raises(PeerLostError, match="failed earlier"):
        job.update(0)


def test_a_receiver_lets_go_of_its_memory_when_the_source_is_gone(job):
    shares = list(job.targets[0]._shares)
    assert shares and all(held(s) == 1 for s in shares)
    for receiver in job.source._receivers.values():
        receiver.link.sock.close()  # the source's process died
    with pytest.raises(PeerLostError, match="source's process is gone"):
        job.update(0)
    assert all(held(s) == 0 for s in shares)


def test_a_stale_registration_of_another_process_is_dropped():
    job = Job({"w": (16,)}, receivers=0)
    try:
        dev = FakeDevice()
        stale = Registration("dead", 1, dev.gpu, b"", [], [])
        job.store("r0").set("registration", _encode(stale))
        job.add("r0", dev, {"w": dev.tensor(torch.zeros(16))})
        job.write(2.0)
        job.push()
        job.update(0)
        assert torch.equal(job.seen(0, "w"), torch.full((16,), 2.0))
    finally:
        job.close()


def test_a_malformed_registration_is_refused_before_anything_is_opened():
    job = Job({"w": (16,)}, receivers=0)
    try:
        job.store("r0").set("registration", b"\x93not a registration")
        with pytest.raises(ProtocolMismatchError, match="a malformed registration"):
            job.source.attach(job.store("r0"), "r0", os.getpid(), _deadline())
    finally:
        job.close()


# -- pure parts ---------------------------------------------------------------------------------

_SHARE = Share(b"h" * 64, 1024, 0, b"/c", 0)
_SOURCES = {"w": torch.zeros(16), "b": torch.zeros(2, 2, dtype=torch.bfloat16)}


@pytest.mark.parametrize("spec,reason", [
    (TensorSpec("w", "float32", [16], 0, 0, 64), ""),
    (TensorSpec("x", "float32", [16], 0, 0, 64), "has no tensor named 'x'"),
    (TensorSpec("w", "float16", [16], 0, 0, 32), "'w' is float16 (16,) at the receiver"),
    (TensorSpec("w", "float32", [4, 4], 0, 0, 64), "(4, 4) at the receiver"),
    (TensorSpec("w", "float32", [16], 0, 0, 60), "60 bytes do not fit"),
    (TensorSpec("w", "float32", [16], 1, 0, 64), "names allocation 1 of 1"),
    (TensorSpec("w", "float32", [16], 0, 1000, 64), "lies outside its allocation of 1024"),
    (TensorSpec("w", "float32", [16], 0, -64, 64), "lies outside"),
    (TensorSpec("b", "bfloat16", [2, 2], 0, 64, 8), ""),
])
def test_a_registration_is_checked_against_the_sources_tensors(spec, reason):
    reg = Registration("t", 1, "GPU-a", b"", [_SHARE], [spec])
    got = check_registration(reg, _SOURCES, "GPU-a")
    assert (reason in got) if reason else got == ""
    assert reason or got == ""


def test_a_registration_names_each_tensor_once_and_lies_on_the_sources_gpu():
    spec = TensorSpec("w", "float32", [16], 0, 0, 64)
    assert "registered twice" in check_registration(
        Registration("t", 1, "GPU-a", b"", [_SHARE], [spec, spec]), _SOURCES, "GPU-a")
    assert "lie on GPU GPU-b" in check_registration(
        Registration("t", 1, "GPU-b", b"", [_SHARE], [spec]), _SOURCES, "GPU-a")


def test_named_tensors_takes_a_dict_a_list_or_one_tensor():
    t = torch.zeros(2)
    assert named_tensors({"a": t}, "x") == {"a": t}
    assert list(named_tensors([t, t], "x")) == ["0", "1"]
    assert list(named_tensors(t, "x")) == [""]
    with pytest.raises(TypeError, match="'a' is a int, not a tensor"):
        named_tensors({"a": 1}, "x")
    with pytest.raises(ValueError, match="no tensors"):
        named_tensors({}, "x")
    with pytest.raises(TypeError, match="got str"):
        named_tensors("w", "x")


def test_a_receiver_that_registers_after_some_pushes_takes_the_next_one(job):
    for step in (1, 2):
        job.write(float(step))
        job.push()
        for i in range(2):
            job.update(i)
            job.release(i)
    dev = FakeDevice()
    job.add("late", dev, {"w": dev.tensor(torch.zeros(64)), "b": dev.tensor(torch.zeros(8, 4))})
    assert job.targets[2].version == 2
    job.write(3.0)
    assert job.push() == 3
    assert [job.update(i) for i in range(3)] == [3, 3, 3]
    assert torch.equal(job.seen(2, "w"), torch.full((64,), 3.0))
