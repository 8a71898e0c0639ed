"""Channels between workers and the driver: real Ray actors, real rlcomm transport."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass

import pytest
import ray
import torch

from rlcomm import (
    Channel,
    ChannelClosedError,
    ChannelEmpty,
    ChannelError,
    ChannelFull,
    ChannelLostError,
    ChannelTypeError,
    NodePlacementStrategy,
    Worker,
)
from rlcomm.cluster import RLCOMM_NAMESPACE
from rlcomm.comm.identity import actor_name
from tests.waiting import wait_for


@dataclass
class Rollout:
    producer: int
    seq: int
    obs: torch.Tensor


def _error_of(fn, *args, **kwargs):
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


class Producer(Worker):
    def produce(self, channel: Channel, n: int, key: str = "default", window: int = 500) -> int:
        works = []
        for seq in range(n):
            works.append(channel.put((self.rank, seq), weight=1, key=key, async_op=True))
            if len(works) >= window:
                for work in works:
                    work.wait(timeout=60)
                works = []
        for work in works:
            work.wait(timeout=60)
        return n

    def put_each(self, channel: Channel, items: list, key: str = "default") -> float:
        for item in items:
            channel.put(item, weight=1, key=key, timeout=60)
        return time.monotonic()

    def put_error(self, channel: Channel, item, key: str = "default", **kwargs):
        return _error_of(channel.put, item, key=key, **kwargs)

    def put_rollouts(self, name: str, n: int) -> int:
        channel = self.connect_channel(name, timeout=30)
        for seq in range(n):
            channel.put(Rollout(self.rank, seq, torch.full((3,), float(seq))), weight=1, timeout=60)
        return n


class Consumer(Worker):
    def drain(self, channel: Channel, key: str, seed: int) -> list:
        rng = random.Random(seed)
        got: list = []
        while True:
            try:
                if rng.random() < 0.2:
                    got.append(channel.get(key=key, timeout=60))
                else:
                    got.extend(channel.get_batch(rng.randint(1, 64), key=key, timeout=60))
            except ChannelClosedError:
                return got

    def get_error(self, channel: Channel, key: str = "default", **kwargs):
        return _error_of(channel.get, key=key, **kwargs)

    def get_n(self, channel: Channel, n: int, key: str = "default") -> list:
        return [channel.get(key=key, timeout=60) for _ in range(n)]

    def threads_on_one_channel(self, channel: Channel, n: int) -> tuple[list, list]:
        """A putting thread and a getting thread share this process's link."""
        got: list = []
        errors: list = []

        def put():
            try:
                for i in range(n):
                    channel.put(i, key="mux", timeout=30)
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        def get():
            try:
                got.extend(channel.get(key="mux", timeout=30) for _ in range(n))
            except Exception as exc:  # noqa: BLE001
                errors.append(repr(exc))

        threads = [threading.Thread(target=get), threading.Thread(target=put)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return got, errors

    def async_pipeline(self, name: str, n: int) -> dict:
        """Three asyncio stages in this worker under uvloop, linked by one channel."""
        import uvloop

        channel = self.create_channel(name, maxsize=4)

        async def main():
            loop = asyncio.get_running_loop()
            gaps: list[float] = []

            async def heartbeat():
                last = loop.time()
                while True:
                    await asyncio.sleep(0.01)
                    now = loop.time()
                    gaps.append(now - last)
                    last = now

            async def source():
                for i in range(n):
                    await channel.aput({"i": i, "x": torch.full((4,), float(i))}, key="raw",
                                       timeout=60)
                await channel.aput(None, key="raw", timeout=60)

            async def double():
                async for item in channel.stream("raw", timeout=60):
                    if item is None:
                        break
                    item["x"] = item["x"] * 2
                    await channel.aput(item, key="done", timeout=60)
                await channel.aclose()

            beat = asyncio.create_task(heartbeat())
            stages = [asyncio.create_task(source()), asyncio.create_task(double())]
            out = [item async for item in channel.stream("done", timeout=60)]
            await asyncio.gather(*stages)
            beat.cancel()
            return {
                "loop": type(loop).__module__,
                "ids": [item["i"] for item in out],
                "ok": all(torch.equal(item["x"], torch.full((4,), 2.0 * item["i"])) for item in out),
                "max_gap": max(gaps),
            }

        try:
            return uvloop.run(main())
        finally:
            channel.shutdown()


@pytest.fixture(scope="module")
def producers(cluster):
    group = Producer.create_group().launch(cluster, NodePlacementStrategy([0] * 4), name="ch_prod")
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def consumers(cluster):
    group = Consumer.create_group().launch(cluster, NodePlacementStrategy([0] * 4), name="ch_cons")
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def shared(cluster):
    """One unbounded channel for the tests that only use their own keys."""
    channel = Channel.create("ch_shared", cluster=cluster)
    yield channel
    channel.shutdown()


def test_many_producers_and_consumers_exactly_once(cluster, producers, consumers):
    channel = Channel.create("ch_mpmc", cluster=cluster)
    try:
        per_producer = 5000
        drains = consumers.drain(channel, "ids", 7)
        producers.produce(channel, per_producer, "ids").wait(timeout=120)
        channel.close()
        results = drains.wait(timeout=120)
        everything = [item for got in results for item in got]
        assert len(everything) == 4 * per_producer  # none lost
        assert len(set(everything)) == len(everything)  # none duplicated
        assert set(everything) == {(p, s) for p in range(4) for s in range(per_producer)}
        assert all(len(got) > 0 for got in results)
        for got in results:  # each producer's items reach every consumer in order
            for p in range(4):
                seqs = [s for q, s in got if q == p]
                assert seqs == sorted(seqs)
        stats = channel.stats()[0]["keys"]["ids"]
        assert stats == {"puts": 4 * per_producer, "gets": 4 * per_producer, "queued": 0}
    finally:
        channel.shutdown()


def test_backpressure_holds_the_producer_at_maxsize(cluster, producers):
    channel = Channel.create("ch_bp", maxsize=8, cluster=cluster)
    try:
        assert channel.maxsize == 8
        handle = producers.execute_on(0).put_each(channel, list(range(20)), "bp")
        # Eight went in and the ninth put is parked: the producer is held.
        wait_for(lambda: _bp(channel) == (8, 8, 1), "8 items queued and a put parked")
        assert channel.full("bp") and not handle.done()
        with pytest.raises(ChannelFull, match="ch_bp.*'bp'.*maxsize=8"):
            channel.put_nowait("extra", key="bp")
        assert channel.get(key="bp", timeout=10) == 0
        # The get admitted the parked put, and the producer's next one parks again.
        wait_for(lambda: _bp(channel) == (9, 8, 1), "one more admitted, the next parked")
        assert not handle.done()  # exactly one more got in
        released_at = time.monotonic()
        got = [channel.get(key="bp", timeout=10) for _ in range(19)]
        assert got == list(range(1, 20))
        assert handle.wait(timeout=30)[0] >= released_at - 1.0
        assert channel.empty("bp") and not channel.full("bp")
    finally:
        channel.shutdown()


def _bp(channel: Channel) -> tuple[int, int, int]:
    """Key 'bp' of ``channel``: items accepted, items queued, requests parked."""
    stats = channel.stats()[0]
    key = stats["keys"].get("bp", {"puts": 0, "queued": 0})
    return key["puts"], key["queued"], stats["parked"]


def test_get_batch_by_weight_nowait_and_tensors(shared, producers, consumers):
    ch = shared
    for item, weight in (("a", 1), ("b", 2), ("c", 4), ("d", 1)):
        ch.put(item, weight=weight, key="w", timeout=10)
    assert ch.get_batch(3, key="w", timeout=10) == ["a", "b"]
    work = ch.get_batch(5, key="w", async_op=True, timeout=10)
    assert work.wait(timeout=30) == ["c", "d"]
    assert ch.empty("w")
    with pytest.raises(ChannelEmpty, match="ch_shared.*get_nowait on key 'w'"):
        ch.get_nowait(key="w")
    ch.put_nowait("n", key="w")
    assert ch.qsize("w") == 1 and ch.get_nowait(key="w") == "n"
    # A get_batch waits until a worker's puts reach the target.
    waiting = ch.get_batch(4, key="w2", async_op=True, timeout=30)
    producers.execute_on(1).put_each(ch, ["x", "y", "z", "t", "u"], "w2").wait(timeout=30)
    assert waiting.wait(timeout=30) == ["x", "y", "z", "t"]
    assert ch.qsize("w2") == 1
    # Tensors of every shape of item travel to a worker and back.
    big = torch.randn(1 << 18)
    items = [big, [torch.ones(2), torch.zeros(3)], {"obs": torch.arange(4)},
             Rollout(0, 1, torch.ones(2, 2)), ("mixed", torch.ones(1), 3)]
    for item in items:
        ch.put(item, key="t", timeout=10)
    got = consumers.execute_on(2).get_n(ch, len(items), "t").wait(timeout=60)[0]
    assert torch.equal(got[0], big)
    assert [t.tolist() for t in got[1]] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    assert got[2]["obs"].tolist() == [0, 1, 2, 3]
    assert isinstance(got[3], Rollout) and got[3].obs.shape == (2, 2)
    assert got[4][0] == "mixed" and got[4][2] == 3


def test_handles_connect_and_names(cluster, shared, producers, consumers):
    # A handle passed as an argument reconnects lazily; connect_channel finds it by name.
    producers.execute_on(3).put_rollouts("ch_shared", 3).wait(timeout=60)
    got = consumers.execute_on(3).get_n(shared, 3).wait(timeout=60)[0]
    assert [(r.producer, r.seq) for r in got] == [(3, 0), (3, 1), (3, 2)]
    assert torch.equal(got[2].obs, torch.full((3,), 2.0))
    with pytest.raises(ChannelError, match="'ch_shared' exists already"):
        Channel.create("ch_shared", cluster=cluster)
    start = time.monotonic()
    with pytest.raises(ChannelError, match="no channel named 'ch_missing'"):
        Channel.connect("ch_missing", timeout=1)
    assert time.monotonic() - start < 10
    again = Channel.connect("ch_shared")
    again.put("via connect", key="c", timeout=10)
    assert shared.get(key="c", timeout=10) == "via connect"


def test_close_semantics_across_workers(cluster, producers, consumers):
    channel = Channel.create("ch_close", maxsize=1, cluster=cluster)
    try:
        channel.put("first", key="k", timeout=10)
        blocked_put = producers.execute_on(0).put_error(channel, "second", key="k", timeout=60)
        blocked_get = consumers.execute_on(0).get_error(channel, key="empty", timeout=60)
        wait_for(lambda: channel.stats()[0]["parked"] == 2, "the put and the get are parked")
        channel.close()
        name, text, took = blocked_put.wait(timeout=30)[0]
        assert name == "ChannelClosedError" and "ch_close" in text and "'k'" in text and took < 20
        name, text, _ = blocked_get.wait(timeout=30)[0]
        assert name == "ChannelClosedError" and "'empty'" in text
        with pytest.raises(ChannelClosedError, match="put on key 'k'"):
            channel.put("third", key="k", timeout=10)
        assert channel.get(key="k", timeout=10) == "first"  # drained first
        with pytest.raises(ChannelClosedError, match="drained"):
            channel.get(key="k", timeout=10)
    finally:
        channel.shutdown()


def test_typed_channel_errors_in_the_producer(cluster, producers):
    channel = Channel.create("ch_typed", item_type=list[Rollout], cluster=cluster)
    try:
        ok = [Rollout(0, 0, torch.ones(1))]
        channel.put(ok, key="r", timeout=10)
        name, text, _ = producers.execute_on(2).put_error(
            channel, [Rollout(0, 1, torch.ones(1)), {"seq": 2}], key="r"
        ).wait(timeout=30)[0]
        assert name == "ChannelTypeError"
        assert "ch_typed" in text and "'r'" in text and "list[Rollout]" in text
        assert "item[1] is a dict" in text
        assert channel.qsize("r") == 1  # nothing enqueued
        connected = Channel.connect("ch_typed")
        assert connected.item_type == list[Rollout]
        with pytest.raises(ChannelTypeError):
            connected.put(ok[0], key="r", timeout=10)
    finally:
        channel.shutdown()


def test_threads_and_asyncio_pipeline_in_one_worker(shared, consumers):
    got, errors = consumers.execute_on(1).threads_on_one_channel(shared, 300).wait(timeout=120)[0]
    assert errors == [] and got == list(range(300))
    result = consumers.execute_on(1).async_pipeline("ch_async", 200).wait(timeout=120)[0]
    assert result["loop"].startswith("uvloop")
    assert result["ids"] == list(range(200)) and result["ok"]
    # The event loop never blocked on the channel (a blocked one would stall for the
    # puts' 60 s timeout: full channel, its consumer on the same loop).
    assert result["max_gap"] < 10.0


def test_killed_channel_worker_raises_channel_lost(cluster, consumers):
    channel = Channel.create("ch_kill", cluster=cluster)
    channel.put("x", key="alive", timeout=10)
    assert channel.get(key="alive", timeout=10) == "x"
    blocked = consumers.execute_on(3).get_error(channel, key="never", timeout=120)
    wait_for(lambda: channel.stats()[0]["parked"] == 1, "the get is parked")
    ray.kill(ray.get_actor(actor_name(channel.worker_group_name, 0), namespace=RLCOMM_NAMESPACE))
    name, text, took = blocked.wait(timeout=60)[0]
    assert name == "ChannelLostError" and "ch_kill" in text and "'never'" in text
    assert took < 15
    start = time.monotonic()
    with pytest.raises(ChannelLostError, match="ch_kill"):
        channel.put("y", key="alive", timeout=10)
    assert time.monotonic() - start < 5
    channel.shutdown()


def test_a_dead_consumer_leaves_no_waiter_behind(cluster, shared):
    victim = Consumer.create_group().launch(cluster, NodePlacementStrategy([0]), name="ch_victim")
    try:
        waiting = victim.get_n(shared, 1, "orphan")
        wait_for(lambda: shared.stats()[0]["parked"] == 1, "the victim's get is parked")
        ray.kill(victim.workers[0], no_restart=True)
        wait_for(lambda: shared.stats()[0]["parked"] == 0, "the victim's parked get is dropped")
        shared.put("precious", key="orphan", timeout=10)
        assert shared.get(key="orphan", timeout=10) == "precious"
        with pytest.raises(ray.exceptions.RayError):
            ray.get(waiting.refs[0], timeout=10)
    finally:
        victim.shutdown()


def test_a_name_shut_down_and_created_again_serves_the_same_clients(cluster, consumers):
    """The new channel worker has the address of the old one: this process's link to the
    old worker must give way to one to the new worker."""
    for round_ in range(3):
        channel = Channel.create("ch_again", cluster=cluster)
        channel.put(("driver", round_), key="k", timeout=10)
        assert channel.get(key="k", timeout=10) == ("driver", round_)
        channel.put(("worker", round_), key="w", timeout=10)
        assert consumers.execute_on(0).get_n(channel, 1, "w").wait(timeout=60)[0] == [
            ("worker", round_)
        ]
        channel.shutdown()
