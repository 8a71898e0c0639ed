"""Handed-over memory (``rlcomm.empty``): same-node sends pass the memfd, not the bytes.

Transport-level cases run both ends of a real shared-memory transport in this process;
the worker case runs two real Ray workers.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import time

import pytest
import torch

import rlcomm
from rlcomm import AuthenticationError, NodePlacementStrategy, ProtocolMismatchError, Worker
from rlcomm.comm.transports import shm, shm_handover, shm_peer, shm_ring
from rlcomm.comm.transports.shm_memory import sealed_memfd
from tests.comm.pairs import transport_pair, two_stores


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


N = 1 << 20  # float32 elements: 4 MiB, well above the segment threshold


@pytest.fixture
def ends():
    a, b = transport_pair(two_stores(), "h")
    yield a, b
    a.close()
    b.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _send_and_take(ends, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    a, b = ends
    payload = [as_bytes(t) for t in tensors]
    a.send_frame(b"frame", payload, 10)
    assert b.recv_frame(10) == b"frame"
    return b.recv_new([p.numel() for p in payload], 10)


def test_empty_is_a_normal_tensor():
    x = rlcomm.empty(3, 4, dtype=torch.int64)
    assert x.shape == (3, 4) and x.dtype == torch.int64 and x.is_contiguous()
    x.fill_(7)
    assert int(x.sum()) == 84
    assert rlcomm.empty_like(x).shape == (3, 4)
    assert rlcomm.empty((2, 2)).dtype == torch.float32
    assert shm_handover.is_handed_over(x) and shm_handover.is_handed_over(x[1])
    assert not shm_handover.is_handed_over(torch.empty(3, 4))
    assert not shm_handover.is_handed_over(x.t())  # not contiguous: copied as before
    with pytest.raises(ValueError, match="shape"):
        rlcomm.empty(-1)
    with pytest.raises(TypeError, match="dtype"):
        rlcomm.empty(2, dtype="float32")


def test_a_handed_over_tensor_travels_without_a_copy(ends):
    x = rlcomm.empty(N)
    torch.arange(N, out=x)
    part = x[1234 : 1234 + N // 2]  # a slice at an offset that is not page-aligned
    got, got_part = _send_and_take(ends, [x, part])
    assert torch.equal(got.view(torch.float32), x)
    assert torch.equal(got_part.view(torch.float32), part)
    assert ends[0]._pool.segments == []  # no segment was filled: nothing was copied
    # The receiver's views are private: what it writes, the sender never sees.
    got.view(torch.float32)[:10] = -1
    assert float(x[0]) == 0.0 and float(got.view(torch.float32)[0]) == -1.0


def test_the_sender_may_drop_its_tensor_right_after_the_send(ends):
    a, b = ends
    x = rlcomm.empty(N, dtype=torch.int32)
    x.fill_(5)
    a.send_frame(b"f", [as_bytes(x)], 10)
    del x
    gc.collect()
    assert not shm_handover._blocks  # the sender's block is gone...
    assert b.recv_frame(10) == b"f"
    (got,) = b.recv_new([N * 4], 10)
    assert int(got.view(torch.int32).sum()) == 5 * N  # ...and the receiver still has it


def test_recv_into_copies_out_of_a_handed_over_tensor(ends):
    a, b = ends
    x = rlcomm.empty(N)
    x.fill_(2.5)
    a.send_frame(b"f", [as_bytes(x)], 10)
    out = torch.zeros(N)
    assert b.recv_frame(10) == b"f"
    b.recv_into([as_bytes(out)], 10)
    assert torch.equal(out, x)


def test_no_fd_or_mapping_outlives_the_tensors(ends):
    for _ in range(2):  # the first round may open lasting fds (pollers, caches)
        before = _open_fds()
        xs = [rlcomm.empty(N) for _ in range(4)]
        got = _send_and_take(ends, xs)
        del xs, got
        gc.collect()
    assert _open_fds() == before
    assert not shm_handover._blocks


def test_small_and_mixed_payloads_keep_the_copying_path(ends):
    small = rlcomm.empty(16)  # below the segment threshold: rides the ring
    small.fill_(1)
    plain = torch.full((N,), 3.0)  # not handed over: goes through a segment
    big = rlcomm.empty(N)
    big.fill_(4)
    got = _send_and_take(ends, [small, plain, big])
    assert [float(g.view(torch.float32)[0]) for g in got] == [1.0, 3.0, 4.0]
    assert len(ends[0]._pool.segments) == 1


def _forge(sender: shm.ShmTransport, fd: int, offset: int, nbytes: int) -> None:
    """Write a handed-over record the way a hostile peer of this user could."""
    socket.send_fds(sender._signals.out, [b"h" + struct.pack("<QQ", offset, nbytes)], [fd])
    writer = sender._writer
    writer.write(shm_ring.RECORD.pack(shm_ring.FRAME, 0, 1) + b"f", time.monotonic() + 5)
    writer.write(shm_ring.RECORD.pack(shm_ring.HANDED_RECORD, 0, nbytes), time.monotonic() + 5)
    writer.wake_reader()


def _unsealed(size: int) -> int:
    fd = os.memfd_create("hostile")  # could be shrunk under the reader: SIGBUS
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize("make_fd, error, match", [
    (lambda: _unsealed(N), AuthenticationError, "not sealed"),
    (lambda: sealed_memfd("short", 4096), ProtocolMismatchError, "cannot hold"),  # too short
], ids=["unsealed", "range-past-the-end"])
def test_a_forged_handed_over_fd_is_refused(ends, make_fd, error, match):
    a, b = ends
    fd = make_fd()
    try:
        _forge(a, fd, 0, N)
    finally:
        os.close(fd)
    assert b.recv_frame(10) == b"f"
    with pytest.raises(error, match=match):
        b.recv_new([N], 10)


def test_fds_passed_ahead_of_any_message_are_bounded(ends, monkeypatch):
    """A peer that floods the signal socket with handed-over fds no message uses fails
    the connection instead of filling this process's fd table."""
    monkeypatch.setattr(shm_peer, "MAX_HANDED_AHEAD", 3)
    a, b = ends
    before = _open_fds()
    fd = sealed_memfd("flood", 4096)
    try:
        for _ in range(4):
            socket.send_fds(a._signals.out, [b"h" + struct.pack("<QQ", 0, 4096)], [fd])
    finally:
        os.close(fd)
    a._writer.write(shm_ring.RECORD.pack(shm_ring.FRAME, 0, 1) + b"f", time.monotonic() + 5)
    a._writer.wake_reader()
    with pytest.raises(ProtocolMismatchError, match="no message uses"):
        for _ in range(5):  # reading the socket happens while waiting for data
            b.read_signal()
    b.close()
    assert _open_fds() <= before


class Producer(Worker):
    def produce(self, n):
        self._batch = {"obs": rlcomm.empty(n, 4), "rew": rlcomm.empty(n)}
        self._batch["obs"].fill_(1.0)
        torch.arange(n, out=self._batch["rew"])
        self.send(self._batch, "ho_consumer", 0)
        return True

    def unchanged(self):
        return float(self._batch["obs"].sum()), float(self._batch["rew"][0])


class Consumer(Worker):
    def consume(self):
        batch = self.recv("ho_producer", 0)
        sums = float(batch["obs"].sum()), float(batch["rew"].sum())
        batch["obs"].zero_()  # its own copy-on-write pages
        batch["rew"][0] = 99
        return sums


def test_a_rollout_dict_between_workers(cluster):
    prod = Producer.create_group().launch(cluster, NodePlacementStrategy([0]), name="ho_producer")
    cons = Consumer.create_group().launch(cluster, NodePlacementStrategy([0]), name="ho_consumer")
    try:
        n = 1 << 18
        done = cons.consume()
        assert prod.produce(n).wait() == [True]
        assert done.wait() == [(4.0 * n, float(n * (n - 1) / 2))]
        assert prod.unchanged().wait() == [(4.0 * n, 0.0)]
    finally:
        prod.shutdown()
        cons.shutdown()


class Syncer(Worker):
    """A weight sync: rank 0 broadcasts a state dict made with ``rlcomm.empty``."""

    def sync(self, step, n):
        weights = None
        if self._rank == 0:
            weights = {f"w{i}": rlcomm.empty(n) for i in range(3)}
            for i, t in enumerate(weights.values()):
                t.fill_(step + i)
            # A small tensor of ordinary memory beside them: it is copied into a small
            # block of its own, and the message still goes by fds (no slot).
            weights["step"] = torch.tensor([step], dtype=torch.int64)
        got = self.broadcast(weights, groups=[("ho_sync", [0, 1, 2])], src=("ho_sync", 0))
        sums = [float(t.sum()) for t in got.values()]
        if self._rank == 1:  # its pages are its own: no one else sees this
            for t in got.values():
                t.zero_()
        self._held = got
        return sums, self.broadcast_pool_bytes()

    def broadcast_pool_bytes(self):
        return sum(g.pool_bytes for g in self._comm._bcast.values())

    def held_sums(self):
        return [float(t.sum()) for t in self._held.values()]


def test_a_weight_sync_hands_the_state_dict_to_every_member(cluster):
    group = Syncer.create_group().launch(cluster, NodePlacementStrategy([0] * 3), name="ho_sync")
    try:
        n = 1 << 18
        for step in (1, 5):
            got = group.sync(step, n).wait()
            want = [float(n * (step + i)) for i in range(3)] + [float(step)]
            assert got == [(want, 0)] * 3  # and no slot was filled: nothing was copied
            assert group.held_sums().wait() == [want, [0.0] * 4, want]
    finally:
        group.shutdown()
