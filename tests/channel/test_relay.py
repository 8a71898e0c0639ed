"""Large channel items go on from the channel worker as their producer's memory (relayed
segments), and stay intact however long the consumer keeps them. Real processes: a
producer and a consumer worker and the channel worker, on one node."""

from __future__ import annotations

import pytest
import torch

from rlcomm import Channel, NodePlacementStrategy, Worker

pytestmark = pytest.mark.timeout(180)

FLOATS = 1 << 18  # 1 MiB items: above the shared-memory segment threshold


def _item(seq: int) -> torch.Tensor:
    return torch.arange(FLOATS, dtype=torch.float32) + seq * FLOATS


class Streamer(Worker):
    def put_items(self, channel: Channel, first: int, n: int) -> bool:
        for seq in range(first, first + n):
            channel.put((seq, _item(seq)))
        return True

    def keep_items(self, channel: Channel, n: int) -> list[int]:
        """Get ``n`` items and keep every one until the last came; the seqs whose
        payload was intact at the end."""
        kept = [channel.get(timeout=60) for _ in range(n)]
        return [seq for seq, t in kept if torch.equal(t, _item(seq))]

    def get_and_drop(self, channel: Channel, n: int) -> list[int]:
        out = []
        for _ in range(n):
            seq, t = channel.get(timeout=60)
            if torch.equal(t, _item(seq)):
                out.append(seq)
        return out


@pytest.fixture(scope="module")
def streamers(cluster):
    group = Streamer.create_group().launch(cluster, NodePlacementStrategy([0, 0]),
                                           name="relay_streamers")
    yield group
    group.shutdown()


def _relayed(channel: Channel) -> int:
    return channel.stats()[0]["replies"]["relayed_payloads"]


def test_items_are_relayed_and_stay_intact_while_the_consumer_keeps_them(cluster, streamers):
    channel = Channel.create("relay_keep", cluster=cluster)
    try:
        before = _relayed(channel)
        n = 120  # more than the producer's segments in flight: they must go round
        got = streamers.execute_on(1).keep_items(channel, n)
        streamers.execute_on(0).put_items(channel, 0, n).wait(timeout=120)
        assert got.wait(timeout=120)[0] == list(range(n))
        assert _relayed(channel) > before  # the worker passed producer memory on
    finally:
        channel.shutdown()


def test_a_stream_of_large_items_arrives_whole_and_in_order(cluster, streamers):
    channel = Channel.create("relay_stream", cluster=cluster)
    try:
        got = streamers.execute_on(1).get_and_drop(channel, 400)
        for first in range(0, 400, 100):
            streamers.execute_on(0).put_items(channel, first, 100).wait(timeout=120)
        assert got.wait(timeout=120)[0] == list(range(400))
        assert channel.stats()[0]["keys"]["default"]["queued"] == 0
    finally:
        channel.shutdown()
