"""A frozen channel client (SIGSTOP, not dead) beside healthy ones: real Ray workers.

The frozen consumer has more gets outstanding than its shared-memory ring and segment
pool can hold in replies, so the channel worker's writes to it stall for as long as it
is stopped. Meanwhile a healthy producer and consumer on the same channel, and on the
same key, must go on with short round trips; once the frozen consumer resumes, it
receives every item it asked for, in order, and nothing is lost or duplicated.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rlcomm import Channel, NodePlacementStrategy, Worker
from tests.waiting import wait_for

#: Items of 1 MiB: larger than the shm segment threshold, so the frozen client's replies
#: fill its segment pool and then its ring (8 MiB); FROZEN_GETS of them is far more.
ITEM_FLOATS = 1 << 18
FROZEN_GETS = 64
#: Seconds any one healthy put or get may take while the other client is frozen.
OP_BOUND = 2.0


def _item(seq: int) -> tuple[int, torch.Tensor]:
    return seq, torch.full((ITEM_FLOATS,), float(seq))


class FreezableConsumer(Worker):
    """Posts gets and collects them later, across a SIGSTOP/SIGCONT of its process."""

    def post_gets(self, channel: Channel, n: int, key: str) -> int:
        self._works = [channel.get(key=key, timeout=120, async_op=True) for _ in range(n)]
        return os.getpid()

    def collect(self) -> list[tuple[int, bool]]:
        """``(seq, payload intact)`` of every item its posted gets received, in order."""
        out = []
        for work in self._works:
            seq, tensor = work.wait(timeout=60)
            out.append((seq, bool(torch.equal(tensor, torch.full((ITEM_FLOATS,), float(seq))))))
        return out


class TimedProducer(Worker):
    def put_items(self, channel: Channel, seqs: list[int], key: str) -> list[float]:
        """Blocking puts; the seconds each took."""
        took = []
        for seq in seqs:
            start = time.monotonic()
            channel.put(_item(seq), key=key, timeout=60)
            took.append(time.monotonic() - start)
        return took


class TimedConsumer(Worker):
    def get_items(self, channel: Channel, n: int, key: str) -> tuple[list[int], list[float]]:
        """Blocking gets; the sequence numbers received and the seconds each took."""
        seqs, took = [], []
        for _ in range(n):
            start = time.monotonic()
            seq, tensor = channel.get(key=key, timeout=60)
            took.append(time.monotonic() - start)
            assert tensor[0].item() == float(seq)
            seqs.append(seq)
        return seqs, took


@pytest.fixture(scope="module")
def frozen_setup(cluster):
    groups = [
        FreezableConsumer.create_group().launch(cluster, NodePlacementStrategy([0]),
                                                name="ch_frz_victim"),
        TimedProducer.create_group().launch(cluster, NodePlacementStrategy([0]),
                                            name="ch_frz_prod"),
        TimedConsumer.create_group().launch(cluster, NodePlacementStrategy([0]),
                                            name="ch_frz_cons"),
    ]
    yield groups
    for group in groups:
        group.shutdown()


@pytest.mark.timeout(180)
def test_a_frozen_client_does_not_hold_up_the_others(cluster, frozen_setup):
    victim, producer, consumer = frozen_setup
    channel = Channel.create("ch_frozen", maxsize=4, cluster=cluster)
    pid = None
    try:
        key = "k"
        pid = victim.post_gets(channel, FROZEN_GETS, key).wait(timeout=60)[0]
        wait_for(lambda: channel.stats()[0]["parked"] >= FROZEN_GETS,
                 "the frozen client's gets are parked")
        os.kill(pid, signal.SIGSTOP)

        # The first FROZEN_GETS items answer the frozen client's gets (they were parked
        # first); their replies stall in the channel worker, not in the producer.
        took = producer.put_items(channel, list(range(FROZEN_GETS)), key).wait(timeout=60)[0]
        assert max(took) < OP_BOUND, f"a put took {max(took):.1f}s behind the frozen client"
        stats = channel.stats()[0]
        assert stats["keys"][key]["gets"] == FROZEN_GETS and stats["parked"] == 0

        # Many healthy round trips on the same key while the victim is still stopped.
        rounds = 200
        seqs = list(range(FROZEN_GETS, FROZEN_GETS + rounds))
        start = time.monotonic()
        got = consumer.get_items(channel, rounds, key)
        put_took = producer.put_items(channel, seqs, key).wait(timeout=60)[0]
        got_seqs, get_took = got.wait(timeout=60)[0]
        total = time.monotonic() - start
        assert got_seqs == seqs  # per-key FIFO
        assert max(put_took) < OP_BOUND and max(get_took) < OP_BOUND, (
            f"slowest put {max(put_took):.2f}s, get {max(get_took):.2f}s")
        assert total < 30
        pending = channel.stats()[0]["replies"]
        assert 0 < pending["queued"] <= FROZEN_GETS  # what the frozen client asked for, no more

        os.kill(pid, signal.SIGCONT)
        pid = None
        received = victim.collect().wait(timeout=60)[0]
        assert received == [(seq, True) for seq in range(FROZEN_GETS)]  # all, in order
        stats = channel.stats()[0]
        assert stats["keys"][key] == {"puts": FROZEN_GETS + rounds,
                                      "gets": FROZEN_GETS + rounds, "queued": 0}
        assert stats["replies"]["queued"] == 0
        # The frozen client's replies went by its reply thread; the healthy pair's inline.
        assert stats["replies"]["sent_by_reply_threads"] > 0
        assert stats["replies"]["sent_inline"] >= 2 * rounds
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        channel.shutdown()
