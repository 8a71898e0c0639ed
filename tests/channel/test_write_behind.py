"""Write-behind puts: a blocking ``put`` on an unbounded channel returns without waiting
for the channel worker, and still nothing is lost, reordered or silently refused. Real
channel workers and worker processes; the faults are real (a closed channel, a killed
and a stopped channel worker)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
import ray
import torch

from rlcomm import (
    Channel,
    ChannelClosedError,
    ChannelLostError,
    CommTimeoutError,
    NodePlacementStrategy,
    Worker,
)
from rlcomm.channel import outbox as outbox_module
from rlcomm.cluster import RLCOMM_NAMESPACE
from rlcomm.comm.identity import actor_name
from rlcomm.worker import group as group_module
from tests.waiting import await_for, wait_for, wait_process_gone

pytestmark = pytest.mark.timeout(180)


class Putter(Worker):
    def ping(self) -> bool:
        return True

    def put_many(self, channel: Channel, n: int, key: str = "k") -> int:
        """Blocking puts; returns how many of them waited for the worker's answer
        (none should: the method's end settles them instead)."""
        for i in range(n):
            assert channel.put(i, key=key) is None
        return 0

    def put_async_many(self, channel: Channel, n: int, key: str) -> int:
        """Async puts without tensors: each work is done at once (no reply to wait
        for); returns how many messages they went in."""
        channel.put(-1, key="warm")  # the first put of a link waits: it connects

        def sent() -> int:
            stats = channel.client_stats(key)
            return stats["sent_inline"] + stats["sent_off"]

        before = sent()
        for i in range(n):
            assert channel.put(i, weight=1, key=key, async_op=True).done()
        return sent() - before

    async def aput_many(self, channel: Channel, n: int, key: str) -> tuple[int, int]:
        """``aput`` on this worker's event loop; the messages sent from the loop's
        thread and from other threads."""
        await channel.aput(-1, key="awarm")
        start = channel.client_stats(key)
        for i in range(n):
            await channel.aput(i, weight=1, key=key)
        # The hold timer sends the last few (its pool's thread: counted as sent off).
        await await_for(lambda: channel.client_stats(key)["held"] == 0, "the held puts are sent")
        end = channel.client_stats(key)
        return (end["sent_inline"] - start["sent_inline"], end["sent_off"] - start["sent_off"])

    def get_one(self, channel: Channel, key: str) -> object:
        return channel.get(key=key, timeout=60)

    def put_then_close_then_put(self, channel: Channel) -> tuple[str, str]:
        """A put, then the channel closed by this process, then a put: what the second
        put and a flush raise."""
        channel.put("before", key="c")
        channel.close()
        errors = []
        for op in (lambda: channel.put("after", key="c"), channel.flush):
            try:
                op()
                errors.append("")
            except ChannelClosedError as exc:
                errors.append(str(exc))
        return errors[0], errors[1]


@pytest.fixture(scope="module")
def putter(cluster):
    group = Putter.create_group().launch(cluster, NodePlacementStrategy([0]), name="wb_putter")
    yield group
    group.shutdown()


def _worker_pid(channel: Channel) -> int:
    actor = ray.get_actor(actor_name(channel.worker_group_name, 0), namespace=RLCOMM_NAMESPACE)
    return ray.get(actor.channel_node_info.remote(), timeout=60)["pid"]


def test_puts_of_a_worker_method_are_held_when_it_returns(cluster, putter):
    channel = Channel.create("wb_method", cluster=cluster)
    try:
        for round_ in range(5):
            putter.put_many(channel, 300, f"k{round_}").wait(timeout=120)
            # No flush here: the method settled its puts before it returned.
            assert channel.qsize(f"k{round_}") == 300
        assert channel.stats()[0]["puts"] == 1500
        assert [channel.get(key="k0", timeout=10) for _ in range(300)] == list(range(300))
        replies = channel.stats()[0]["replies"]
        # The worker answered the producer's 1500 puts with a handful of Sync replies
        # (one per method), not a reply per put.
        assert replies["sent_inline"] + replies["sent_by_reply_threads"] < 200, replies
    finally:
        channel.shutdown()


def test_a_put_then_a_get_of_the_same_process_see_each_other(cluster):
    channel = Channel.create("wb_fifo", cluster=cluster)
    try:
        channel.put(-1, key="k")  # the first put waits: the connection is made on it
        assert channel.get_nowait(key="k") == -1
        assert channel.client_stats("k")["writes_behind"]
        for i in range(200):
            channel.put(i, key="k")
            assert channel.get_nowait(key="k") == i
        bounded = Channel.create("wb_bounded", cluster=cluster, maxsize=4)
        try:
            assert not bounded.client_stats()["writes_behind"]  # a bound is answered by the worker
        finally:
            bounded.shutdown()
    finally:
        channel.shutdown()


def test_async_puts_without_tensors_travel_together_unanswered(cluster, putter, monkeypatch):
    channel = Channel.create("wb_async", cluster=cluster)
    try:
        # Held puts look for a dead worker at most once a millisecond; a blocking put
        # still looks every time, also right after held ones.
        channel.put(0, key="peek")  # connects

        def looks() -> int:
            return channel.client_stats("peek")["gone_checks"]

        start = looks()
        for i in range(50):
            channel.put(i, key="peek", async_op=True)
        held_looks = looks() - start
        for i in range(3):
            channel.put(i, key="peek")
        assert held_looks < 50 and looks() - start == held_looks + 3, (held_looks, looks())

        messages = putter.put_async_many(channel, 1000, "k").wait(timeout=120)[0]
        assert messages <= 1000 // outbox_module.HOLD_ENTRIES + 5, messages
        assert channel.qsize("k") == 1000  # the method's end settled them
        assert channel.get_batch(1000, key="k", timeout=10) == list(range(1000))

        # A lone async put leaves on its own (the hold timer): this process makes no
        # other call while a consumer already waits for it.
        waiting = putter.get_one(channel, "lone")
        wait_for(lambda: channel.stats()[0]["parked"] == 1, "the consumer's get is parked")
        work = channel.put("alone", key="lone", async_op=True)
        assert work.done()
        assert waiting.wait(timeout=30) == ["alone"]

        # aput holds the same way, and never sends from the event loop's thread.
        inline, off = putter.aput_many(channel, 500, "a").wait(timeout=120)[0]
        # (awaiting each aput is slower than a put: the 0.2 ms timer sends more often)
        assert inline == 0 and 1 <= off <= 100, (inline, off)
        assert channel.get_batch(500, key="a", timeout=10) == list(range(500))

        # An item with tensors is answered as before: its work is done once the worker
        # holds it (the caller may change the tensor after that).
        t = torch.ones(4)
        channel.put(t, key="t", async_op=True).wait(timeout=30)
        t.zero_()
        assert torch.equal(channel.get(key="t", timeout=10), torch.ones(4))
    finally:
        channel.shutdown()


def test_a_put_after_the_channel_closed_is_never_silently_dropped(cluster, putter):
    channel = Channel.create("wb_closed", cluster=cluster)
    try:
        after, flushed = putter.put_then_close_then_put(channel).wait(timeout=60)[0]
        assert "closed" in after  # this process saw its own close: the put raised at once
        assert flushed == ""  # nothing was sent behind after the close
        assert channel.get(key="c", timeout=10) == "before"
        # Another process that did not see the close: its write-behind put is refused by
        # the worker, and the refusal is raised by its next put and by a flush.
        channel2 = Channel.create("wb_closed2", cluster=cluster)
        try:
            channel2.put("first", key="c")
            channel2.flush()
            putter.put_many(channel2, 1, "other").wait(timeout=60)  # the putter's link
            channel2_worker = ray.get_actor(actor_name(channel2.worker_group_name, 0),
                                            namespace=RLCOMM_NAMESPACE)
            assert ray.get(channel2_worker.channel_stats.remote(), timeout=60)["puts"] == 2
            Channel.connect("wb_closed2").close()
            with pytest.raises(ChannelClosedError, match="closed"):
                putter.put_many(channel2, 3, "late").wait(timeout=60)
        finally:
            channel2.shutdown()
    finally:
        channel.shutdown()


def test_a_killed_channel_worker_fails_the_next_put_and_flush(cluster):
    channel = Channel.create("wb_killed", cluster=cluster)
    try:
        channel.put("x", key="k")
        channel.flush()
        pid = _worker_pid(channel)
        for _ in range(20):
            channel.put("unsettled", key="k")
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ChannelLostError, match="may not have reached it"):
            channel.flush(timeout=30)  # they may have died with it: said, not hidden
        with pytest.raises(ChannelLostError, match="wb_killed"):
            channel.put("y", key="k")
        assert time.monotonic() - start < 10

        other = Channel.create("wb_killed2", cluster=cluster)
        try:
            other.put("x", key="k")
            other.flush()
            pid = _worker_pid(other)
            os.kill(pid, signal.SIGKILL)
            wait_process_gone(pid)
            wait_for(lambda: other.client_stats("k")["worker_gone"],
                     "the put's connection sees the channel worker gone")
            with pytest.raises(ChannelLostError, match="wb_killed2"):
                for _ in range(100):  # the first put after the death is seen raises
                    other.put("y", key="k")
            # An async put now: its work reports the loss.
            with pytest.raises(ChannelLostError, match="wb_killed2"):
                other.put("z", key="k", async_op=True).wait(timeout=10)
        finally:
            other.shutdown()
    finally:
        channel.shutdown()


@contextlib.contextmanager
def _worker_stopped(channel: Channel) -> Iterator[None]:
    """Item 0 put and held, then the channel worker's process stopped (SIGSTOP) for the
    block, and resumed after it."""
    pid = _worker_pid(channel)
    channel.put(0, key="k")
    channel.flush()
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_flush_times_out_on_a_stopped_channel_worker_then_completes(cluster):
    channel = Channel.create("wb_stopped", cluster=cluster)
    try:
        with _worker_stopped(channel):
            for i in range(1, 50):
                channel.put(i, key="k")  # written behind: no waiting on the stopped worker
            start = time.monotonic()
            with pytest.raises(CommTimeoutError):
                channel.flush(timeout=1.0)
            assert time.monotonic() - start < 10
        channel.flush(timeout=30)
        assert channel.qsize(key="k") == 50
        assert [channel.get(key="k", timeout=10) for _ in range(50)] == list(range(50))
    finally:
        channel.shutdown()


def test_a_group_call_is_not_held_up_by_a_stopped_channel_worker(cluster, putter, monkeypatch):
    monkeypatch.setattr(group_module, "CALL_SETTLE_TIMEOUT", 1.0)
    channel = Channel.create("wb_call", cluster=cluster)
    try:
        with _worker_stopped(channel):
            channel.put(1, key="k")  # unsettled while its worker is stopped
            start = time.monotonic()
            assert putter.ping().wait(timeout=60) == [True]
            assert time.monotonic() - start < 8  # waited 1 s for the puts, then went on
        channel.flush(timeout=30)
        assert channel.qsize(key="k") == 2
    finally:
        channel.shutdown()


def test_a_get_takes_tensor_items_ahead_within_the_byte_budget(cluster):
    channel = Channel.create("wb_tensors", cluster=cluster)
    try:
        items = [torch.full((256 << 10,), float(i)) for i in range(30)]  # 1 MiB each
        for t in items:
            channel.put(t, key="k")
        first = channel.get(key="k", timeout=10)
        ahead = channel.client_stats("k")["prefetched"]
        # 16 MiB of 1 MiB items beside the one asked for: 15, as each item's codec
        # header counts too.
        assert ahead == 15
        assert torch.equal(first, items[0])
        got = [channel.get(key="k", timeout=10) for _ in range(29)]
        assert all(torch.equal(g, t) for g, t in zip(got, items[1:], strict=True))
    finally:
        channel.shutdown()
