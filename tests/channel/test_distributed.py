"""A distributed channel on a simulated two-node Ray cluster (two raylets on this machine).

Its own module: the ``two_node_cluster`` fixture restarts Ray.
"""

from __future__ import annotations

import pytest

from rlcomm import Channel, NodePlacementStrategy
from tests.channel.test_channel import Consumer, Producer


@pytest.mark.multinode
def test_keys_stay_on_the_node_that_uses_them(two_node_cluster):
    cluster = two_node_cluster
    channel = Channel.create("ch_dist", distributed=True, cluster=cluster)
    prod = Producer.create_group().launch(cluster, NodePlacementStrategy([0, 1]), name="dist_prod")
    cons = Consumer.create_group().launch(cluster, NodePlacementStrategy([0, 1]), name="dist_cons")
    try:
        n = 200
        # Rank r of each group runs on node r; each node streams its own key.
        for rank, key in ((0, "n0"), (1, "n1")):
            items = [(key, i) for i in range(n)]
            getting = cons.execute_on(rank).get_n(channel, n, key)
            prod.execute_on(rank).put_each(channel, items, key).wait(timeout=120)
            assert getting.wait(timeout=120)[0] == items
        # A key first used on node 1 keeps living there when node 0 consumes it (FIFO).
        prod.execute_on(1).put_each(channel, list(range(10)), "x1").wait(timeout=60)
        assert cons.execute_on(0).get_n(channel, 10, "x1").wait(timeout=60)[0] == list(range(10))

        stats = channel.stats()
        assert [s["node_id"] for s in stats] == [node.node_id for node in cluster.nodes]
        keys0, keys1 = stats[0]["keys"], stats[1]["keys"]
        assert keys0.get("n0") == {"puts": n, "gets": n, "queued": 0}
        assert keys1.get("n1") == {"puts": n, "gets": n, "queued": 0}
        assert keys1.get("x1") == {"puts": 10, "gets": 10, "queued": 0}
        assert "n1" not in keys0 and "x1" not in keys0 and "n0" not in keys1
        assert stats[0]["homes"] == {"n0": 0, "n1": 1, "x1": 1}  # recorded by the coordinator

        # close() reaches every node's worker.
        channel.close()
        name, text, _ = cons.execute_on(1).get_error(channel, key="n0", timeout=30).wait(timeout=60)[0]
        assert name == "ChannelClosedError" and "ch_dist" in text
    finally:
        prod.shutdown()
        cons.shutdown()
        channel.shutdown()
