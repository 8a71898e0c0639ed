"""Point-to-point send/recv between workers: real Ray actors, real Gloo."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import ray
import torch
import torch.distributed as dist

from rlcomm import (
    CollectiveGroupOptions,
    CommTimeoutError,
    NodePlacementStrategy,
    OptionsMismatchError,
    PeerLostError,
    PeerNotFoundError,
    ProtocolMismatchError,
    Worker,
)
from tests.waiting import wait_op_under_way

SEND, RECV = "p2p_send", "p2p_recv"
FAST = CollectiveGroupOptions(timeout=20)


@dataclass
class Batch:
    obs: torch.Tensor
    actions: list
    version: int


class SendWorker(Worker):
    def hello_recv(self):
        peer = self._rank
        self.send(f"Hello from SendWorker Rank {self._rank}!", RECV, peer)
        reply = self.recv(RECV, peer)
        dst = (self._rank + 1) % self._world_size
        self.send(torch.ones(1, 1), RECV, dst)
        self.send([torch.tensor(1.0) for _ in range(4)], RECV, dst)
        self.send({"tensor1": torch.tensor(2.0), "tensor2": torch.tensor(3.0)}, RECV, dst)
        self.send(Batch(torch.arange(6.0).view(2, 3), [torch.ones(2, dtype=torch.bool)], 7), RECV, dst)
        self.send(torch.ones(1 << 20), RECV, dst, piggyback_payload={"version": 3})
        self.send_tensor(torch.ones(2, 1), RECV, dst)
        return reply

    def hello_recv_async(self):
        dst = (self._rank + 1) % self._world_size
        work = self.send(torch.ones(3, 1), RECV, dst, async_op=True)
        assert work.wait() is None

        async def send_async():
            w = self.send(torch.ones(4, 1), RECV, dst, async_op=True)
            await w.async_wait()
            return w.done()

        return asyncio.run(send_async())


class RecvWorker(Worker):
    def hello_recv(self):
        msg = self.recv(SEND, self._rank)
        self.send(f"Hello from RecvWorker Rank {self._rank}!", SEND, self._rank)
        src = (self._rank - 1) % self._world_size
        tensor = self.recv(SEND, src)
        tensor_list = self.recv(SEND, src)
        tensor_dict = self.recv(SEND, src)
        batch = self.recv(SEND, src)
        big, payload = self.recv(SEND, src)
        buf = torch.empty(2, 1)
        self.recv_tensor(buf, SEND, src)
        return {
            "msg": msg,
            "tensor": tensor.tolist(),
            "list": [t.item() for t in tensor_list],
            "dict": {k: v.item() for k, v in tensor_dict.items()},
            "batch": (type(batch).__name__, batch.obs.tolist(), batch.actions[0].dtype, batch.version),
            "big": (big.numel(), big.sum().item(), payload),
            "in_place": buf.tolist(),
        }

    def hello_recv_async(self):
        src = (self._rank - 1) % self._world_size
        first = self.recv(SEND, src, async_op=True).wait()

        async def recv_async():
            return await self.recv(SEND, src, async_op=True).async_wait()

        second = asyncio.run(recv_async())
        return first.shape, second.shape


@pytest.fixture(scope="module")
def pairs(cluster):
    send = SendWorker.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name=SEND)
    recv = RecvWorker.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name=RECV)
    yield send, recv
    send.shutdown()
    recv.shutdown()


def test_seed_send_recv_example(pairs):
    send, recv = pairs
    a, b = send.hello_recv(), recv.hello_recv()
    assert a.wait(timeout=60) == ["Hello from RecvWorker Rank 0!", "Hello from RecvWorker Rank 1!"]
    results = b.wait(timeout=60)
    for rank, r in enumerate(results):
        assert r["msg"] == f"Hello from SendWorker Rank {rank}!"
        assert r["tensor"] == [[1.0]]
        assert r["list"] == [1.0] * 4
        assert r["dict"] == {"tensor1": 2.0, "tensor2": 3.0}
        assert r["batch"] == ("Batch", [[0, 1, 2], [3, 4, 5]], torch.bool, 7)
        assert r["big"] == (1 << 20, float(1 << 20), {"version": 3})
        assert r["in_place"] == [[1.0], [1.0]]


def test_seed_async_example(pairs):
    send, recv = pairs
    a, b = send.hello_recv_async(), recv.hello_recv_async()
    assert a.wait(timeout=60) == [True, True]
    assert b.wait(timeout=60) == [(torch.Size([3, 1]), torch.Size([4, 1]))] * 2


class Peer(Worker):
    """A general-purpose worker for the pattern tests (groups: p2p_a, p2p_b)."""

    def ring(self, order):
        me = (self.worker_group_name, self._rank)
        i = order.index(list(me))
        nxt, prv = order[(i + 1) % len(order)], order[i - 1]
        work = self.send(torch.tensor([i]), nxt[0], nxt[1], async_op=True)
        got = self.recv(prv[0], prv[1])
        work.wait()
        # The user's own default process group still works beside rlcomm's groups.
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        return got.item(), t.item()

    def both_async_first(self, peer_group, peer_rank):
        s = self.send({"from": torch.tensor(self._rank)}, peer_group, peer_rank, async_op=True)
        r = self.recv(peer_group, peer_rank, async_op=True)
        s.wait()
        return r.wait()["from"].item()

    def fan_out(self, group, ranks):
        works = [self.send(f"to {r}", group, r, async_op=True) for r in ranks]
        return [w.wait() for w in works]

    def recv_later(self, group, rank, delay):
        time.sleep(delay)
        return self.recv(group, rank)

    def threaded_send(self, group, ranks, n):
        def run(tid):
            for i in range(n):
                for r in ranks:
                    self.send((tid, i, torch.full((3,), float(i))), group, r)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return True

    def threaded_recv(self, group, rank, n):
        got = []
        lock = threading.Lock()

        def run():
            for _ in range(n):
                item = self.recv(group, rank)
                with lock:
                    got.append(item)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        ok = all(torch.equal(x, torch.full((3,), float(i))) for _, i, x in got)
        return sorted((tid, i) for tid, i, _ in got), ok

    def uvloop_recv(self, group, rank):
        import uvloop

        async def main():
            loop_name = type(asyncio.get_running_loop()).__module__
            obj = await self.recv(group, rank, async_op=True).async_wait()
            await self.send(obj * 2, group, rank, async_op=True)
            return loop_name, obj.tolist()

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        try:
            return asyncio.run(main())
        finally:
            asyncio.set_event_loop_policy(None)

    def send_one(self, obj, group, rank, **kw):
        self.send(obj, group, rank, **kw)
        return True

    def recv_one(self, group, rank, **kw):
        return self.recv(group, rank, **kw)

    def recv_into(self, group, rank, into, **kw):
        """Receive into ``into`` (made here, as a worker's parameters would be); returns
        what came back, whether it is ``into`` itself, and the values."""
        got = self.recv(group, rank, into=into, **kw)
        obj = got[0] if isinstance(got, tuple) else got
        return got, obj is into

    def send_unpicklable(self, group, rank):
        self.send({"lock": threading.Lock()}, group, rank)

    def send_tensor_one(self, tensor, group, rank):
        self.send_tensor(tensor, group, rank)
        return True

    def recv_tensor_one(self, shape, dtype, group, rank, **kw):
        buf = torch.zeros(shape, dtype=dtype)
        self.recv_tensor(buf, group, rank, **kw)
        return buf

    def recv_then_expect_error(self, group, rank, op, *args, **kwargs):
        """Receive once, then at once call ``op`` as :meth:`expect_error` does (a receive
        right after one that read takes its ticket and the stream in one transition)."""
        first = self.recv(group, rank)
        return first, self.expect_error(op, *args, **kwargs)

    def expect_error(self, op, *args, **kwargs):
        start = time.monotonic()
        try:
            getattr(self, op)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None, "", time.monotonic() - start

    def transport_to(self, group, rank):
        return self._comm.connection(self._comm.address.__class__.of(group, rank), None).transport_name

    def send_many(self, group, rank, sizes, options=None):
        for i, n in enumerate(sizes):
            self.send(torch.full((n,), i, dtype=torch.int32), group, rank, options=options)
        return True

    def recv_many_any(self, group, rank, count):
        return [self.recv(group, rank) for _ in range(count)]

    def recv_many(self, group, rank, count, hold=False, options=None):
        got = [self.recv(group, rank, options=options) for _ in range(count)]
        ok = all(bool((t == i).all()) for i, t in enumerate(got))
        return ok, [t.numel() for t in got]

    def broadcast_from(self, obj, groups, src):
        return self.broadcast(obj, groups=groups, src=src)

    def small_between_async(self, group, rank, items):
        """Send ``items`` in order: ``("big", i)`` as an async send of a 1 MiB tensor
        filled with ``i``, anything else with a blocking send. Returns the (op, bytes) of
        the sends that the flight recorder shows, in order."""
        from rlcomm.comm.flight import RECORDER

        first = max((op.key for op in RECORDER.recent()), default=0)
        works = []
        for item in items:
            if isinstance(item, tuple):
                works.append(self.send(torch.full((1 << 18,), float(item[1])), group, rank,
                                       async_op=True))
            else:
                self.send(item, group, rank)
        for w in works:
            w.wait()
        return [(op.op, op.nbytes) for op in RECORDER.recent() if op.key > first]


@pytest.fixture(scope="module")
def peers(cluster):
    a = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="p2p_a")
    b = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 0, 0]), name="p2p_b")
    yield a, b
    a.shutdown()
    b.shutdown()


def test_ring_across_two_groups_and_user_process_group(cluster):
    a = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="ring_a")
    b = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="ring_b")
    try:
        order = [["ring_a", 0], ["ring_b", 0], ["ring_a", 1], ["ring_b", 1]]
        ha, hb = a.ring(order), b.ring(order)
        # ring position i receives from i - 1; all_reduce runs within each group of 2.
        assert ha.wait(timeout=60) == [(3, 2.0), (1, 2.0)]
        assert hb.wait(timeout=60) == [(0, 2.0), (2, 2.0)]
    finally:
        a.shutdown()
        b.shutdown()


def test_both_ends_async_first(peers):
    a, b = peers
    ha = a.execute_on(1).both_async_first("p2p_b", 2)
    hb = b.execute_on(2).both_async_first("p2p_a", 1)
    assert ha.wait(timeout=60) == [2] and hb.wait(timeout=60) == [1]


def test_fan_out_before_any_recv(peers):
    a, b = peers
    # Every send completes before any receiver calls recv: nothing waits on call order.
    assert a.execute_on(0).fan_out("p2p_b", [0, 1, 2]).wait(timeout=60) == [[None] * 3]
    got = b.recv_later("p2p_a", 0, 0.0).wait(timeout=60)
    assert got == ["to 0", "to 1", "to 2"]


def test_two_threads_per_worker(peers):
    a, b = peers
    n = 30
    hs = a.execute_on(0).threaded_send("p2p_b", [0, 1], n)
    hr = b.execute_on(0, 1).threaded_recv("p2p_a", 0, n)
    assert hs.wait(timeout=90) == [True]
    for ids, ok in hr.wait(timeout=90):
        assert ok
        assert ids == sorted((tid, i) for tid in range(2) for i in range(n))


def test_uvloop(peers):
    a, b = peers
    hb = b.execute_on(1).uvloop_recv("p2p_a", 1)
    a.execute_on(1).send_one(torch.arange(3), "p2p_b", 1).wait(timeout=30)
    got = a.execute_on(1).recv_one("p2p_b", 1).wait(timeout=30)
    assert hb.wait(timeout=30) == [("uvloop", [0, 1, 2])]
    assert got[0].tolist() == [0, 2, 4]


def test_broadcast_to_two_groups(peers, cluster):
    a, b = peers
    groups = [("p2p_a", [0, 1]), ("p2p_b", [0, 2])]
    payload = {"w": torch.arange(10.0), "b": torch.ones(2, 2)}
    src = ("p2p_a", 1)
    ha = a.broadcast_from(payload, groups, src)
    hb = b.execute_on(0, 2).broadcast_from(None, groups, src)
    for got in ha.wait(timeout=60) + hb.wait(timeout=60):
        assert set(got) == {"w", "b"} and torch.equal(got["w"], payload["w"])
    # A second broadcast reuses the group; a big payload goes beyond the frame.
    big = torch.randn(1 << 18)
    ha = a.execute_on(0).broadcast_from(big, [("p2p_a", 0), ("p2p_b", 1)], None)
    hb = b.execute_on(1).broadcast_from(None, [("p2p_a", 0), ("p2p_b", 1)], None)
    assert torch.equal(hb.wait(timeout=60)[0], big) and torch.equal(ha.wait(timeout=60)[0], big)


def test_small_messages_keep_call_order_with_async_sends(peers):
    """Small tensors and bytes leave as one frame each, from the calling thread, unless
    async sends are queued ahead of them: then they wait their turn. Tensors that the
    frame cannot carry as they are (bfloat16 goes another way in, a transposed or
    grad-requiring tensor the general way) arrive all the same."""
    a, b = peers
    items = [
        b"abcd", torch.tensor([1.5]), ("big", 1), b"after a queued send",
        torch.ones(2, 3, dtype=torch.bfloat16), ("big", 2), ("big", 3),
        torch.arange(6).view(2, 3).t(), torch.tensor(7), torch.ones(2, requires_grad=True),
        b"x" * 4000, torch.ones(1000),
    ]
    got = b.execute_on(2).recv_many_any("p2p_a", 1, len(items))
    recorded = a.execute_on(1).small_between_async("p2p_b", 2, items).wait(timeout=60)[0]
    got = got.wait(timeout=60)[0]
    for sent, came in zip(items, got, strict=True):
        if isinstance(sent, tuple):
            assert torch.equal(came, torch.full((1 << 18,), float(sent[1])))
        elif isinstance(sent, bytes):
            assert came == sent
        else:
            assert came.dtype == sent.dtype and torch.equal(came, sent.detach())
            assert not came.requires_grad
    # Each send is recorded once, with its payload's bytes.
    assert recorded == [("send", 4), ("send", 4), ("send", 1 << 20), ("send", 19),
                        ("send", 12), ("send", 1 << 20), ("send", 1 << 20), ("send", 48),
                        ("send", 8), ("send", 8), ("send", 4000), ("send", 4000)]


def test_recv_timeout_then_late_message_is_kept(peers):
    a, b = peers
    name, text, took = a.execute_on(0).expect_error(
        "recv_one", "p2p_b", 1, options=CollectiveGroupOptions(timeout=2)
    ).wait(timeout=30)[0]
    assert name == "CommTimeoutError" and "p2p_b:1" in text and took < 10
    b.execute_on(1).send_one("late", "p2p_a", 0).wait(timeout=30)
    assert a.execute_on(0).recv_one("p2p_b", 1).wait(timeout=30) == ["late"]


def test_a_recv_right_after_one_times_out_once_or_leaves_a_send_tensor_queued(peers):
    """A blocking recv that comes right after one that read its own message reads its
    own too (one transition takes its ticket and the stream): a timeout there is its
    own, not twice its own, and a message it cannot take as it is stays queued."""
    a, b = peers
    b.execute_on(2).send_one("contact", "p2p_a", 1).wait(timeout=30)
    assert a.execute_on(1).recv_one("p2p_b", 2).wait(timeout=30) == ["contact"]

    def first_then(op, *args, **kwargs):
        work = a.execute_on(1).recv_then_expect_error("p2p_b", 2, op, *args, **kwargs)
        wait_op_under_way("p2p_a:1", "recv", "p2p_b:2")  # it reads "first" itself
        b.execute_on(2).send_one("first", "p2p_a", 1).wait(timeout=30)
        return work

    first, (name, text, took) = first_then(
        "recv_one", "p2p_b", 2, options=CollectiveGroupOptions(timeout=3)).wait(timeout=30)[0]
    assert first == "first" and name == "CommTimeoutError" and "within 3" in text
    assert took < 5.5  # its own 3 s, not a second 3 s on the general way
    work = first_then("recv_one", "p2p_b", 2)
    b.execute_on(2).send_tensor_one(torch.arange(3.0), "p2p_a", 1).wait(timeout=30)
    first, (name, text, _) = work.wait(timeout=30)[0]
    assert name == "ProtocolMismatchError" and "recv_tensor()" in text
    got = a.execute_on(1).recv_tensor_one((3,), torch.float32, "p2p_b", 2).wait(timeout=30)[0]
    assert torch.equal(got, torch.arange(3.0))
    b.execute_on(2).send_one(b"after", "p2p_a", 1).wait(timeout=30)
    assert a.execute_on(1).recv_one("p2p_b", 2).wait(timeout=30) == [b"after"]


def test_send_recv_tensor_mismatches(peers):
    a, b = peers
    a.execute_on(0).send_one(torch.ones(4), "p2p_b", 0).wait(timeout=30)
    err = b.execute_on(0).expect_error("recv_tensor_one", (4,), torch.float32, "p2p_a", 0).wait(
        timeout=30
    )[0]
    assert err[0] == "ProtocolMismatchError" and "send()" in err[1]
    # The message stays queued for the right call.
    assert torch.equal(b.execute_on(0).recv_one("p2p_a", 0).wait(timeout=30)[0], torch.ones(4))

    a.execute_on(0).send_tensor_one(torch.ones(2, 3), "p2p_b", 0).wait(timeout=30)
    err = b.execute_on(0).expect_error("recv_one", "p2p_a", 0).wait(timeout=30)[0]
    assert err[0] == "ProtocolMismatchError" and "recv_tensor()" in err[1]
    err = b.execute_on(0).expect_error("recv_tensor_one", (3, 2), torch.float32, "p2p_a", 0).wait(
        timeout=30
    )[0]
    assert err[0] == "ProtocolMismatchError" and "shape (2, 3)" in err[1]
    err = b.execute_on(0).expect_error("recv_tensor_one", (2, 3), torch.int32, "p2p_a", 0).wait(
        timeout=30
    )[0]
    assert err[0] == "ProtocolMismatchError" and "float32" in err[1]
    got = b.execute_on(0).recv_tensor_one((2, 3), torch.float32, "p2p_a", 0).wait(timeout=30)[0]
    assert torch.equal(got, torch.ones(2, 3))


def test_recv_into_existing_tensors(peers):
    a, b = peers
    sent = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    params = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16),
              "extra": torch.zeros(2)}  # keys the message lacks are left alone
    a.execute_on(0).send_one(sent, "p2p_b", 0).wait(timeout=30)
    got, same = b.execute_on(0).recv_into("p2p_a", 0, params).wait(timeout=30)[0]
    assert same and torch.equal(got["w"], sent["w"]) and torch.equal(got["b"], sent["b"])
    assert torch.equal(got["extra"], torch.zeros(2))
    # Lists, one tensor, a piggyback, and a payload past the inline size.
    big = torch.randn(1 << 18)
    a.execute_on(0).send_one([big, torch.ones(2)], "p2p_b", 0).wait(timeout=30)
    got, same = b.execute_on(0).recv_into(
        "p2p_a", 0, [torch.empty(1 << 18), torch.empty(2)]).wait(timeout=30)[0]
    assert same and torch.equal(got[0], big) and torch.equal(got[1], torch.ones(2))
    a.execute_on(0).send_one(torch.full((3,), 7.0), "p2p_b", 0,
                             piggyback_payload={"step": 9}).wait(timeout=30)
    (into, piggyback), _ = b.execute_on(0).recv_into("p2p_a", 0, torch.empty(3)).wait(timeout=30)[0]
    assert torch.equal(into, torch.full((3,), 7.0)) and piggyback == {"step": 9}


def test_recv_into_tensors_that_do_not_fit_keeps_the_message(peers):
    a, b = peers
    a.execute_on(0).send_one({"w": torch.ones(4)}, "p2p_b", 0).wait(timeout=30)
    cases = [
        ({"v": torch.zeros(4)}, "lacks keys ['w']"),
        ({"w": torch.zeros(5)}, "into['w'] is float32 of shape (5,) but the sender sent float32 of shape (4,)"),
        ({"w": torch.zeros(4, dtype=torch.int64)}, "into['w'] is int64"),
        ([torch.zeros(4)], "must be a dict"),
    ]
    for into, text in cases:
        err = b.execute_on(0).expect_error("recv_into", "p2p_a", 0, into).wait(timeout=30)[0]
        assert err[0] == "ProtocolMismatchError" and text in err[1], err
    # It stayed queued: the right destination gets it.
    got, same = b.execute_on(0).recv_into("p2p_a", 0, {"w": torch.zeros(4)}).wait(timeout=30)[0]
    assert same and torch.equal(got["w"], torch.ones(4))
    a.execute_on(0).send_one("text", "p2p_b", 0).wait(timeout=30)
    err = b.execute_on(0).expect_error("recv_into", "p2p_a", 0, torch.zeros(1)).wait(timeout=30)[0]
    assert err[0] == "ProtocolMismatchError" and "OBJECT message cannot be received into" in err[1]
    assert b.execute_on(0).recv_one("p2p_a", 0).wait(timeout=30) == ["text"]


def test_bad_input_fails_fast(peers):
    a, _ = peers
    cases = [
        (("send_one", "x", "no_such_group", 0), "PeerNotFoundError", "no_such_group"),
        (("send_one", "x", "p2p_b", 9), "PeerNotFoundError", "rank 9"),
        (("recv_one", "no_such_group", 0), "PeerNotFoundError", "no_such_group"),
        (("send_unpicklable", "p2p_b", 0), "CodecError", "lock"),
        (("send_one", "x", "p2p_a", 0), "ValueError", "itself"),
        (("send_tensor_one", [1, 2], "p2p_b", 0), "TypeError", "torch.Tensor"),
        (("broadcast_from", 1, [("p2p_b", [0, 1])], None), "ValueError", "not among"),
        (("send_one", "x", "p2p_b", -1), "ValueError", "rank"),
    ]
    for args, name, fragment in cases:
        got, text, took = a.execute_on(0).expect_error(*args).wait(timeout=30)[0]
        assert got == name and fragment in text, (args, got, text)
        assert took < 5


def test_options_mismatch(peers):
    a, b = peers
    opts_a = CollectiveGroupOptions(timeout=2.5, transport="gloo")
    opts_b = CollectiveGroupOptions(timeout=2.5, transport="auto")
    # Fresh pair (p2p_a:1, p2p_b:0); the receiver posts first, then the sender.
    hb = b.execute_on(0).expect_error("recv_one", "p2p_a", 1, options=opts_b)
    wait_op_under_way("p2p_b:0", "recv", "p2p_a:1")
    ha = a.execute_on(1).expect_error("send_one", "x", "p2p_b", 0, options=opts_a)
    ra, rb = ha.wait(timeout=30)[0], hb.wait(timeout=30)[0]
    names = {ra[0], rb[0]}
    assert "OptionsMismatchError" in names, (ra, rb)
    assert names <= {"OptionsMismatchError", "CommTimeoutError"}
    text = ra[1] if ra[0] == "OptionsMismatchError" else rb[1]
    assert "transport" in text and "p2p_" in text


def test_peer_death_raises_peer_lost(cluster, peers):
    a, _ = peers
    victim = Peer.create_group().launch(cluster, NodePlacementStrategy([0]), name="p2p_victim")
    try:
        victim.send_one("hi", "p2p_a", 0).wait(timeout=30)
        assert a.execute_on(0).recv_one("p2p_victim", 0).wait(timeout=30) == ["hi"]
        waiting = a.execute_on(0).expect_error("recv_one", "p2p_victim", 0, options=FAST)
        wait_op_under_way("p2p_a:0", "recv", "p2p_victim:0")  # the death comes mid-recv
        ray.kill(victim.workers[0], no_restart=True)
        name, text, took = waiting.wait(timeout=30)[0]
        assert name == "PeerLostError" and "p2p_victim:0" in text and took < 15
        # The worker stays usable for its other peers.
        a.execute_on(0).send_one("still here", "p2p_b", 2).wait(timeout=30)
    finally:
        victim.shutdown()


def test_error_classes_are_exported():
    for cls in (CommTimeoutError, PeerLostError, PeerNotFoundError, OptionsMismatchError,
                ProtocolMismatchError):
        assert issubclass(cls, Exception)
