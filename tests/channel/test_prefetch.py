"""Prefetch: a get takes items ahead for its process's next gets, only where that keeps
the channel's promises (unbounded, CPU items within a byte budget, one consumer, nobody
waiting), and items taken ahead but unused go back to the key. The rules on the pure
state first, then end to end with a real channel worker and worker processes."""

from __future__ import annotations

import time

import pytest
import torch

from rlcomm import Channel, ChannelClosedError, NodePlacementStrategy, Worker
from rlcomm.channel import prefetch
from rlcomm.channel import protocol as P
from rlcomm.channel.state import PREFETCH_BYTES, SHARED_SECONDS, ChannelState
from tests.waiting import wait_for


def _get(state: ChannelState, client: str, rid: int, now: float, prefetch_n: int = 8,
         key: str = "k") -> list:
    out: list = []
    state.handle(client, P.Get(rid, key, None, prefetch=prefetch_n), now, out)
    return out


def _fill(state: ChannelState, n: int, key: str = "k", big: set[int] = frozenset()) -> None:
    out: list = []
    for i in range(n):
        state.handle("producer", P.Put(1000 + i, key, 1.0, None, ("big" if i in big else "small", i)),
                     0.0, out)


def _small(item) -> int | None:
    """Lend costs: a small item 1 KiB; a "big" one may never be lent (like GPU items);
    a "half" one costs half of what one get may take ahead."""
    return {"small": 1024, "big": None, "half": PREFETCH_BYTES // 2}[item[0]]


def test_a_get_takes_small_items_ahead_up_to_its_ask():
    state = ChannelState("t", 0, _small)
    _fill(state, 20)
    (d,) = _get(state, "a", 1, 1.0, prefetch_n=8)
    assert [i for _, i in d.value] == list(range(9)) and d.weights == [1.0] * 9
    assert state.qsize("k") == 11
    (d,) = _get(state, "a", 2, 1.1, prefetch_n=0)  # no ask, one item
    assert [i for _, i in d.value] == [9]


def test_no_items_ahead_past_a_large_one_or_on_a_bounded_channel():
    state = ChannelState("t", 0, _small)
    _fill(state, 6, big={3})
    (d,) = _get(state, "a", 1, 1.0)
    assert [i for _, i in d.value] == [0, 1, 2]  # stops before the large item
    bounded = ChannelState("t", 4, _small)
    _fill(bounded, 4)
    (d,) = _get(bounded, "a", 1, 1.0)
    assert [i for _, i in d.value] == [0]  # maxsize > 0: a bound is a promise


def test_items_ahead_stop_at_the_byte_budget():
    state = ChannelState("t", 0, _small)
    out: list = []
    for i in range(6):
        state.handle("producer", P.Put(1000 + i, "k", 1.0, None, ("half", i)), 0.0, out)
    (d,) = _get(state, "a", 1, 1.0, prefetch_n=8)
    assert [i for _, i in d.value] == [0, 1, 2]  # the head, then two halves of the budget


def test_no_items_ahead_while_another_consumer_shares_the_key():
    state = ChannelState("t", 0, _small)
    _fill(state, 40)
    (d,) = _get(state, "a", 1, 1.0, prefetch_n=2)
    assert len(d.value) == 3
    (d,) = _get(state, "b", 2, 1.5, prefetch_n=2)  # a second consumer: the key is shared
    assert len(d.value) == 1
    (d,) = _get(state, "a", 3, 1.6, prefetch_n=2)
    assert len(d.value) == 1
    (d,) = _get(state, "a", 4, 1.5 + SHARED_SECONDS + 0.1, prefetch_n=2)  # b went away
    assert len(d.value) == 3


def test_no_items_ahead_for_a_get_with_others_waiting_behind_it():
    state = ChannelState("t", 0, _small)
    assert _get(state, "a", 1, 1.0) == [] and _get(state, "a", 2, 1.0) == []  # both park
    out: list = []  # five items at once (put back by a requeue): both gets are served
    state.requeue("k", [("small", i) for i in range(5)], [1.0] * 5, out)
    gets = [d for d in out if d.rid in (1, 2)]
    assert [len(d.value) for d in gets] == [1, 4]  # the first had a waiter behind it


class Taker(Worker):
    def get_n(self, channel: Channel, n: int, key: str) -> list:
        return [channel.get(key=key, timeout=30) for _ in range(n)]

    def get_then_idle(self, channel: Channel, key: str, idle: float) -> tuple:
        item = channel.get(key=key, timeout=30)
        held = channel.qsize(key)
        time.sleep(idle)  # the scenario: this process stays idle (not a wait on another)
        return item, held


@pytest.fixture(scope="module")
def takers(cluster):
    group = Taker.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="pf_take")
    yield group
    group.shutdown()


def _stats(channel: Channel, key: str) -> dict:
    return channel.stats()[0]["keys"][key]


def test_later_gets_use_the_items_taken_ahead(cluster, monkeypatch):
    # Long enough that no item goes back while the test looks (a loaded machine).
    monkeypatch.setattr(prefetch, "PREFETCH_LINGER", 30.0)
    channel = Channel.create("pf_ahead", cluster=cluster)
    try:
        for i in range(10):
            channel.put(i, weight=1, key="k")
        assert channel.get(key="k", timeout=30) == 0
        assert _stats(channel, "k") == {"puts": 10, "gets": 10, "queued": 0}  # 9 came ahead
        assert channel.qsize("k") == 9  # counted where they are: in this process
        assert [channel.get(key="k", timeout=30) for _ in range(4)] == [1, 2, 3, 4]
        assert channel.get_batch(3, key="k", timeout=30) == [5, 6, 7]
        for i in range(10, 14):
            channel.put(i, weight=1, key="k")
        # Two items ahead, the rest from the worker, in order.
        assert channel.get_batch(4, key="k", timeout=30) == [8, 9, 10, 11]
        assert channel.get_nowait("k") == 12
        # Tensor items come ahead within the byte budget (16 MiB), a larger one never.
        channel.put(torch.ones(1 << 18), key="t")
        channel.put(torch.ones(1 << 18), key="t")
        channel.get(key="t", timeout=30)
        assert _stats(channel, "t")["gets"] == 2
        channel.put(torch.ones(17 << 18), key="big")
        channel.put(torch.ones(17 << 18), key="big")
        channel.get(key="big", timeout=30)
        assert _stats(channel, "big")["gets"] == 1
    finally:
        channel.shutdown()


def test_items_taken_ahead_and_unused_go_back_to_the_key(cluster, takers):
    channel = Channel.create("pf_back", cluster=cluster)
    try:
        for i in range(10):
            channel.put(i, key="k")
        first, held = takers.execute_on(0).get_then_idle(
            channel, "k", 10 * prefetch.PREFETCH_LINGER).wait(timeout=60)[0]
        assert first == 0 and held == 9
        # The idle process gave them back: another one gets them all, in order.
        assert takers.execute_on(1).get_n(channel, 9, "k").wait(timeout=60)[0] == list(range(1, 10))
        assert _stats(channel, "k") == {"puts": 10, "gets": 10, "queued": 0}
    finally:
        channel.shutdown()


def test_a_closed_channel_still_hands_out_the_items_taken_ahead(cluster):
    channel = Channel.create("pf_closed", cluster=cluster)
    try:
        for i in range(5):
            channel.put(i, weight=1)
        assert channel.get(timeout=30) == 0
        channel.close()
        assert channel.get_batch(10, timeout=30) == [1, 2, 3, 4]  # a partial batch
        with pytest.raises(ChannelClosedError):
            channel.get(timeout=30)
    finally:
        channel.shutdown()


def test_items_taken_ahead_stay_gettable_once_the_worker_is_gone(cluster, monkeypatch):
    import ray

    from rlcomm import ChannelLostError
    from rlcomm.cluster import RLCOMM_NAMESPACE
    from rlcomm.comm.identity import actor_name

    # Long enough that the items are not given back before the worker is killed.
    monkeypatch.setattr(prefetch, "PREFETCH_LINGER", 30.0)
    channel = Channel.create("pf_lost", cluster=cluster)
    try:
        for i in range(4):
            channel.put(i)
        assert channel.get(timeout=30) == 0  # 1, 2, 3 came ahead
        ray.kill(ray.get_actor(actor_name(channel.worker_group_name, 0), namespace=RLCOMM_NAMESPACE))
        wait_for(lambda: channel.client_stats()["lost"], "the client sees the channel worker lost")
        assert [channel.get(timeout=30) for _ in range(3)] == [1, 2, 3]
        with pytest.raises(ChannelLostError, match="pf_lost"):
            channel.get(timeout=30)
    finally:
        channel.shutdown()
