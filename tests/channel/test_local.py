"""``local=True`` channels: the full channel API inside one process, no Ray needed."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

import pytest
import torch

from rlcomm import (
    AsyncWork,
    Channel,
    ChannelClosedError,
    ChannelEmpty,
    ChannelError,
    ChannelFull,
    ChannelLostError,
    ChannelTypeError,
    CommTimeoutError,
)
from tests.waiting import await_for, wait_for


@pytest.fixture
def local():
    made: list[Channel] = []

    def make(name: str, **kwargs) -> Channel:
        ch = Channel.create(name, local=True, **kwargs)
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.shutdown()


def test_put_get_nowait_and_sizes(local):
    ch = local("l_basic", maxsize=2)
    assert ch.local and ch.empty() and not ch.full()
    ch.put("a", timeout=5)
    ch.put_nowait("b", key="default")
    assert ch.qsize() == 2 and ch.full()
    with pytest.raises(ChannelFull, match="l_basic.*put_nowait.*'default'.*maxsize=2"):
        ch.put_nowait("c")
    assert ch.get(timeout=5) == "a" and ch.get_nowait() == "b"
    with pytest.raises(ChannelEmpty, match="get_nowait on key 'default'"):
        ch.get_nowait()
    work = ch.put(torch.ones(2), key="t", async_op=True, timeout=5)
    assert isinstance(work, AsyncWork) and work.wait(timeout=5) is None
    got = ch.get(key="t", async_op=True).wait(timeout=5)
    assert torch.equal(got, torch.ones(2))


def test_get_batch_and_timeouts(local):
    ch = local("l_batch")
    for w in (1, 2, 3):
        ch.put(w, weight=w, timeout=5)
    assert ch.get_batch(3, timeout=5) == [1, 2]
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match="get_batch on key 'default' timed out.*nothing was taken"):
        ch.get_batch(10, timeout=0.2)
    assert time.monotonic() - start < 10  # it gave up: far sooner than a hang
    assert ch.qsize() == 1  # nothing taken
    with pytest.raises(ValueError):
        ch.get_batch(0)
    small = local("l_small", maxsize=1)
    small.put(1, timeout=5)
    with pytest.raises(CommTimeoutError, match="not enqueued"):
        small.put(2, timeout=0.1)
    assert small.qsize() == 1


def test_backpressure_between_threads(local):
    ch = local("l_bp", maxsize=3)
    done = []

    def produce():
        for i in range(10):
            ch.put(i, timeout=10)
            done.append(i)

    t = threading.Thread(target=produce)
    t.start()
    # The fourth put is parked: the producer thread is held at maxsize.
    wait_for(lambda: ch.stats()[0]["parked"] == 1, "the producer's fourth put is parked")
    assert len(done) == 3 and ch.qsize() == 3
    got = [ch.get(timeout=10) for _ in range(10)]
    t.join(timeout=10)
    assert got == list(range(10))


def test_close_drains_then_fails_and_stream_ends(local):
    ch = local("l_close", maxsize=1)
    ch.put("a", timeout=5)
    waiting = ch.put("b", async_op=True, timeout=5)
    ch.close()
    with pytest.raises(ChannelClosedError, match="not enqueued"):
        waiting.wait(timeout=5)
    with pytest.raises(ChannelClosedError):
        ch.put("c", timeout=5)
    assert ch.get(timeout=5) == "a"
    with pytest.raises(ChannelClosedError, match="drained"):
        ch.get(timeout=5)
    ch.close()  # idempotent


def test_typed_channel_rejects_before_enqueueing(local):
    ch = local("l_typed", item_type=dict[str, torch.Tensor])
    ch.put({"obs": torch.ones(1)}, timeout=5)
    with pytest.raises(ChannelTypeError) as info:
        ch.put({"obs": [1.0]}, key="k")
    text = str(info.value)
    assert "l_typed" in text and "'k'" in text and "dict[str, torch.Tensor]" in text
    assert "item['obs'] is a list" in text
    assert isinstance(info.value, TypeError)
    assert ch.qsize(key="k") == 0
    with pytest.raises(TypeError, match="item_type"):
        Channel.create("l_bad_type", local=True, item_type="Rollout")


def test_names_pickling_and_shutdown(local):
    ch = local("l_names")
    with pytest.raises(ChannelError, match="exists already"):
        Channel.create("l_names", local=True)
    assert Channel.connect("l_names") is ch
    with pytest.raises(ChannelError, match="local"):
        pickle.dumps(ch)
    with pytest.raises(ValueError):
        Channel.create("bad:name", local=True)
    other = Channel.create("l_gone", local=True)
    other.shutdown()
    with pytest.raises(ChannelLostError):
        other.put(1)


def test_asyncio_pipeline_under_uvloop(local):
    import uvloop

    ch = local("l_async", maxsize=4)

    async def main():
        async def produce():
            for i in range(50):
                await ch.aput(i, weight=1, timeout=10)
            ch.close()

        task = asyncio.create_task(produce())
        got = [item async for item in ch.stream(timeout=10)]
        await task
        return type(asyncio.get_running_loop()).__module__, got

    loop_module, got = uvloop.run(main())
    assert loop_module.startswith("uvloop") and got == list(range(50))


def test_cancelled_aget_puts_the_item_back(local):
    ch = local("l_cancel")

    async def main():
        task = asyncio.create_task(ch.aget(timeout=10))
        await await_for(lambda: ch.stats()[0]["parked"] == 1, "the aget is parked")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        ch.put("kept", weight=1, timeout=5)
        with pytest.raises(CommTimeoutError):
            await ch.aget(key="other", timeout=0.1)
        return await ch.aget_batch(1, timeout=5)

    assert asyncio.run(main()) == ["kept"]
