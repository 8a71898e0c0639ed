"""Placement on a simulated two-node Ray cluster (two raylets on this machine)."""

import os

import pytest
import ray

from rlcomm import CollectiveGroupOptions, NodePlacementStrategy
from rlcomm.comm.identity.registry import registry
from tests.worker.test_group import AllReduceWorker


@pytest.mark.multinode
def test_node_placement_on_two_nodes(two_node_cluster):
    nodes = two_node_cluster.nodes
    group = AllReduceWorker.create_group().launch(
        two_node_cluster, NodePlacementStrategy([0, 1, 1]), name="two_nodes"
    )
    try:
        envs = group.env().wait()
        assert [e["NODE_RANK"] for e in envs] == ["0", "1", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1"]
        assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["1", "2", "2"]
        info = [w["placement"].node_rank for w in group.worker_info_list]
        assert info == [0, 1, 1]
        recorded = ray.get(registry().get_group.remote("two_nodes"))["workers"]
        assert [w["node_id"] for w in recorded] == [
            nodes[0].node_id, nodes[1].node_id, nodes[1].node_id
        ]
    finally:
        group.shutdown()


@pytest.mark.multinode
def test_resource_pool_with_uneven_nodes(two_node_cluster):
    """A [2, 4] pool: entry i on node i; LOCAL_RANK / LOCAL_WORLD_SIZE from the real layout."""
    from rlcomm.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2, 4], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(AllReduceWorker), cluster=two_node_cluster)
    try:
        envs = group.execute_all_sync("env")
        assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1", "1", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1", "2", "3"]
        assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "4", "4", "4", "4"]
        assert [e["RANK"] for e in envs] == [str(r) for r in range(6)]
        assert pool.local_rank_list() == [0, 1, 0, 1, 2, 3]
    finally:
        group.shutdown()


@pytest.mark.multinode
def test_broadcast_to_same_node_and_other_node_members(two_node_cluster):
    """The source's node-mates get shared memory; the other node gets one Gloo transfer,
    to its relay, which hands it to its node-mates; all get the object, from any source."""
    from tests.comm.test_broadcast import Caster

    group = Caster.create_group().launch(
        two_node_cluster, NodePlacementStrategy([0, 0, 1, 1, 1]), name="bc_two_nodes"
    )
    members = [("bc_two_nodes", [0, 1, 2, 3, 4])]
    try:
        for step, src in ((5, 0), (6, 3), (7, 0), (8, 2)):
            handles = [
                group.execute_on(r).cast(step, members, ("bc_two_nodes", src), source=r == src)
                for r in range(5)
            ]
            assert [h.wait(timeout=180)[0] for h in handles] == [True] * 5
        assert group.execute_on(0).broadcast_plan(members, 0).wait(timeout=60) == [
            ([1], [2, 3, 4])
        ]
        assert group.execute_on(0).broadcast_relays(members, 0).wait(timeout=60) == [{2: [3, 4]}]
        assert group.execute_on(4).broadcast_relays(members, 3).wait(timeout=60) == [{0: [1]}]
    finally:
        group.shutdown()


@pytest.mark.multinode
def test_broadcast_along_the_chain_to_another_node(two_node_cluster):
    """A payload over RLCOMM_BCAST_CHAIN_MIN_BYTES goes along the chain (here the source
    and one relay) in records (a payload no multiple of the record size), the relay hands
    it to its node-mates, and a receiver may take it into its own tensors."""
    from rlcomm import get_settings, update_settings
    from tests.comm.test_broadcast import Caster

    before = get_settings()
    update_settings(bcast_chain_min_bytes=1 << 20, bcast_chunk_bytes=300_000)
    try:
        group = Caster.create_group().launch(
            two_node_cluster, NodePlacementStrategy([0, 0, 1, 1, 1]), name="bc_chain"
        )
    finally:
        update_settings(bcast_chain_min_bytes=before.bcast_chain_min_bytes,
                        bcast_chunk_bytes=before.bcast_chunk_bytes)
    members = [("bc_chain", [0, 1, 2, 3, 4])]
    try:
        for step, src in ((5, 0), (6, 3)):
            handles = [
                group.execute_on(r).cast(step, members, ("bc_chain", src), source=r == src)
                for r in range(5)
            ]
            assert [h.wait(timeout=180)[0] for h in handles] == [True] * 5
        handles = [group.execute_on(r).cast_into(7, members, ("bc_chain", 0), source=r == 0)
                   for r in range(5)]
        assert [h.wait(timeout=180)[0] for h in handles] == [True] * 5
        # The relay of a broadcast from 0 (member 2) took 4 x 256 KiB plus a few bytes
        # in records of 300 000 bytes.
        progress = group.execute_on(2).broadcast_progress(members).wait(timeout=60)[0]
        payload = 4 * (1 << 18) + 8 + 3
        assert progress["total"] == -(-payload // 300_000), progress
        assert progress["received"] == progress["total"], progress
    finally:
        group.shutdown()


SYNC = "ws_chain"


@pytest.fixture(scope="module")
def syncers(two_node_cluster):
    """A trainer (rank 0) and a receiver beside it on the first node; a relay (rank 2) and
    its node-mate (rank 3) on the second (pool 8 MiB: the tests' state dicts stream)."""
    from tests.comm.test_weight_sync import POOL, Syncer

    group = Syncer.create_group().launch(
        two_node_cluster, NodePlacementStrategy([0, 0, 1, 1]), name=SYNC,
        env_vars={"RLCOMM_SHM_POOL_BYTES": str(POOL)},
    )
    yield group
    group.shutdown()


@pytest.mark.multinode
def test_a_broadcast_past_the_pool_streams_along_the_chain(syncers):
    """A state dict larger than the pool goes along the chain one bucket after the other
    while the source's node-mate takes it through the fan-out: the relay takes it (as an
    iterator, then whole) and hands each bucket to its node-mate through the fan-out,
    which takes it into its tensors, then as its shards; a send between the nodes
    streams over Gloo."""
    group = syncers
    members = [(SYNC, [0, 1, 2, 3])]
    src = (SYNC, 0)
    for step, hows in ((1, {1: "whole", 2: "iter", 3: "into"}),
                       (2, {1: "into", 2: "whole", 3: ("tp", 1, 2)})):
        handles = [group.execute_on(0).source(step, members=members, src=src)] + [
            group.execute_on(r).take(step, how, members=members, src=src)
            for r, how in hows.items()]
        got = [h.wait(timeout=180)[0] for h in handles]
        assert got[1:] == [True] * 3, (step, got)
    relay = group.execute_on(2).broadcast_stats(members).wait(timeout=60)[0]
    assert relay["buckets_in"] >= 8 and relay["buckets_out"] == relay["buckets_in"]
    # send/recv past the pool between the nodes (over Gloo) streams too.
    for how in ("into", "iter"):
        sent = group.execute_on(0).send_to(3, 2, group=SYNC, bucket_bytes=1 << 20)
        got = group.execute_on(2).recv_as(3, how, group=SYNC).wait(timeout=180)
        assert got == [True] and sent.wait(timeout=180) == [True]


@pytest.mark.multinode
def test_only_the_shards_a_node_takes_cross_its_link(syncers):
    """Two receivers on the other node take parts 1 and 2 of 4 of each split tensor: the
    link to their node carries those rows only (the relay's count of what came), and
    both get the values of slicing on the source; then the relay alone takes part 0
    of 2; then a node-mate takes a tensor whole, and so does the link."""
    from tests.comm.test_weight_sync import weights

    group = syncers
    sd = weights(0)
    split = sum(t.nbytes for n, t in sd.items() if n.endswith(("qkv.weight", "o.weight"))
                or n == "embed.weight")
    rest = sum(t.nbytes for t in sd.values()) - split
    cases = [([0, 2, 3], {2: ("tp", 1, 4), 3: ("tp", 2, 4)}, split // 2),
             ([0, 2], {2: ("tp", 0, 2)}, split // 2),
             ([0, 2, 3], {2: ("tp", 0, 4), 3: "whole"}, split)]
    seen: dict[tuple, int] = {}  # what the relay of each group counted so far
    for step, (ranks, hows, crossed) in enumerate(cases, 1):
        members = [(SYNC, ranks)]
        src = (SYNC, 0)
        handles = [group.execute_on(0).source(step, members=members, src=src)] + [
            group.execute_on(r).take(step, how, members=members, src=src)
            for r, how in hows.items()]
        assert [h.wait(timeout=180)[0] for h in handles][1:] == [True] * len(hows)
        relay = group.execute_on(2).broadcast_stats(members).wait(timeout=60)[0]
        came = relay["bytes_in"] - seen.get(tuple(ranks), 0)
        seen[tuple(ranks)] = relay["bytes_in"]
        assert came == rest + crossed, (step, relay, rest, crossed)


@pytest.mark.multinode
def test_a_node_mate_over_its_limit_stops_a_sync_across_nodes_at_once(syncers):
    """The relay's node-mate refuses the dict (over its RLCOMM_MAX_MESSAGE_BYTES, taking
    new tensors): the relay says so in its report before the first bucket, so every
    member raises CapacityError naming the setting long before the timeout; then the
    group goes on."""
    from tests.comm.test_weight_sync import FAST

    group = syncers
    members = [(SYNC, [0, 2, 3])]
    src = (SYNC, 0)
    assert group.execute_on(3).set_limit(4 << 20).wait(timeout=60) == [True]
    try:
        handles = [group.execute_on(0).attempt("source", 11, members=members, src=src),
                   group.execute_on(2).attempt("take", 11, "into", members=members, src=src,
                                               timeout=60),
                   group.execute_on(3).attempt("take", 11, "whole", members=members, src=src,
                                               timeout=60)]
        got = [h.wait(timeout=120)[0] for h in handles]
    finally:
        group.execute_on(3).set_limit(32 << 30).wait(timeout=60)
    for kind, text, seconds in got:
        assert kind == "CapacityError" and "RLCOMM_MAX_MESSAGE_BYTES" in text, got
        assert seconds < FAST, got
    assert f"{SYNC}:3" in got[0][1] and f"{SYNC}:3" in got[1][1], got
    handles = [group.execute_on(0).source(12, members=members, src=src)] + [
        group.execute_on(r).take(12, "into", members=members, src=src) for r in (2, 3)]
    assert [h.wait(timeout=120)[0] for h in handles][1:] == [True, True]


@pytest.mark.multinode
def test_a_relay_killed_mid_stream_is_named_by_the_source_and_its_node_mate(syncers):
    """The relay took the first tensor of a streamed sync and holds the rest; killed with
    SIGKILL, it is named gone by the source (whose route to it is cut) and by its
    node-mate (whose buckets came through it), well before their timeout. (It kills the
    module's relay: the last test of the module's group.)"""
    import signal

    from tests.waiting import actor_pid, wait_process_gone

    name, group = SYNC, syncers
    members = [(name, [0, 2, 3])]
    src = (name, 0)
    pid = actor_pid(group.workers[2])
    try:
        source = group.execute_on(0).attempt("source", 1, members=members, src=src,
                                             options=CollectiveGroupOptions(timeout=60))
        mate = group.execute_on(3).attempt("take", 1, "into", members=members, src=src,
                                           timeout=60)
        assert group.execute_on(2).first_then_hold(members, src, 60).wait(timeout=60) == [
            "embed.weight"]
        os.kill(pid, signal.SIGKILL)
        for handle in (source, mate):
            kind, text, seconds = handle.wait(timeout=120)[0]
            assert kind == "PeerLostError" and f"{name}:2" in text, (kind, text)
            assert seconds < 45, (kind, text, seconds)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_process_gone(pid)
