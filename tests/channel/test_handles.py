"""One handle: channel ops return ``AsyncWork``; abandoning a wait withdraws the request."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from rlcomm import Channel, CommTimeoutError
from rlcomm.comm.work import AsyncWork
from tests.waiting import await_for


@pytest.fixture
def channel():
    ch = Channel.create("handles_local", local=True, maxsize=4)
    yield ch
    ch.shutdown()


def test_async_ops_return_async_work(channel):
    put = channel.put("a", async_op=True)
    assert isinstance(put, AsyncWork) and put.wait(5) is None and put.done()
    got = channel.get(async_op=True)
    assert isinstance(got, AsyncWork) and got.wait(5) == "a"
    batch = channel.get_batch(2, async_op=True)
    channel.put("b", weight=1)
    channel.put("c", weight=1)
    assert batch.wait(5) == ["b", "c"]


def test_a_wait_that_times_out_withdraws_the_get(channel):
    work = channel.get(async_op=True, timeout=60)
    with pytest.raises(CommTimeoutError, match="get on key 'default' did not complete"):
        work.wait(timeout=0.05)
    assert work.future.cancelled()
    channel.put("x")
    assert channel.qsize() == 1  # the withdrawn get took nothing
    assert channel.get(timeout=5) == "x"


def test_a_cancelled_task_withdraws_its_get(channel):
    async def main() -> None:
        task = asyncio.ensure_future(channel.aget(timeout=60))
        await await_for(lambda: channel.stats()[0]["parked"] == 1, "the aget is parked")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await channel.aput("y")
        assert channel.qsize() == 1
        assert await channel.get(async_op=True) == "y"  # an AsyncWork is awaitable

    asyncio.run(main())


def test_async_work_waiter_and_cancellable_are_opt_in():
    fut: concurrent.futures.Future = concurrent.futures.Future()
    calls = []

    def waiter(f: concurrent.futures.Future, timeout: float | None) -> bool:
        calls.append(timeout)
        f.set_result(7)
        return True

    assert AsyncWork(fut, "op", 3.0, waiter=waiter).wait() == 7 and calls == [3.0]
    plain: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(CommTimeoutError):
        AsyncWork(plain, "op").wait(0.01)
    assert not plain.cancelled()  # default: the op goes on

    async def abandon(work: AsyncWork) -> None:
        with pytest.raises(CommTimeoutError):
            await work.async_wait(0.01)

    shielded: concurrent.futures.Future = concurrent.futures.Future()
    asyncio.run(abandon(AsyncWork(shielded, "op")))
    assert not shielded.cancelled()
    withdrawn: concurrent.futures.Future = concurrent.futures.Future()
    asyncio.run(abandon(AsyncWork(withdrawn, "op", cancellable=True)))
    assert withdrawn.cancelled()


def test_an_answered_async_put_makes_no_future_until_asked(channel):
    works = [channel.put(i, async_op=True) for i in range(3)]
    assert all(w.done() and w._future is None for w in works)  # answered before any wait
    assert [w.wait(5) for w in works] == [None, None, None]
    assert works[0].future.done() and works[0].future.result() is None  # made on demand
    assert [channel.get(timeout=5) for _ in range(3)] == [0, 1, 2]
    full = [channel.put(i, async_op=True) for i in range(5)]  # maxsize=4: the last parks
    assert full[3].done() and not full[4].done()
    channel.get(timeout=5)
    assert full[4].wait(5) is None
