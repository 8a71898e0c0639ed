"""Transport choice between real workers, large payloads, and no shared-memory leaks."""

from __future__ import annotations

import os

import pytest
import ray

from rlcomm import CollectiveGroupOptions, NodePlacementStrategy
from tests.comm.test_p2p import Peer
from tests.waiting import actor_pid, wait_process_gone


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module")
def trio(cluster):
    group = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 0, 0]), name="tx")
    yield group
    group.shutdown()


def test_same_node_pairs_use_shared_memory_unless_told(trio):
    gloo = CollectiveGroupOptions(transport="gloo")
    sizes = [10, 70_000, 1 << 20, 5 << 20]
    h = trio.execute_on(0).send_many("tx", 1, sizes)
    ok, got = trio.execute_on(1).recv_many("tx", 0, len(sizes)).wait(timeout=60)[0]
    h.wait(timeout=60)
    assert ok and got == sizes
    assert trio.execute_on(0).transport_to("tx", 1).wait(timeout=30) == ["shm"]
    h = trio.execute_on(0).send_many("tx", 2, sizes, options=gloo)
    ok, got = trio.execute_on(2).recv_many("tx", 0, len(sizes), options=gloo).wait(timeout=60)[0]
    h.wait(timeout=60)
    assert ok and got == sizes
    assert trio.execute_on(2).transport_to("tx", 0).wait(timeout=30) == ["gloo"]


def test_no_shared_memory_left_after_a_crash(cluster):
    before = _dev_shm()
    group = Peer.create_group().launch(cluster, NodePlacementStrategy([0, 0]), name="tx_crash")
    try:
        sizes = [8 << 20] * 3 + [100] * 5
        h = group.execute_on(0).send_many("tx_crash", 1, sizes)
        ok, _ = group.execute_on(1).recv_many("tx_crash", 0, len(sizes)).wait(timeout=60)[0]
        h.wait(timeout=60)
        assert ok
        # Crash both ends (SIGKILL, no cleanup code runs).
        pids = [actor_pid(actor) for actor in group.workers]
        for actor in group.workers:
            ray.kill(actor, no_restart=True)
        for pid in pids:
            wait_process_gone(pid)
    finally:
        group.shutdown()
    leaked = _dev_shm() - before
    assert not leaked, leaked
